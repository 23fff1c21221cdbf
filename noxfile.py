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
CONTRACT_PLUGINS = ["nvidia_mega"]  # vendors held to the contract suite in every test run (CPU: Triton interpreter)
DISTRIBUTIONS = ["core", "vendors/nvidia_mega", "vendors/amd_mono", "contract_tests"]


@nox.session(python="3.11")
def tests(session: nox.Session) -> None:
    """Every test on the CPU, then the contract suite for each vendor; Triton runs under the interpreter."""
    import pathlib

    session.install(TORCH, *PACKAGES)
    existing = [d for d in TEST_DIRS if pathlib.Path(d).is_dir()]
    env = {"TRITON_INTERPRET": "1"}
    session.run("python", "-m", "pytest", "-q", *existing, *session.posargs, env=env)
    _contract_in_parallel(session, CONTRACT_PLUGINS, env)


def _contract_in_parallel(session: nox.Session, plugins: list[str], env: dict[str, str]) -> None:
    """``pytest --pyargs lowlat_contract --lowlat-plugin P`` for every P at once (one process each), then report."""
    import os
    import subprocess
    import sys

    bindir = session.bin
    procs = []
    for plugin in plugins:
        log = open(f".nox/contract-{plugin}.log", "w")  # noqa: SIM115 - closed below
        cmd = [os.path.join(bindir, "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs",
               "lowlat_contract", "--lowlat-plugin", plugin]
        full_env = {**os.environ, **env, "OMP_NUM_THREADS": "1", "PATH": bindir + os.pathsep + os.environ["PATH"]}
        procs.append((plugin, log, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env)))
    failed = []
    for plugin, log, proc in procs:
        proc.wait()
        log.close()
        text = open(log.name).read()
        sys.stdout.write(f"\n--- contract suite for {plugin} ---\n{text[-6000:]}")
        if proc.returncode != 0:
            failed.append(plugin)
    if failed:
        session.error(f"contract suite failed for {', '.join(failed)} (logs in .nox/contract-*.log)")


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


@nox.session(python=False)
def bench(session: nox.Session) -> None:
    """lowlat bench's standard set, in the current environment (no install: the GPU image's torch and triton).

    With CUDA: llama-3.2-1b and qwen3-30b-a3b on the general path, every installed plugin and the hf peer; DECODE at
    batch 1, 2, 4, 8 and VERIFY of 6 tokens at batch 1, context 1024. Without CUDA: the tiny CPU run (tiny-llama and
    tiny-qwen3-moe, general path, hf skipped with its reason). Results go to bench/results/standard-<UTC time>/.
    Arguments after ``--`` are passed on and win (e.g. ``nox -s bench -- --paths general,hf --hf-budget-s 300``).
    Run nox with the Python that has lowlat installed (e.g. the activated .venv).
    """
    import datetime

    probe = session.run("python", "-c", "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')",
                        silent=True, external=True)
    on_gpu = str(probe).strip().splitlines()[-1] == "cuda"
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    if on_gpu:
        args = ["--model", "llama-3.2-1b,qwen3-30b-a3b", "--paths", "general,plugins,hf", "--device", "cuda"]
    else:
        args = ["--model", "tiny-llama,tiny-qwen3-moe", "--paths", "general,hf", "--device", "cpu"]
    session.run("python", "-m", "lowlat.cli", "bench", *args, "--name", f"standard-{stamp}", *session.posargs,
                external=True)
