"""Under TRITON_INTERPRET=1 the suite stops at session start, naming the fix, when the installed Triton (before 3.7)
and NumPy (2.4 or newer) cannot run the interpreter (``lowlat.platform.interpreter_problem``), instead of failing
every kernel with Triton's ``TypeError``. The installed Triton is made to read as 3.6.0 by a distribution record put
first on the path (the real package still imports); this host's NumPy must then be 2.4 or newer."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.version import Version

NUMPY_24 = Version(metadata.version("numpy")).release[:2] >= (2, 4)


def _fake_triton(tmp_path: Path, version: str) -> dict[str, str]:
    info = tmp_path / f"triton-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: triton\nVersion: {version}\n")
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "TRITON_INTERPRET": "1"}


@pytest.mark.skipif(not NUMPY_24, reason="needs NumPy >= 2.4 installed (the refused pair is Triton 3.6 with it)")
@pytest.mark.parametrize("version, refused", [("3.6.0", True), ("3.7.0", False)])
def test_the_suite_refuses_triton_36_with_numpy_24_at_start(tmp_path: Path, version: str, refused: bool) -> None:
    env = _fake_triton(tmp_path, version)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs", "lowlat_contract",
           "--lowlat-plugin", "nvidia_mega", "--lowlat-arch", "LlamaForCausalLM", "-k", "guard_accepts"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    out = proc.stdout[-2000:] + proc.stderr[-2000:]
    if refused:
        assert proc.returncode == pytest.ExitCode.USAGE_ERROR, out
        assert "TRITON_INTERPRET=1: Triton 3.6.0's interpreter cannot run with NumPy" in proc.stderr, out
        assert "'numpy<2.4' or 'triton>=3.7'" in proc.stderr, out
    else:
        assert "cannot run with NumPy" not in out and proc.returncode == 0, out
