"""No false greens: a contract run that checks nothing exits non-zero with a one-line reason, unless
``--lowlat-allow-empty`` says an empty run is fine (pytest_plugin.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def _suite(*args: str, interpreter: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpreter:
        env["TRITON_INTERPRET"] = "1"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs", "lowlat_contract", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def test_no_plugin_is_a_usage_error_unless_allowed() -> None:
    proc = _suite(interpreter=False)
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "no --lowlat-plugin NAME given" in proc.stderr
    assert _suite("--lowlat-allow-empty", "-k", "guard_accepts", interpreter=False).returncode == 0


def test_a_triton_plugin_on_a_cpu_without_the_interpreter_checks_nothing_and_fails() -> None:
    # the whole suite: the guard-only compatibility tests pass, every numeric contract skips (no platform)
    args = ("--lowlat-plugin", "nvidia_mega", "--lowlat-arch", "LlamaForCausalLM")
    proc = _suite(*args, interpreter=False)
    assert proc.returncode == pytest.ExitCode.NO_TESTS_COLLECTED, proc.stdout[-3000:]
    assert "every selected numeric contract test was skipped, nothing was checked" in proc.stdout
    assert " passed" in proc.stdout, "the compatibility tests ran and passed: a green run without this guard"
    assert "TRITON_INTERPRET=1" in proc.stdout, "the reason names the platform skip"
    assert _suite(*args, "--lowlat-allow-empty", interpreter=False).returncode == 0
