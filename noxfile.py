"""nox sessions: tests, lint, build, contract (one per core x vendor pair of compat_matrix.toml), bench, gpu.

The sessions pin torch==2.13.0 (an unpinned torch would pull a multi-GB CUDA build). pip takes it from its own
index: the CPU build where that index holds it (a local wheel directory, as on lowlat's CI machines); on a machine
whose index is plain PyPI, set PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu (README.md), or PyPI's
CUDA build is installed.
"""

from __future__ import annotations

import os

import nox

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_missing_interpreters = True  # a missing python3.11 fails the run instead of skipping it

TORCH = "torch==2.13.0"
PACKAGES = ["-e", "core[test]", "-e", "vendors/nvidia_mega", "-e", "vendors/amd_mono", "-e", "contract_tests"]
TEST_DIRS = ["core/tests", "vendors/nvidia_mega/tests", "vendors/amd_mono/tests", "contract_tests/tests"]
# vendors held to the contract suite in every test run (CPU: Triton interpreter)
CONTRACT_PLUGINS = ["nvidia_mega", "amd_mono"]
DISTRIBUTIONS = ["core", "vendors/nvidia_mega", "vendors/amd_mono", "contract_tests"]


@nox.session(python="3.11")
def tests(session: nox.Session) -> None:
    """Every test on the CPU and the contract suite for each vendor, all at once; Triton runs under the interpreter,
    then nvidia_mega's dense sm90 compile check (Triton's compiler and ptxas, no GPU).

    The two cores stay busy throughout: the vendors' contract suites (one process each) and
    ``contract_tests/tests`` (the mutation campaign and the broken plugins' runs) start in the background, the
    other test directories run in the foreground meanwhile, then nvidia_mega's dense sm90 compile check
    (``FULL_RUN_COMPILE_CHECKS``, compiled rather than interpreted), then the background runs are awaited and reported
    (``_start_background``). With arguments, only the tests they select run, in the foreground and nothing in the
    background: ``nox -s tests -- core/tests/test_runtime_cli.py`` or ``nox -s tests -- -k overlap`` (a ``-k``
    alone applies to every interpreted test directory); a compile check named by its file runs compiled, in its own
    pytest. ``--install-only`` installs and runs nothing.
    """
    import pathlib

    # pip's own lines (one per package) are the progress of the install, minutes on a fresh machine
    session.install(TORCH, *PACKAGES, silent=False)
    existing = [d for d in TEST_DIRS if pathlib.Path(d).is_dir()]
    env = {"TRITON_INTERPRET": "1"}
    if session.posargs or _install_only(session):
        paths = [a for a in session.posargs if not a.startswith("-") and pathlib.Path(a.split("::")[0]).exists()]
        checks = [a for a in paths if a.split("::")[0] in COMPILE_CHECKS]  # named: run compiled, not interpreted
        others = [a for a in paths if a not in checks]
        flags = [a for a in session.posargs if a not in paths]
        if checks:
            session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", *checks, *flags,
                        env={"LOWLAT_MEGA_COMPILE_CHECK": "1"})
        if others or not checks:
            session.run("python", "-m", "pytest", "-q", *(others or existing), *flags, env=env)
        return
    py = os.path.join(session.bin, "python")
    jobs = [(f"contract {p}", [py, "-m", "pytest", "-v", "-p", "no:cacheprovider", "--pyargs", "lowlat_contract",
                               "--lowlat-plugin", p], f".nox/contract-{p}.log") for p in CONTRACT_PLUGINS]
    if BACKGROUND_TEST_DIR in existing:
        existing.remove(BACKGROUND_TEST_DIR)
        jobs.insert(0, (BACKGROUND_TEST_DIR, [py, "-m", "pytest", "-v", "-p", "no:cacheprovider", BACKGROUND_TEST_DIR],
                        ".nox/contract_tests-tests.log"))
    running = _start_background(session, jobs, env)
    failed = []
    try:
        session.run("python", "-m", "pytest", "-q", *existing, env=env)
    except nox.command.CommandFailed:
        failed.append(f"pytest {' '.join(existing)}")
    checks = [p for p in FULL_RUN_COMPILE_CHECKS if pathlib.Path(p).exists()]
    if checks:  # compiled, not interpreted: TRITON_INTERPRET is left out of this run's environment
        try:
            session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", *checks,
                        env={"LOWLAT_MEGA_COMPILE_CHECK": "1"})
        except nox.command.CommandFailed:
            failed.append(f"pytest {' '.join(checks)}")
    failed += _finish_background(running)
    if failed:
        session.error(f"failed: {'; '.join(failed)} (background logs in .nox/*.log)")


