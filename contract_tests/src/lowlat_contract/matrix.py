"""compat_matrix.toml: released versions of core and vendors, and the combinations tested.

Parsed with tomllib into frozen records; an unknown key anywhere is an error naming it. This module
imports nothing heavy (no torch), so noxfile.py can load it from the source tree.

Schema (version 1)::

    schema = 1
    [[core]]     version, commit ("" = working tree), plugin_api
    [[vendor]]   name (distribution), plugin (entry point), path (source dir inside its repository),
                 version, commit, plugin_api, core_range (PEP 440), repo (optional: another git
                 repository, a directory or a URL; empty = this one; see checkout.py)
    [[tested]]   core, vendor, vendor_version, platform ("cpu-interpreter" | "cuda-sm90"),
                 result ("pass" | "fail" | "incompatible"), date (YYYY-MM-DD), note (optional),
                 vendor_commit (optional: the vendor commit that ran, recorded by nox)
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PLATFORMS = ("cpu-interpreter", "cuda-sm90")
RESULTS = ("pass", "fail", "incompatible")


class MatrixError(ValueError):
    """compat_matrix.toml is malformed; the message names the table, the entry and the key."""


@dataclass(frozen=True)
class CoreRelease:
    version: str
    commit: str
    plugin_api: int


@dataclass(frozen=True)
class VendorRelease:
    name: str
    plugin: str
    path: str
    version: str
    commit: str
    plugin_api: int
    core_range: str
    repo: str = ""


@dataclass(frozen=True)
class TestedCombination:
    __test__ = False  # not a pytest test class

    core: str
    vendor: str
    vendor_version: str
    platform: str
    result: str
    date: str
    note: str = ""
    vendor_commit: str = ""

    @property
    def id(self) -> str:
        """A readable id such as ``core-0.1.0__lowlat-nvidia-mega-0.1.0__cpu-interpreter``."""
        return f"core-{self.core}__{self.vendor}-{self.vendor_version}__{self.platform}"


@dataclass(frozen=True)
class Matrix:
    schema: int
    core: tuple[CoreRelease, ...]
    vendors: tuple[VendorRelease, ...]
    tested: tuple[TestedCombination, ...]

    def core_release(self, version: str) -> CoreRelease:
        for c in self.core:
            if c.version == version:
                return c
        raise MatrixError(f"no [[core]] entry with version {version!r}")

    def vendor_release(self, name: str, version: str) -> VendorRelease:
        for v in self.vendors:
            if (v.name, v.version) == (name, version):
                return v
        raise MatrixError(f"no [[vendor]] entry {name} {version}")


def _records(data: dict[str, Any], table: str, cls: type) -> tuple[Any, ...]:
    names = {f.name for f in fields(cls)}
    out = []
    for i, entry in enumerate(data.get(table, [])):
        unknown = sorted(set(entry) - names)
        if unknown:
            raise MatrixError(f"[[{table}]] entry {i}: unknown key(s) {', '.join(unknown)}; known: {', '.join(names)}")
        try:
            out.append(cls(**entry))
        except TypeError as e:
            raise MatrixError(f"[[{table}]] entry {i}: {e}") from None
    return tuple(out)


def parse_matrix(text: str) -> Matrix:
    """Parse the TOML text. Raises MatrixError on unknown keys, bad values or dangling references."""
    data = tomllib.loads(text)
    unknown = sorted(set(data) - {"schema", "core", "vendor", "tested"})
    if unknown:
        raise MatrixError(f"unknown top-level key(s) {', '.join(unknown)}")
    if data.get("schema") != 1:
        raise MatrixError(f"schema must be 1, got {data.get('schema')!r}")
    m = Matrix(1, _records(data, "core", CoreRelease), _records(data, "vendor", VendorRelease),
               _records(data, "tested", TestedCombination))
    for t in m.tested:
        if t.platform not in PLATFORMS:
            raise MatrixError(f"[[tested]] {t.id}: platform must be one of {PLATFORMS}")
        if t.result not in RESULTS:
            raise MatrixError(f"[[tested]] {t.id}: result must be one of {RESULTS}")
        m.core_release(t.core)
        m.vendor_release(t.vendor, t.vendor_version)
    return m


def load_matrix(path: str | Path) -> Matrix:
    """Read and parse ``path`` (compat_matrix.toml)."""
    return parse_matrix(Path(path).read_text())


TESTED_MARKER = "# --- tested combinations: `nox -s contract -- --update` rewrites everything below this line ---"


def render_tested(entries: tuple[TestedCombination, ...] | list[TestedCombination]) -> str:
    """The [[tested]] tables as TOML text, in a stable order (core, vendor, vendor version, platform)."""
    out = []
    for t in sorted(entries, key=lambda e: (e.core, e.vendor, e.vendor_version, e.platform)):
        lines = ["[[tested]]"] + [f'{f.name} = "{getattr(t, f.name)}"' for f in fields(t)
                                  if getattr(t, f.name) or f.name not in ("note", "vendor_commit")]
        out.append("\n".join(lines))
    return "\n\n".join(out) + ("\n" if out else "")


def with_result(text: str, result: TestedCombination) -> str:
    """``text`` (compat_matrix.toml) with ``result`` replacing the entry of the same combination, or added.

    Everything above TESTED_MARKER is kept byte for byte; the tested tables below it are re-rendered.
    Raises:
        MatrixError: the new text would not parse (e.g. the result names an unknown release).
    """
    matrix = parse_matrix(text)
    key = (result.core, result.vendor, result.vendor_version, result.platform)
    kept = [t for t in matrix.tested if (t.core, t.vendor, t.vendor_version, t.platform) != key]
    head = text.split(TESTED_MARKER)[0].rstrip("\n")
    new = f"{head}\n\n{TESTED_MARKER}\n\n{render_tested([*kept, result])}"
    parse_matrix(new)
    return new
