"""The plugin host: discover installed plugins, evaluate their guards, select one, and build it for a runner.

Host-side only (plugins never import it): ``discover`` -> ``PluginRegistry``; ``evaluate`` -> ``GuardTrace``;
``select_plugin`` -> ``Selection``; ``PluginHost`` runs those stages for one ModelRunner (DESIGN §4's order).
Public names are re-exported here once; the modules beside this file are the implementation.
"""

from lowlat.runtime.plugin_host.discovery import PluginInfo, PluginRegistry, core_version, discover, load_callable
from lowlat.runtime.plugin_host.guard import GuardTrace, RequirementResult, evaluate
from lowlat.runtime.plugin_host.host import PluginHost
from lowlat.runtime.plugin_host.selection import Selection, select_plugin

__all__ = [
    "GuardTrace",
    "PluginHost",
    "PluginInfo",
    "PluginRegistry",
    "RequirementResult",
    "Selection",
    "core_version",
    "discover",
    "evaluate",
    "load_callable",
    "select_plugin",
]
