"""docs/writing-a-plugin.md's one-stage plugin, exactly as printed: under 40 lines, and it passes the contract suite.

The block that starts with ``# lowlat_onekernel.py`` is written to a module in a site dir with a dist-info whose
entry point names it (as ``pip install`` would) and the contract suite's quick subset runs on it in a
subprocess, as a vendor runs it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from lowlat.kit import plugin_names
from plugin_dists import make_plugin_dist

DOC = Path(__file__).resolve().parents[2] / "docs" / "writing-a-plugin.md"
QUICK = "guard or output_convention or logits_match or kv_writes"


def one_stage_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    found = [b for b in blocks if b.startswith("# lowlat_onekernel.py")]
    assert len(found) == 1, "docs/writing-a-plugin.md must hold one block starting '# lowlat_onekernel.py'"
    return found[0]


def test_the_example_is_under_40_lines_of_its_own():
    lines = [ln for ln in one_stage_example().splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert len(lines) < 40, f"{len(lines)} lines"
    assert "class FusedAddNormStep(ReferenceStep)" in one_stage_example()


def test_the_example_passes_the_contract_suite(tmp_path):
    site = tmp_path / "site"
    module = make_plugin_dist(site, "onekernel", one_stage_example().replace("%", "%%"),
                              requires=(plugin_names("onekernel").core_requirement,))
    assert module == "_lowlat_test_onekernel"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
               TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    env.pop("LOWLAT_PLUGINS", None)
    for dtype in ("float32", "bfloat16"):
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs",
                               "lowlat_contract", "--lowlat-plugin", "onekernel", "--lowlat-dtype", dtype, "-k", QUICK],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
        assert "PASS  forward_outputs" in proc.stdout and "FAIL " not in proc.stdout, proc.stdout[-3000:]
