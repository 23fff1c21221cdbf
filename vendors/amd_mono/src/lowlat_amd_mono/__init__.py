"""lowlat plugin `amd_mono`: the module its `lowlat.plugins` entry point names.

Importing it is cheap: kernels load only when an engine calls the spec's `build`.
"""

from __future__ import annotations

from lowlat.plugin import hookimpl

from lowlat_amd_mono.specs import model_specs


@hookimpl
def lowlat_model_specs():  # type: ignore[no-untyped-def]
    """The specs this plugin serves (see specs.py)."""
    return model_specs()
