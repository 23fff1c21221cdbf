"""Run the contract suite on a mutant, in this process, and read what failed in which contract.

``run_suite(name, site_dir)`` is ``pytest --pyargs lowlat_contract --lowlat-plugin NAME --lowlat-arch ARCH``
exactly as a vendor runs it (discovery through the dist-info ``install_mutant_plugins`` wrote into
``site_dir``, the guard, ``build``, every contract), but through ``pytest.main`` in this interpreter: torch and
lowlat are imported once for the whole campaign, so one run costs about a second on tiny presets instead of
four or five for a fresh interpreter. Plugin autoloading is off in the inner session (only the suite's
plugin is loaded) and it runs in ``work_dir``, so no conftest or ini of the caller's tree applies.

``python -m lowlat_contract.mutation_run [NAME ...]`` runs every contract on each mutant (default all) and
prints per mutant the contracts that failed it, whether one of its expected contracts is among them, and
the registry's state: ``CLEAR`` (caught now: set its ``escapes`` to None), ``MISSED`` (no longer caught).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class TestResult:
    """One contract test of a run: its id (``test_name[case-params]``), contract, outcome and failure text."""

    name: str
    contract: str
    outcome: str  # passed, failed, skipped
    message: str = ""


@dataclass
class SuiteRun:
    """A suite run: pytest's exit status, each test's result, the wall time (s) and the contracts the suite
    has (collected before the selection)."""

    plugin: str
    rc: int
    results: list[TestResult] = field(default_factory=list)
    seconds: float = 0.0
    contracts: set[str] = field(default_factory=set)

    def failed(self, contracts: tuple[str, ...] | None = None) -> list[TestResult]:
        """Failed tests, only those of ``contracts`` when given."""
        return [r for r in self.results if r.outcome == "failed" and (contracts is None or r.contract in contracts)]

    def summary(self) -> str:
        """``contract: P passed, F failed, S skipped`` per contract, then each failure's first line."""
        by: dict[str, dict[str, int]] = {}
        for r in self.results:
            by.setdefault(r.contract, {}).setdefault(r.outcome, 0)
            by[r.contract][r.outcome] += 1
        lines = [f"{self.plugin}: exit {self.rc} in {self.seconds:.1f} s"]
        lines += [f"  {c}: " + ", ".join(f"{n} {o}" for o, n in sorted(v.items())) for c, v in sorted(by.items())]
        lines += [f"  FAILED {r.name}: {r.message.strip().splitlines()[0][:200] if r.message.strip() else ''}"
                  for r in self.failed()]
        return "\n".join(lines)


class _Collector:
    """A pytest plugin object that keeps only the tests of ``contracts`` (all when None; by their
    ``lowlat_contract`` marker, whatever module they live in) and records each test's outcome and contract."""

    def __init__(self, contracts: tuple[str, ...] | None = None) -> None:
        self.contracts = contracts
        self.results: dict[str, TestResult] = {}
        self.seen: set[str] = set()

    def pytest_collection_modifyitems(self, config: Any, items: list[Any]) -> None:
        self.seen |= {m.args[0] for m in (i.get_closest_marker("lowlat_contract") for i in items) if m is not None}
        if self.contracts is None:
            return
        keep, drop = [], []
        for item in items:
            mark = item.get_closest_marker("lowlat_contract")
            (keep if mark is not None and mark.args[0] in self.contracts else drop).append(item)
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep

    def pytest_runtest_logreport(self, report: Any) -> None:
        prev = self.results.get(report.nodeid)
        contract = dict(report.user_properties).get("lowlat_contract", "")
        name = report.nodeid.split("::")[-1]
        if report.failed and (prev is None or prev.outcome != "failed"):
            crash = getattr(report.longrepr, "reprcrash", None)
            head = crash.message if crash is not None else ""
            self.results[report.nodeid] = TestResult(name, contract, "failed", f"{head}\n{report.longreprtext[-2000:]}")
        elif report.skipped and prev is None:
            self.results[report.nodeid] = TestResult(name, contract, "skipped", report.longreprtext[-500:])
        elif report.when == "call" and report.passed and prev is None:
            self.results[report.nodeid] = TestResult(name, contract, "passed")


