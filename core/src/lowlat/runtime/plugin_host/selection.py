"""Choose the plugin an engine runs with: "none", "auto" or an explicit name.

Explicit requests never fall back silently: a missing, broken or incompatible plugin raises, and a
failing guard raises UnsupportedConfiguration with the whole trace. "auto" takes, by name, the usable plugins
made for this machine's platform kind (the spec's ``requirements.made_for``, else its first-listed platform)
whose spec for the architecture passes, records why the others were left out, and warns once about broken
plugins without raising; ``PluginHost.build`` tries the candidates in order when one fails to build. A plugin
whose guard passes on a platform it is not made for (amd_mono on CUDA, any plugin under the CPU interpreter)
runs there only when asked for by name: amd_mono on the H200 measured 0.72-0.79x the general path at every
shape (vendors/amd_mono/docs/design.md), so "auto" choosing it there would make decoding slower.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from lowlat.config import EngineConfig, ModelConfig
from lowlat.errors import UnsupportedConfiguration
from lowlat.platform import Platform
from lowlat.plugin.spec import ModelSpec
from lowlat.runtime.plugin_host.discovery import PluginInfo, PluginRegistry
from lowlat.runtime.plugin_host.guard import GuardTrace, evaluate

log = logging.getLogger("lowlat.plugin")


@dataclass(frozen=True)
class Selection:
    """The chosen plugin, its spec, the passing trace, and why it was chosen (one line)."""

    plugin: PluginInfo
    spec: ModelSpec
    trace: GuardTrace
    reason: str


def select_plugin(
    registry: PluginRegistry, request: str, platform: Platform, engine: EngineConfig, model: ModelConfig,
    rejections: list[str] | None = None,
) -> Selection | None:
    """Resolve ``request`` ("none", "auto" or a plugin name) for this model on this machine.

    Args:
        rejections: when given, "auto" appends one line per plugin it skipped, saying why.
    Returns:
        The Selection, or None for "none" and for "auto" when no plugin passes.
    Raises:
        PluginNotFound, PluginLoadError, IncompatibleCoreVersion: the named plugin cannot be used.
        UnsupportedConfiguration: the named plugin does not serve the architecture or its guard fails.
    """
    if request == "none":
        return None
    if request == "auto":
        return _auto(registry, platform, engine, model, rejections if rejections is not None else [])
    info = registry.get(request)
    spec = info.spec_for(model.architecture)
    if spec is None:
        served = ", ".join(s.architecture for s in info.specs)
        raise UnsupportedConfiguration(
            f"plugin {request!r} does not serve {model.architecture} (it serves {served}); use --plugin none or auto"
        )
    trace = evaluate(info.name, spec, platform, engine, model)
    if not trace.passed:
        raise UnsupportedConfiguration(
            f"plugin {request!r} cannot run this configuration: {trace.summary()}\n{trace.format()}", trace
        )
    return Selection(info, spec, trace, f"requested explicitly; every requirement passes ({platform.describe()})")


def auto_candidates(registry: PluginRegistry, platform: Platform, engine: EngineConfig, model: ModelConfig,
                    rejections: list[str]) -> list[Selection]:
    """Every usable plugin made for this platform kind whose spec passes here, by name.

    A spec is made for the kinds in ``requirements.made_for``; a spec that does not declare it is made for its
    first-listed platform. Skipped plugins (unusable, not serving the architecture, not made for this platform
    kind, guard failing) each add one line to ``rejections``.
    """
    passing = []
    for info in sorted(registry.plugins.values(), key=lambda i: i.name):
        if info.status != "ok":
            rejections.append(f"{info.name}: {info.status}: {info.error}")
    for info in registry.usable():
        spec = info.spec_for(model.architecture)
        if spec is None:
            rejections.append(f"{info.name}: does not serve {model.architecture}")
            continue
        trace = evaluate(info.name, spec, platform, engine, model)
        if not trace.passed:
            rejections.append(f"{info.name}: {trace.summary()}")
        elif not made_for_here(spec, platform):
            rejections.append(f"{info.name}: made for {', '.join(made_for(spec))}, not {platform.kind}; its guard "
                              f"passes here, so it runs when asked for by name (--plugin {info.name})")
        else:
            passing.append((info, spec, trace))
    for line in rejections:
        log.info("auto: skipped %s", line)
    out = []
    for i, (info, spec, trace) in enumerate(passing):  # registry.usable() lists them by name
        why = f"auto: made for {platform.kind} and its guard passes on {platform.describe()}"
        if i == 0 and len(passing) > 1:
            why += f"; first by name of {', '.join(p[0].name for p in passing)}"
        out.append(Selection(info, spec, trace, why))
    return out


def made_for(spec: ModelSpec) -> tuple[str, ...]:
    """The platform kinds ``spec`` is made for: ``requirements.made_for``, else its first-listed platform's."""
    req = spec.requirements
    return req.made_for or (req.platforms[0].kind,)


def made_for_here(spec: ModelSpec, platform: Platform) -> bool:
    """Whether ``spec`` is made for this platform kind (``made_for``)."""
    return platform.kind in made_for(spec)


def _auto(registry: PluginRegistry, platform: Platform, engine: EngineConfig, model: ModelConfig,
          rejections: list[str]) -> Selection | None:
    cands = auto_candidates(registry, platform, engine, model, rejections)
    return cands[0] if cands else None