def _install_only(session: nox.Session) -> bool:
    """Whether nox runs with ``--install-only`` (session.run is a no-op then; the background runs must be too)."""
    runner = getattr(session, "_runner", None)
    return bool(getattr(getattr(runner, "global_config", None), "install_only", False))


# nvidia_mega's kernels built for sm90 by Triton's compiler and ptxas, no GPU needed (the interpreter misses what only
# the compiler rejects; the dense file's cases had rotted unseen while it was opt-in). A full run takes the dense
# file only, in the foreground after the interpreted tests: all three cost 88 s of a core and 116 s of wall time on
# 2026-12-07 (1981 against 1865 s, bench/results/2026-12-07-cpu-ci-slow-host), too close to the 20-minute budget on
# a host of normal speed. Each one named after -- runs compiled; the gpu-tests job runs all three.
COMPILE_CHECKS = [f"vendors/nvidia_mega/tests/test_compile_sm90{s}.py" for s in ("", "_lm_head", "_moe")]
FULL_RUN_COMPILE_CHECKS = COMPILE_CHECKS[:1]
BACKGROUND_TEST_DIR = "contract_tests/tests"  # ~40% of the test CPU time: runs beside the foreground pytest
# The background runs' scheduling priority (os.nice increment). The foreground pytest is one process, so it can use one
# core at most: at equal priority the four processes got half a core each, the background ended at ~760 s and the
# foreground ran alone on one core until ~1070 s while the other idled (bench/results/2026-12-07-cpu-ci-time). At a
# lower priority the background yields the foreground a whole core and takes the other, then both once it ends.
BACKGROUND_NICE = 10


def _start_background(session: nox.Session, jobs: list[tuple[str, list[str], str]], env: dict[str, str]) -> list:
    """Start ``(label, argv, log path)`` pytest -v runs at once (one process each, one torch thread each, at
    ``BACKGROUND_NICE`` below the foreground's priority).

    Progress streams while they run: one line per job at most every PROGRESS_S seconds (tests done, failed,
    elapsed, the latest test), and every failing test at once; the full logs go to the log paths.
    """
    import subprocess
    import sys
    import threading
    import time

    start = time.monotonic()
    lock = threading.Lock()
    running = []

    def follow(label: str, proc: subprocess.Popen, log_path: str, state: dict) -> None:
        done = failed = 0
        last = time.monotonic()
        with open(log_path, "w") as log:
            for line in proc.stdout:  # type: ignore[union-attr]
                log.write(line)
                words = line.split()
                status = next((w for w in ("PASSED", "FAILED", "SKIPPED", "ERROR", "XFAIL", "XPASS") if w in words),
                              None)
                if status is None or "::" not in line:
                    continue
                done += 1
                failed += status in ("FAILED", "ERROR")
                now = time.monotonic()
                test = line.split("::")[-1].split(" ")[0][:90]
                state.update(done=done, failed=failed, last=f"{status.lower()} {test}")
                if status in ("FAILED", "ERROR") or now - last >= PROGRESS_S:
                    last = now
                    with lock:
                        sys.stdout.write(f"\n[{label}] {done} tests, {failed} failed, {now - start:.0f} s; "
                                         f"{status.lower()} {test}\n")
                        sys.stdout.flush()

    for label, cmd, log_path in jobs:
        full_env = {**os.environ, **env, "OMP_NUM_THREADS": "1",
                    "PATH": session.bin + os.pathsep + os.environ["PATH"]}
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=full_env, text=True,
                                bufsize=1, preexec_fn=_lower_priority)
        state: dict = {"done": 0, "failed": 0, "last": "none yet"}
        thread = threading.Thread(target=follow, args=(label, proc, log_path, state), daemon=True)
        thread.start()
        running.append((label, log_path, proc, thread, start, state))
    return running


def _lower_priority() -> None:
    """Runs in each background child before it starts pytest: ``BACKGROUND_NICE`` lower priority (Linux, macOS)."""
    os.nice(BACKGROUND_NICE)


