"""nox sessions: tests, lint, build (and, as later issues land: contract, bench, demo).

CPU machines take torch from the pinned CPU build (torch==2.13.0); an unpinned torch would pull a
multi-GB CUDA build.
"""

from __future__ import annotations

import nox

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True

TORCH = "torch==2.13.0"
PACKAGES = ["-e", "core[test]", "-e", "vendors/nvidia_mega", "-e", "vendors/amd_mono", "-e", "contract_tests"]
TEST_DIRS = ["core/tests", "vendors/nvidia_mega/tests", "vendors/amd_mono/tests", "contract_tests/tests"]
DISTRIBUTIONS = ["core", "vendors/nvidia_mega", "vendors/amd_mono", "contract_tests"]


@nox.session(python="3.11")
def tests(session: nox.Session) -> None:
    """Every test on the CPU; Triton kernels run under the interpreter (TRITON_INTERPRET=1)."""
    session.install(TORCH, *PACKAGES)
    existing = [d for d in TEST_DIRS if __import__("pathlib").Path(d).is_dir()]
    session.run("python", "-m", "pytest", "-q", *existing, *session.posargs, env={"TRITON_INTERPRET": "1"})


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    """ruff on everything; mypy on the plugin interface."""
    session.install("ruff", "mypy", TORCH, "-e", "core")
    session.run("ruff", "check", ".")
    session.run("mypy", "core/src/lowlat/plugin", "core/src/lowlat/platform.py", "core/src/lowlat/config.py")


@nox.session(python="3.11")
def build(session: nox.Session) -> None:
    """Wheels of all four distributions into dist/ (then: pip install --find-links dist "lowlat[nvidia-mega]")."""
    session.install("build")
    for d in DISTRIBUTIONS:
        session.run("python", "-m", "build", "--wheel", "--no-isolation", "--outdir", "dist", d)
