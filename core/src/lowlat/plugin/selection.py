"""Choose the plugin an engine runs with: "none", "auto" or an explicit name.

Explicit requests never fall back silently: a missing, broken or incompatible plugin raises, and a
failing guard raises UnsupportedConfiguration with the whole trace. "auto" ranks the usable plugins
whose spec for the architecture passes — those made for this machine's platform kind first (the spec's
``requirements.made_for``, else its first-listed platform), then by name — records why the others did not,
and warns once about broken plugins without raising; ``PluginHost.build`` tries the ranked candidates in
order when one fails to build.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from lowlat.config import EngineConfig, ModelConfig
from lowlat.platform import Platform
from lowlat.plugin.discovery import PluginInfo, PluginRegistry
from lowlat.plugin.errors import UnsupportedConfiguration
from lowlat.plugin.guard import GuardTrace, evaluate
from lowlat.plugin.spec import ModelSpec

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
    """Every usable plugin whose spec passes here, best first: those made for this platform kind, then by name.

    A spec is made for the kinds in ``requirements.made_for``; a spec that does not declare it is made for its
    first-listed platform. Skipped plugins (unusable, not serving the architecture, guard failing) each add
    one line to ``rejections``.
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
        if trace.passed:
            passing.append((not made_for_here(spec, platform), info.name, info, spec, trace))
        else:
            rejections.append(f"{info.name}: {trace.summary()}")
    for line in rejections:
        log.info("auto: skipped %s", line)
    passing.sort(key=lambda p: p[:2])
    out = []
    for i, (_, _name, info, spec, trace) in enumerate(passing):
        why = f"auto: made for {platform.kind} and its guard passes on {platform.describe()}" \
            if made_for_here(spec, platform) else f"auto: its guard passes on {platform.describe()}"
        if i == 0 and len(passing) > 1:
            why += f"; preferred over {', '.join(p[1] for p in passing[1:])}"
        out.append(Selection(info, spec, trace, why))
    return out


def made_for_here(spec: ModelSpec, platform: Platform) -> bool:
    """Whether ``spec`` is made for this platform kind (``made_for``, else its first-listed platform)."""
    req = spec.requirements
    return platform.kind in (req.made_for or (req.platforms[0].kind,))


def _auto(registry: PluginRegistry, platform: Platform, engine: EngineConfig, model: ModelConfig,
          rejections: list[str]) -> Selection | None:
    cands = auto_candidates(registry, platform, engine, model, rejections)
    return cands[0] if cands else None
