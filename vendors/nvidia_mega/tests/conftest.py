"""Under the Triton interpreter, install the contract suite's interpreter speed-up for these tests too."""

from lowlat.platform import triton_interpreter_enabled

if triton_interpreter_enabled():
    from lowlat_contract import interpreter

    interpreter.install()


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: exercises a GPU path (skips without one); `python bench/gpu_jobs.py "
                            "gpu-tests` runs every test so marked")