def _finish_background(running: list) -> list[str]:
    """Wait for the runs of ``_start_background`` and print each one's report (the "lowlat contract" section,
    else pytest's summary from its failures on); returns the labels of those that failed. While waiting, a line
    every HEARTBEAT_S seconds names the runs still going (their last test may take minutes)."""
    import subprocess
    import sys
    import time

    failed = []
    for label, log_path, proc, thread, start, _ in running:
        while True:
            try:
                proc.wait(timeout=HEARTBEAT_S)
                break
            except subprocess.TimeoutExpired:
                going = [f"{lb} ({st['done']} tests, {st['failed']} failed; last {st['last']})"
                         for lb, _, pr, _, _, st in running if pr.poll() is None]
                sys.stdout.write(f"\n[waiting {time.monotonic() - start:.0f} s] still running: {'; '.join(going)}\n")
                sys.stdout.flush()
        thread.join()
        text = open(log_path).read()
        at = text.rfind("= lowlat contract =")
        if at < 0:
            at = max(text.rfind("= FAILURES ="), text.rfind("= short test summary"), text.rfind("\n=") + 1)
        summary = text[text.rfind("\n", 0, at) + 1:] if at > 0 else text  # the report, or everything on a crash
        sys.stdout.write(f"\n--- {label} ({time.monotonic() - start:.0f} s) ---\n{summary[-6000:]}")
        if proc.returncode != 0:
            failed.append(label)
    return failed


PROGRESS_S = 20  # seconds between progress lines of one background run
HEARTBEAT_S = 45  # seconds between "still running" lines once the foreground tests are done


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    """ruff on everything; mypy on the plugin interface."""
    session.install("ruff", "mypy", TORCH, "-e", "core")
    session.run("ruff", "check", ".")
    session.run("mypy", "core/src/lowlat/plugin", "core/src/lowlat/platform.py", "core/src/lowlat/config.py")


@nox.session(python="3.11")
def build(session: nox.Session) -> None:
    """Wheels of all four distributions into dist/ (then: pip install --find-links dist "lowlat[nvidia-mega]")."""
    session.install("build", "setuptools>=68", "wheel")
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
    session.run("python", "-m", "lowlat.cli", "bench", *args, "--out", f"bench/results/standard-{stamp}",
                *session.posargs, external=True)


@nox.session(python=False)
def gpu(session: nox.Session) -> None:
    """GPU jobs named in bench/gpu_jobs.py, in the current environment: ``nox -s gpu -- contract bench``.

    ``nox -s gpu -- --list`` prints the jobs and their steps; ``--models`` / ``--plugins`` / ``--scale`` pass on.
    """
    session.run("python", "bench/gpu_jobs.py", *(session.posargs or ["--list"]), external=True)


# --- nox -s contract: every core x vendor combination in compat_matrix.toml, each in a fresh environment ---

def _matrix():  # type: ignore[no-untyped-def]
    import sys

    sys.path.insert(0, "contract_tests/src")
    from lowlat_contract.matrix import load_matrix

    return load_matrix("compat_matrix.toml")