@contextlib.contextmanager
def _environment(site_dir: Path, work_dir: Path, unset: tuple[str, ...]) -> Iterator[None]:
    saved_env, saved_path, cwd = dict(os.environ), list(sys.path), os.getcwd()
    try:
        os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
        for var in unset:
            os.environ.pop(var, None)
        if str(site_dir) not in sys.path:
            sys.path.insert(0, str(site_dir))
        os.chdir(work_dir)
        yield
    finally:
        os.chdir(cwd)
        sys.path[:] = saved_path
        os.environ.clear()
        os.environ.update(saved_env)


def run_suite(name: str, site_dir: str | Path, work_dir: str | Path, *, arch: str, extra: tuple[str, ...] = (),
              unset_env: tuple[str, ...] = (), contracts: tuple[str, ...] | None = None,
              first_failure: bool = False, device: str = "cpu") -> SuiteRun:
    """The contract suite on plugin ``name`` (installed in ``site_dir``) for ``arch``, in this process.

    Args:
        extra: more suite options (``--lowlat-dtype float16``).
        unset_env: environment variables removed for the run (restored after).
        contracts: run only these contracts' tests (None: all). A run that keeps no test exits 5.
        first_failure: stop at the first failing test (``-x``).
        device: ``--lowlat-device`` (the registry's ``escapes`` describe CPU runs: float32 by default there).
    """
    import pytest

    args = ["-p", "lowlat_contract.pytest_plugin", "-p", "no:cacheprovider", "-q", "--no-header", "-rN", "--tb=short",
            "--pyargs", "lowlat_contract", "--lowlat-plugin", name, "--lowlat-arch", arch, "--lowlat-device", device,
            "--lowlat-sweep", "full", *extra]  # mutants are plain torch: the full sweep, as for the reference
    if first_failure:
        args.append("-x")
    collector = _Collector(contracts)
    start = time.monotonic()
    with _environment(Path(site_dir), Path(work_dir), unset_env):
        rc = pytest.main(args, plugins=[collector])
    return SuiteRun(name, int(rc), list(collector.results.values()), time.monotonic() - start, collector.seen)


def main(argv: list[str] | None = None) -> int:
    """The campaign report (module docstring). Returns 1 when the registry disagrees with a run."""
    import argparse
    import tempfile

    import torch

    from lowlat_contract.plugins.mutants import MUTANTS, install_mutant_plugins
    from lowlat_contract.plugins.mutants.registry import EXIT

    parser = argparse.ArgumentParser(prog="python -m lowlat_contract.mutation_run", description=main.__doc__)
    parser.add_argument("names", nargs="*", help="mutants (default: all)")
    parser.add_argument("--verbose", action="store_true", help="print each run's summary too")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    names = args.names or list(MUTANTS)
    site, work = Path(tempfile.mkdtemp(prefix="mutant-site-")), Path(tempfile.mkdtemp(prefix="mutant-runs-"))
    install_mutant_plugins(site)
    stale = 0
    print(f"{'mutant':32} {'kind':4} {'caught':6} {'registry':8} failed contracts")
    for name in names:
        m = MUTANTS[name]
        with contextlib.redirect_stdout(sys.stderr):
            run = run_suite(name, site, work, arch=m.arch, extra=m.suite_args, unset_env=m.unset_env)
        failed = sorted({r.contract for r in run.failed()})
        if not m.expect:  # the control: must pass
            caught, state = run.rc != 0, "ok" if run.rc == 0 else "FAILS"
        else:
            caught = run.rc != 0 if m.expect == (EXIT,) else (run.rc == 1 and bool(run.failed(m.expect)))
            state = "ok" if caught == (m.escapes is None) else ("CLEAR" if caught else "MISSED")
        stale += state != "ok"
        print(f"{name:32} {m.kind:<4} {'yes' if caught else 'no':6} {state:8} {', '.join(failed) or '-'}")
        if args.verbose:
            print(run.summary())
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
