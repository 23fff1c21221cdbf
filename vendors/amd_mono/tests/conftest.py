"""Under the Triton interpreter, install core's interpreter speed-up (``lowlat.fast_interpreter``) for these tests too,
and refuse a Triton / NumPy pair the interpreter cannot run (``lowlat.platform.interpreter_problem``) with the fix,
once."""

import pytest
from lowlat.platform import installed_interpreter_problem, triton_interpreter_enabled

if triton_interpreter_enabled():
    from lowlat import fast_interpreter

    fast_interpreter.install()


def pytest_configure(config):
    problem = installed_interpreter_problem() if triton_interpreter_enabled() else None
    if problem:
        raise pytest.UsageError(f"TRITON_INTERPRET=1: {problem}")
    config.addinivalue_line("markers", "gpu: exercises a GPU path (skips without one); `python bench/gpu_jobs.py "
                            "gpu-tests` runs every test so marked")
