"""Test-wide setup: on a machine without CUDA, Triton kernels run under the interpreter.

TRITON_INTERPRET must be set before the first ``import triton`` (triton.language builds its helpers at
import), so it is set here, before any test module is collected.
"""

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).parent))  # plugin_dists helpers


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """Tiny shapes on a small CPU: extra torch threads only add contention (several times slower)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def child_processes() -> list[tuple[int, str]]:
    """(pid, command name) of this process's live children, except multiprocessing's resource tracker.

    Reads /proc (Linux); elsewhere returns [] (nothing checked).
    """
    from multiprocessing import resource_tracker

    tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
    me, out = os.getpid(), []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit() or int(entry) == tracker:
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        if int(rest[1]) == me and rest[0] != "Z":
            out.append((int(entry), name))
    return out


def wait_no_children(timeout_s: float = 10.0) -> list[tuple[int, str]]:
    """Poll until no child process is left or ``timeout_s`` s passed; returns those still there."""
    import time

    deadline = time.monotonic() + timeout_s
    while (left := child_processes()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@pytest.fixture(autouse=True, scope="session")
def _no_child_process_left():
    """The suite fails if any test left a process behind (a TP worker, a spawned helper)."""
    yield
    left = wait_no_children()
    assert not left, f"processes left behind by the tests: {left}"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: exercises a GPU path (skips without one); `python bench/gpu_jobs.py "
                            "gpu-tests` runs every test so marked")
