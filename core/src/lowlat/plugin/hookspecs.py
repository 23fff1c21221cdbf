"""The pluggy hook specifications of the plugin API (the hook is unchanged since API 1).

A vendor module (the target of its ``lowlat.plugins`` entry point) implements::

    from lowlat.plugin import hookimpl

    @hookimpl
    def lowlat_model_specs():
        return [ModelSpec(...), ...]

pluggy validates the implementation against these specs at registration (argument names must match).
"""

from __future__ import annotations

import pluggy

PROJECT_NAME = "lowlat"
ENTRY_POINT_GROUP = "lowlat.plugins"
PLUGIN_API_VERSION = 4  # 4: binding.peer_buffers + lowlat.plugin.peer (TP inside kernels); 3: lowlat.plugin is the
# whole vendor API (ReferenceStep, sampled ids); 2: rope_tables

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def lowlat_model_specs() -> list:  # type: ignore[type-arg]
    """Return the plugin's ModelSpecs (or mappings with the same fields), one per architecture."""
    raise NotImplementedError  # pragma: no cover - hookspec bodies are never called
