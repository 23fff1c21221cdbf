"""Choose the plugin an engine runs with: "none", "auto" or an explicit name.

Explicit requests never fall back silently: a missing, broken or incompatible plugin raises, and a
failing guard raises UnsupportedConfiguration with the whole trace. "auto" takes a usable plugin
whose spec for the architecture passes — preferring one whose first-listed platform is this machine's kind
(its primary target), then by name — records why the others did not, and warns once about broken
plugins without raising.
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


def _auto(registry: PluginRegistry, platform: Platform, engine: EngineConfig, model: ModelConfig,
          rejections: list[str]) -> Selection | None:
    """The first passing plugin, preferring those whose first-listed platform matches (their primary target)."""
    passing = []
    for info in registry.usable():
        spec = info.spec_for(model.architecture)
        if spec is None:
            rejections.append(f"{info.name}: does not serve {model.architecture}")
            continue
        trace = evaluate(info.name, spec, platform, engine, model)
        if trace.passed:
            primary = spec.requirements.platforms[0].kind == platform.kind
            passing.append((not primary, info.name, info, spec, trace))
        else:
            rejections.append(f"{info.name}: {trace.summary()}")
    for line in rejections:
        log.info("auto: skipped %s", line)
    if not passing:
        return None
    _, _, info, spec, trace = min(passing, key=lambda p: p[:2])
    return Selection(info, spec, trace, f"auto: its guard passes on {platform.describe()}, its primary platform"
                     if spec.requirements.platforms[0].kind == platform.kind else
                     f"auto: its guard passes on {platform.describe()}")
