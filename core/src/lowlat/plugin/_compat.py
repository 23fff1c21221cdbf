"""Plugin API 2 names, kept through core 0.3.x: each warns once where it is used and names the new import.

API 3 made ``lowlat.plugin`` the vendor API only. The host side (discovery, the guard, selection, the plugin
host, the dispatcher) moved to ``lowlat.runtime``; the ground types to ``lowlat.forward_batch``,
``lowlat.kv_cache`` and ``lowlat.errors``. The old names resolve here *by name* (``importlib``), lazily, so
the plugin floor imports nothing above it; they go away in core 0.4.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

HOST_NAMES: dict[str, str] = {
    "discover": "lowlat.runtime.plugin_host",
    "PluginInfo": "lowlat.runtime.plugin_host",
    "PluginRegistry": "lowlat.runtime.plugin_host",
    "evaluate": "lowlat.runtime.plugin_host",
    "GuardTrace": "lowlat.runtime.plugin_host",
    "RequirementResult": "lowlat.runtime.plugin_host",
    "Selection": "lowlat.runtime.plugin_host",
    "select_plugin": "lowlat.runtime.plugin_host",
}
"""Host-side names ``from lowlat.plugin import X`` gave in API 2 -> the module that has them now."""

MODULES: dict[str, str] = {
    "lowlat.plugin.discovery": "lowlat.runtime.plugin_host.discovery",
    "lowlat.plugin.guard": "lowlat.runtime.plugin_host.guard",
    "lowlat.plugin.selection": "lowlat.runtime.plugin_host.selection",
    "lowlat.plugin.host": "lowlat.runtime.plugin_host.host",
    "lowlat.plugin.dispatch": "lowlat.runtime.dispatch",
    "lowlat.plugin.agreement": "lowlat.runtime.plugin_host.agreement",
    "lowlat.plugin.param_guard": "lowlat.runtime.plugin_host.param_guard",
}
"""API 2 plugin submodules -> where they live now."""


def host_name(name: str) -> Any:
    """``lowlat.plugin.<name>`` for an API 2 host-side name, with a DeprecationWarning; AttributeError else."""
    module = HOST_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'lowlat.plugin' has no attribute {name!r}")
    warnings.warn(f"lowlat.plugin.{name} is host-side and not plugin API 3: import it from {module} "
                  f"(the API 2 name goes away in lowlat 0.4)", DeprecationWarning, stacklevel=3)
    return getattr(importlib.import_module(module), name)


def moved_module(old: str) -> Any:
    """The module that API 2's ``old`` module became, with a DeprecationWarning naming it."""
    new = MODULES[old]
    warnings.warn(f"{old} moved to {new} (host-side, not plugin API 3); it goes away in lowlat 0.4",
                  DeprecationWarning, stacklevel=3)
    return importlib.import_module(new)