def _combinations() -> list[tuple[str, str, str, str, str]]:
    """(core version, vendor name, vendor version, platform, expected) for every pair and platform."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    m = _matrix()
    out = []
    for core in m.core:
        for vendor in m.vendors:
            ok = SpecifierSet(vendor.core_range).contains(Version(core.version), prereleases=True)
            for platform in ("cpu-interpreter", "cuda-sm90"):
                out.append((core.version, vendor.name, vendor.version, platform, "pass" if ok else "incompatible"))
    return out


COMBINATIONS = _combinations()


@nox.session(python="3.11", reuse_venv=False)
@nox.parametrize("combo", COMBINATIONS, ids=[f"core-{c[0]}__{c[1]}-{c[2]}__{c[3]}" for c in COMBINATIONS])
def contract(session: nox.Session, combo: tuple[str, str, str, str, str]) -> None:
    """The contract suite for one combination of core and vendor releases (``-- --update`` records the result).

    Core and its contract suite are installed from the core release's recorded commit (the working tree when
    the commit is empty, i.e. the version in development), the vendor from its own. A combination whose
    declared core range excludes the core must be refused by core at discovery, with the clear error.
    """
    import datetime
    import pathlib

    core_v, vendor_name, vendor_v, platform, expected = combo
    m = _matrix()
    core, vendor = m.core_release(core_v), m.vendor_release(vendor_name, vendor_v)
    update = "--update" in session.posargs
    posargs = [a for a in session.posargs if a != "--update"]
    if platform == "cuda-sm90" and not _has_sm90_gpu():
        session.skip("cuda-sm90 needs an NVIDIA GPU of compute capability 9.0 or newer (checked with nvidia-smi "
                     "before installing a CUDA torch)")
    tmp = pathlib.Path(session.create_tmp())
    core_dir = _checkout(session, "core", core.commit, tmp)
    suite_dir = _checkout(session, "contract_tests", core.commit, tmp)
    vendor_dir = _checkout(session, vendor.path, vendor.commit, tmp, repo=vendor.repo)
    session.install(TORCH if platform == "cpu-interpreter" else "torch", "pytest", "transformers")
    session.install(str(core_dir), str(suite_dir))
    # --no-deps: a mismatched pair must reach core's discovery to be refused; the vendor's other dependencies
    # (all but core) are installed from its pyproject.toml
    session.install("--no-deps", str(vendor_dir))
    from lowlat_contract.checkout import vendor_dependencies

    deps = vendor_dependencies(pathlib.Path(vendor_dir) / "pyproject.toml")
    if deps:
        session.install(*deps)
    env = {"TRITON_INTERPRET": "1"} if platform == "cpu-interpreter" else {}
    if expected == "incompatible":
        session.run("python", "-c", _REFUSAL_CHECK, vendor.plugin, core.version, env=env)
        result = "incompatible"
    else:
        args = ["--lowlat-device", "cuda", "--lowlat-model", "llama-3.2-1b"] if platform == "cuda-sm90" else []
        try:
            session.run("python", "-m", "pytest", "-q", "--pyargs", "lowlat_contract", "--lowlat-plugin",
                        vendor.plugin, *args, *posargs, env=env)
            result = "pass"
        except nox.command.CommandFailed:
            result = "fail"
    if update:
        from lowlat_contract.matrix import TestedCombination, with_result

        path = pathlib.Path("compat_matrix.toml")
        date = datetime.date.today().isoformat()
        row = TestedCombination(core_v, vendor_name, vendor_v, platform, result, date,
                                vendor_commit=vendor.commit or _head_commit(vendor.path))
        path.write_text(with_result(path.read_text(), row))
        session.log(f"recorded {result} for core {core_v} x {vendor_name} {vendor_v} on {platform}")
    if result == "fail":
        session.error("the contract suite failed")


_REFUSAL_CHECK = """
import sys
from lowlat.plugin import IncompatibleCoreVersion
try:
    from lowlat.runtime.plugin_host import discover  # core >= 0.3 (plugin API 3)
except ImportError:
    from lowlat.plugin import discover
plugin, core = sys.argv[1], sys.argv[2]
info = discover([plugin]).plugins[plugin]
assert info.status == "incompatible", f"core {core} loaded {plugin} although its range excludes it: {info}"
try:
    info.raise_if_unusable()
except IncompatibleCoreVersion as e:
    msg = str(e)
    assert core in msg and info.core_range.split(",")[0].lstrip("<>=!~") in msg and "install" in msg, msg
    print("refused as expected:", msg)
else:
    raise AssertionError("no IncompatibleCoreVersion raised")
"""


def _checkout(session: nox.Session, path: str, commit: str, tmp, repo: str = "") -> object:  # type: ignore[no-untyped-def]
    """``path`` of ``repo`` (default: this repository) at ``commit``; the working tree when commit is empty.

    lowlat_contract/checkout.py does the work; git's own error text ends the session.
    """
    import pathlib
    import sys

    sys.path.insert(0, "contract_tests/src")
    from lowlat_contract.checkout import CheckoutError, export_tree

    try:
        return export_tree(pathlib.Path.cwd(), path, commit, tmp, repo=repo)
    except CheckoutError as e:
        session.error(str(e))


def _has_sm90_gpu() -> bool:
    """Whether nvidia-smi reports a GPU of compute capability >= 9.0 (no torch needed)."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return False
    done = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True,
                          text=True, timeout=60, check=False)
    caps = [float(c) for c in done.stdout.split() if c.replace(".", "", 1).isdigit()]
    return done.returncode == 0 and any(c >= 9.0 for c in caps)


def _head_commit(path: str) -> str:
    """HEAD's commit, ``+dirty`` when ``path`` differs from it: what a working-tree version was tested at."""
    import subprocess

    done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return ""
    clean = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", path], check=False).returncode == 0
    return done.stdout.strip() + ("" if clean else "+dirty")
