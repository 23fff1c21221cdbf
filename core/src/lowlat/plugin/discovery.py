"""Discovery: find ``lowlat.plugins`` entry points, load each in isolation, register it with pluggy.

A plugin that fails to import, whose hooks pluggy rejects, whose spec is malformed, or whose declared
core range excludes the running core is kept in the registry as broken or incompatible, with its
distribution, version and the reason; the other plugins still load.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
import traceback
from dataclasses import dataclass, field
from importlib import metadata
from types import ModuleType
from typing import Any

import pluggy
from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import Version

from lowlat.plugin import hookspecs
from lowlat.plugin.errors import IncompatibleCoreVersion, PluginLoadError, PluginNotFound, SpecError
from lowlat.plugin.spec import ModelSpec, coerce_spec

log = logging.getLogger("lowlat.plugin")
OK, BROKEN, INCOMPATIBLE = "ok", "broken", "incompatible"
ALLOWLIST_ENV = "LOWLAT_PLUGINS"


@dataclass(frozen=True)
class PluginInfo:
    """One discovered plugin.

    Attributes:
        name: the entry point name (what ``--plugin NAME`` takes).
        distribution, version: the installed distribution that declares it.
        core_range: its Requires-Dist specifier on lowlat ("" when it declares none).
        status: "ok", "broken" or "incompatible".
        error: why it is not ok (with the remedy), "" when ok.
        traceback: the import or registration traceback of a broken plugin.
        specs: its ModelSpecs, in registration order (empty unless ok).
    """

    name: str
    distribution: str
    version: str
    core_range: str
    status: str
    error: str = ""
    traceback: str = ""
    specs: tuple[ModelSpec, ...] = ()
    module: ModuleType | None = field(default=None, repr=False, compare=False)

    def spec_for(self, architecture: str) -> ModelSpec | None:
        """The spec serving ``architecture``, or None."""
        return next((s for s in self.specs if s.architecture == architecture), None)

    def raise_if_unusable(self) -> None:
        """Raise the error that explains why this plugin cannot be used; return when it is ok."""
        if self.status == INCOMPATIBLE:
            raise IncompatibleCoreVersion(self.error)
        if self.status == BROKEN:
            raise PluginLoadError(f"plugin {self.name!r} ({self.distribution} {self.version}) is broken: {self.error}")


@dataclass
class PluginRegistry:
    """All plugins discovered in this process, by name."""

    plugins: dict[str, PluginInfo]
    core_version: str
    manager: pluggy.PluginManager = field(repr=False)
    _warned: set[str] = field(default_factory=set, repr=False)

    def get(self, name: str) -> PluginInfo:
        """The usable plugin ``name``. Raises PluginNotFound, PluginLoadError or IncompatibleCoreVersion."""
        info = self.plugins.get(name)
        if info is None:
            found = ", ".join(sorted(self.plugins)) or "none"
            close = difflib.get_close_matches(name.replace("-", "_"), list(self.plugins), n=1, cutoff=0.6)
            if close:
                hint = f"did you mean {close[0]!r}?"
            elif name.replace("_", "-") in _core_extras():
                hint = f"install its distribution: pip install 'lowlat[{name.replace('_', '-')}]'"
            else:
                hint = "install the vendor distribution that provides it"
            raise PluginNotFound(f"no plugin named {name!r} is installed (found: {found}); {hint} "
                                 f"(or check {ALLOWLIST_ENV})")
        info.raise_if_unusable()
        return info

    def usable(self) -> list[PluginInfo]:
        """Ok plugins sorted by name; warns once per process about each unusable one."""
        for info in self.plugins.values():
            if info.status != OK and info.name not in self._warned:
                self._warned.add(info.name)
                log.warning("plugin %s (%s %s) skipped: %s", info.name, info.distribution, info.version, info.error)
        return [p for _, p in sorted(self.plugins.items()) if p.status == OK]


def core_version() -> str:
    """The running core's version (the installed distribution ``lowlat``)."""
    try:
        return metadata.version("lowlat")
    except metadata.PackageNotFoundError:
        from lowlat import __version__

        return __version__


def discover(allowlist: list[str] | None = None) -> PluginRegistry:
    """Discover and load every installed plugin.

    Args:
        allowlist: plugin names to load; None reads LOWLAT_PLUGINS (comma-separated), unset means all.
    Raises:
        PluginNotFound: an allowlisted name matches no entry point (the message names those found).
    """
    if allowlist is None:
        allowlist = parse_allowlist(os.environ.get(ALLOWLIST_ENV, ""))
    all_eps = list(metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP))
    eps = {ep.name: ep for ep in all_eps}
    if allowlist is not None:
        unknown = sorted(set(allowlist) - set(eps))
        if unknown:
            raise PluginNotFound(
                f"{ALLOWLIST_ENV} names {', '.join(unknown)}, which match no installed plugin; "
                f"found: {', '.join(sorted(eps)) or 'none'}"
            )
        eps = {n: ep for n, ep in eps.items() if n in allowlist}
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    core = core_version()
    dups = _duplicates(all_eps)
    plugins = {name: _duplicate_info(name, dups[name]) if name in dups else _load_one(pm, ep, core)
               for name, ep in sorted(eps.items())}
    return PluginRegistry(plugins, core, pm)


