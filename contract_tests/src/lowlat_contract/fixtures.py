"""Expose the suite's own plugins (the reference and the broken ones) as installed plugins in a site dir.

``install_fixture_plugins(site_dir)`` writes one real ``*.dist-info`` per plugin (METADATA with a
``Requires-Dist`` on lowlat, ``entry_points.txt`` in the ``lowlat.plugins`` group, RECORD), exactly what pip
would leave, so discovery reads them through importlib.metadata like any vendor's. Put ``site_dir`` on
``sys.path`` (or ``PYTHONPATH`` for a subprocess) to see them; nothing is installed anywhere else, so
``lowlat run --plugin auto`` in a normal environment never picks them.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

from lowlat_contract import __version__

FIXTURE_PLUGINS: dict[str, str] = {
    "reference": "lowlat_contract.plugins.reference:HOOKS",
    "broken_kv_slot": "lowlat_contract.plugins.broken:KV_SLOT_HOOKS",
    "broken_ignores_weight": "lowlat_contract.plugins.broken:IGNORES_WEIGHT_HOOKS",
    "broken_verify": "lowlat_contract.plugins.broken:VERIFY_HOOKS",
    "broken_dtype": "lowlat_contract.plugins.broken:DTYPE_HOOKS",
    "broken_rank": "lowlat_contract.plugins.broken:RANK_HOOKS",
    "broken_input_edit": "lowlat_contract.plugins.broken:INPUT_EDIT_HOOKS",
    "broken_late_state": "lowlat_contract.plugins.broken:LATE_STATE_HOOKS",
    "broken_bias": "lowlat_contract.plugins.broken:BIAS_HOOKS",
    "broken_one_row": "lowlat_contract.plugins.broken:ONE_ROW_HOOKS",
    "broken_leak": "lowlat_contract.plugins.broken:LEAK_HOOKS",
}
"""Plugin name -> entry point value (an object whose ``lowlat_model_specs`` hook returns its specs)."""

DEFAULT_CORE_RANGE = ">=0.2,<0.3"


def core_range() -> str:
    """The core range this distribution declares (its own Requires-Dist on lowlat); the fixtures declare it too."""
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        lines = metadata.requires("lowlat-contract-tests") or []
    except metadata.PackageNotFoundError:
        return DEFAULT_CORE_RANGE
    for line in lines:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.name == "lowlat" and req.marker is None and str(req.specifier):
            return str(req.specifier)
    return DEFAULT_CORE_RANGE


def install_fixture_plugins(site_dir: str | Path, names: list[str] | None = None) -> list[str]:
    """Write dist-info for the fixture plugins ``names`` (default: all of FIXTURE_PLUGINS) into ``site_dir``.

    Returns:
        The plugin names written.
    Raises:
        KeyError: a name that is not a fixture plugin (the message lists them).
        FileExistsError: ``site_dir`` already holds that plugin's dist-info.
    """
    site = Path(site_dir)
    site.mkdir(parents=True, exist_ok=True)
    names = list(FIXTURE_PLUGINS) if names is None else names
    unknown = [n for n in names if n not in FIXTURE_PLUGINS]
    if unknown:
        raise KeyError(f"{unknown} are not fixture plugins; known: {', '.join(FIXTURE_PLUGINS)}")
    requires = core_range()
    for name in names:
        dist = f"lowlat-contract-fixture-{name.replace('_', '-')}"
        info = site / f"{dist.replace('-', '_')}-{__version__}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {__version__}\n"
                                       f"Summary: lowlat contract-suite fixture plugin {name}\n"
                                       f"Requires-Dist: lowlat{requires}\n")
        (info / "entry_points.txt").write_text(f"[lowlat.plugins]\n{name} = {FIXTURE_PLUGINS[name]}\n")
        (info / "RECORD").write_text(f"{info.name}/METADATA,,\n{info.name}/entry_points.txt,,\n{info.name}/RECORD,,\n")
    return names


def register_module_plugin(target: str, site_dir: str | Path) -> str:
    """Make a plugin defined in a module visible to discovery, as if installed; returns its plugin name.

    ``target`` is ``NAME=package.module:OBJECT`` or ``package.module:OBJECT`` (then NAME is OBJECT lower-cased,
    e.g. ``mutants:STALE_KV_HOOKS`` -> ``stale_kv_hooks``); OBJECT is what an entry point would name (an object
    or module whose ``lowlat_model_specs`` hook returns the specs). One dist-info declaring this distribution's
    core range is written into ``site_dir``, which is put first on ``sys.path`` (and ``PYTHONPATH``, for the TP
    check's subprocesses). Raises ValueError for a malformed target, ImportError when OBJECT cannot be imported.
    """
    import importlib
    import os
    import sys

    name, _, value = target.rpartition("=")
    module, sep, obj = value.partition(":")
    if not sep or not module or not obj.isidentifier():
        raise ValueError(f"--lowlat-plugin {target!r}: expected NAME=package.module:OBJECT or package.module:OBJECT")
    name = name or obj.lower()
    if not getattr(importlib.import_module(module), obj, None):
        raise ImportError(f"--lowlat-plugin {target!r}: module {module} has no attribute {obj}")
    site = Path(site_dir)
    dist = f"lowlat-contract-module-{name.replace('_', '-')}"
    info = site / f"{dist.replace('-', '_')}-{__version__}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {__version__}\n"
                                   f"Summary: lowlat plugin {name} from {value}\nRequires-Dist: lowlat{core_range()}\n")
    (info / "entry_points.txt").write_text(f"[lowlat.plugins]\n{name} = {value}\n")
    (info / "RECORD").write_text(f"{info.name}/METADATA,,\n{info.name}/entry_points.txt,,\n{info.name}/RECORD,,\n")
    sys.path.insert(0, str(site))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    importlib.invalidate_caches()
    return name
