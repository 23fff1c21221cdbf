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
# torch.compile's worker pool would be child processes that outlive their test (the suite checks none is left).
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
sys.path.insert(0, str(Path(__file__).parent))  # plugin_dists helpers

from _procs import wait_no_children  # noqa: E402 - after the path insert


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """Tiny shapes on a small CPU: extra torch threads only add contention (several times slower)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True, scope="session")
def _no_child_process_left():
    """The suite fails if any test left a process behind (a TP worker, a spawned helper)."""
    yield
    left = wait_no_children()
    assert not left, f"processes left behind by the tests: {left}"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: exercises a GPU path (skips without one); `python bench/gpu_jobs.py "
                            "gpu-tests` runs every test so marked")


@pytest.fixture
def reference_plugin(tmp_path, monkeypatch):
    """The contract suite's plain-torch reference plugin, installed as a real distribution for this test."""
    from lowlat_contract.fixtures import install_fixture_plugins
    from plugin_dists import activate

    site = tmp_path / "site"
    install_fixture_plugins(site, ["reference"])
    activate(site, monkeypatch)
    monkeypatch.setenv("LOWLAT_PLUGINS", "reference")
    return "reference"
