"""Build real installed plugin distributions (dist-info metadata + module) in a temporary site dir.

Discovery is tested against what importlib.metadata really reads, not mocks of it.
"""

from __future__ import annotations

import importlib
import sys
import textwrap
from pathlib import Path

GOOD_SPEC = """
from lowlat.plugin import Coverage, ModelSpec, PlatformRequirement, Requirements, hookimpl
from lowlat.forward_batch import ForwardMode

@hookimpl
def lowlat_model_specs():
    return [ModelSpec(
        architecture="LlamaForCausalLM",
        requirements=Requirements(platforms=(PlatformRequirement("cpu"),), dtypes=frozenset({"float32"})),
        coverage=Coverage(modes=frozenset({ForwardMode.DECODE}), max_tokens=8),
        build="%(module)s:build",
    )]

def build(binding):
    raise RuntimeError("not built")
"""


def make_plugin_dist(site: Path, name: str, source: str, *, dist: str | None = None, version: str = "1.0",
                     requires: tuple[str, ...] = ("lowlat>=0.3,<0.4",)) -> str:
    """Write a plugin distribution into ``site``; returns its module name.

    ``source`` is the module's code; ``%(module)s`` in it is replaced by the module name.
    """
    dist = dist or f"lowlat-test-{name.replace('_', '-')}"
    module = f"_lowlat_test_{name}"
    site.mkdir(parents=True, exist_ok=True)
    (site / f"{module}.py").write_text(textwrap.dedent(source % {"module": module}))
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    meta = ["Metadata-Version: 2.1", f"Name: {dist}", f"Version: {version}"]
    meta += [f"Requires-Dist: {r}" for r in requires]
    (info / "METADATA").write_text("\n".join(meta) + "\n")
    (info / "entry_points.txt").write_text(f"[lowlat.plugins]\n{name} = {module}\n")
    (info / "RECORD").write_text("")
    return module


def activate(site: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Put ``site`` on sys.path for this test and limit discovery to the plugins made there."""
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    for mod in [m for m in sys.modules if m.startswith("_lowlat_test_")]:
        monkeypatch.delitem(sys.modules, mod)