def parse_allowlist(value: str) -> list[str] | None:
    """The plugin names of a LOWLAT_PLUGINS value ("a,b"); None when it is unset or blank (all plugins).

    Raises:
        PluginNotFound: an empty entry ("a,,b"), a name with characters an entry point name cannot have
            ("a;b", "a b") or a name given twice; the message lists every entry found.
    """
    if not value.strip():
        return None
    items = [n.strip() for n in value.split(",")]
    if items and items[-1] == "" and len(items) > 1:
        items = items[:-1]  # a trailing comma is harmless
    bad = [n for n in items if not _NAME.fullmatch(n)]
    twice = sorted({n for n in items if items.count(n) > 1})
    if bad or twice:
        why = (f"invalid name(s) {', '.join(repr(b) for b in bad)}" if bad else "") + \
              ("; " if bad and twice else "") + (f"named twice: {', '.join(twice)}" if twice else "")
        raise PluginNotFound(f"{ALLOWLIST_ENV}={value!r} is malformed ({why}); found entries "
                             f"{[n for n in items]}; give comma-separated plugin names, e.g. "
                             f"{ALLOWLIST_ENV}=nvidia_mega,amd_mono")
    return items


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")


def _duplicates(eps: list[metadata.EntryPoint]) -> dict[str, list[metadata.EntryPoint]]:
    by_name: dict[str, list[metadata.EntryPoint]] = {}
    for ep in eps:
        by_name.setdefault(ep.name, []).append(ep)
    return {n: v for n, v in by_name.items() if len(v) > 1}


def _duplicate_info(name: str, eps: list[metadata.EntryPoint]) -> PluginInfo:
    """Two distributions declaring one plugin name: neither loads (which one would run is an accident)."""
    found = [f"{ep.dist.metadata['Name'] if ep.dist else '?'} {ep.dist.version if ep.dist else '?'} ({ep.value})"
             for ep in eps]
    dists = ", ".join(ep.dist.metadata["Name"] if ep.dist else "?" for ep in eps)
    return PluginInfo(name=name, distribution=dists, version="(several)",
                      core_range="", status=BROKEN,
                      error=f"plugin name {name!r} is declared by {len(eps)} distributions: {'; '.join(found)}; "
                            f"uninstall all but one")


def _load_one(pm: pluggy.PluginManager, ep: metadata.EntryPoint, core: str) -> PluginInfo:
    dist = ep.dist
    dist_name = dist.metadata["Name"] if dist is not None else "?"
    dist_version = dist.version if dist is not None else "?"
    core_range = _core_range(dist)
    base: dict[str, Any] = dict(name=ep.name, distribution=dist_name, version=dist_version, core_range=core_range)
    if core_range and not Requirement(f"lowlat{core_range}").specifier.contains(Version(core), prereleases=True):
        return PluginInfo(**base, status=INCOMPATIBLE, error=_incompatible_message(ep.name, dist_name, dist_version,
                                                                                     core_range, core))
    try:
        module = ep.load()
        pm.register(module, name=ep.name)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # a plugin's import may raise anything, sys.exit() too; isolate it
        return PluginInfo(**base, status=BROKEN, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
    specs: list[ModelSpec] = []
    try:
        for impl in pm.hook.lowlat_model_specs.get_hookimpls():
            if impl.plugin_name == ep.name:
                returned: Any = impl.function() or []
                specs += [coerce_spec(s) for s in returned]
        archs = [s.architecture for s in specs]
        if len(set(archs)) != len(archs):
            raise SpecError(f"two specs serve the same architecture: {archs}")
        if not specs:
            raise SpecError("lowlat_model_specs returned no spec")
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # SystemExit from a hook is contained like any error
        pm.unregister(name=ep.name)
        return PluginInfo(**base, status=BROKEN, error=f"invalid spec from plugin {ep.name!r}: {e}",
                          traceback=traceback.format_exc())
    return PluginInfo(**base, status=OK, specs=tuple(specs), module=module)


def _core_range(dist: metadata.Distribution | None) -> str:
    for line in (dist.requires or []) if dist is not None else []:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.name == "lowlat" and (req.marker is None or req.marker.evaluate({"extra": ""})):
            return str(req.specifier)
    return ""


def _incompatible_message(name: str, dist: str, version: str, core_range: str, core: str) -> str:
    spec = Requirement(f"lowlat{core_range}").specifier
    lows = [s.version for s in spec if s.operator in (">=", ">", "==", "~=")]
    if lows and Version(core) < Version(max(lows, key=Version)):
        remedy = f"install lowlat{core_range} (pip install 'lowlat{core_range}') or an older {dist}"
    else:
        remedy = f"install a newer {dist} (pip install -U {dist}) or lowlat{core_range}"
    return (f"plugin {name!r} ({dist} {version}) requires lowlat{core_range}, but lowlat {core} is running; "
            f"{remedy}")


def load_callable(path: str, plugin: str):  # type: ignore[no-untyped-def]
    """Import ``"package.module:function"`` lazily. Raises PluginLoadError naming the plugin and the path."""
    import importlib

    module_name, _, attr = path.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # SystemExit at import included
        raise PluginLoadError(f"plugin {plugin!r}: cannot import {path}: {type(e).__name__}: {e}") from e


def _core_extras() -> set[str]:
    """The optional-dependency extras core declares (``lowlat[nvidia-mega]`` ...), from its installed metadata."""
    try:
        return set(metadata.metadata("lowlat").get_all("Provides-Extra") or [])
    except metadata.PackageNotFoundError:
        return set()
