"""The pytest plugin (entry point ``pytest11: lowlat_contract``): options, cases, the report.

``pytest --pyargs lowlat_contract --lowlat-plugin NAME`` collects the contract modules in
``lowlat_contract/contracts`` (their fixtures live in that package's conftest.py, so nothing leaks into other
pytest sessions) and runs each test once per ContractCase (``lowlat_contract.cases``). Every
contract module carries ``pytest.mark.lowlat_contract(name, promise)``; the terminal summary section
"lowlat contract" prints each contract's promise with its outcome, and junit XML reports carry the contract
name as the test property ``lowlat_contract``. Loading this plugin costs nothing when the option is absent
(no torch import). No false greens: collecting the contract modules without ``--lowlat-plugin`` is a usage
error, and a run in which every selected numeric contract test skipped exits 5 (NO_TESTS_COLLECTED), each with a
one-line reason, unless ``--lowlat-allow-empty``. ``--lowlat-plugin [NAME=]package.module:OBJECT`` registers a
plugin defined in a module (``fixtures.register_module_plugin``); ``--lowlat-sweep`` picks the sweep mode.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest

_CASES = pytest.StashKey[Any]()
NUMERIC_CONTRACTS = frozenset({"forward_outputs", "kv_writes", "shape_sweeps", "long_run", "variants", "fallback",
                               "weight_binding", "graph_execution"})
"""Contracts that compare the plugin's outputs with the general path's: a run in which none of them ran is empty."""
PLUGIN_NAME = pytest.StashKey[str]()
"""config.stash key: the plugin name the suite checks (a module-defined plugin gets its registered name)."""
NOTES = pytest.StashKey[list]()
"""config.stash key: lines the contracts add to the "lowlat contract" summary (measured step times)."""


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("lowlat", "lowlat contract suite (docs/contract.md)")
    group.addoption("--lowlat-plugin", metavar="NAME", default=None,
                    help="the installed lowlat plugin to check (its entry point name), or module:OBJECT, a pluggy "
                         "plugin object not installed (e.g. lowlat_contract.plugins.reference:HOOKS)")
    group.addoption("--lowlat-arch", metavar="ARCH", action="append", default=None,
                    help="only this architecture's spec (repeatable; default: every spec the plugin registers)")
    group.addoption("--lowlat-model", metavar="PRESET_OR_DIR", action="append", default=None,
                    help="also check this preset or checkpoint directory (repeatable; meant for GPUs)")
    group.addoption("--lowlat-device", default="auto", choices=("auto", "cpu", "cuda"),
                    help="where the models run (default: cuda when available)")
    group.addoption("--lowlat-dtype", default=None, choices=("float32", "bfloat16", "float16"),
                    help="model dtype (default: float32 on CPU, bfloat16 on GPUs, if the spec allows it)")
    group.addoption("--lowlat-sweep", default=None, choices=("full", "covering"),
                    help="shape sweeps: every shape (full), or a subset hitting every boundary once (covering; "
                         "the default under TRITON_INTERPRET=1, full otherwise)")
    group.addoption("--lowlat-allow-empty", action="store_true", default=False,
                    help="exit 0 even when no contract test ran (no --lowlat-plugin, or every case skipped)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "lowlat_contract(name, promise): the lowlat plugin contract a test checks")
    config.stash[NOTES] = []
    config.pluginmanager.register(ContractReport(config), "lowlat_contract_report")


def pytest_sessionstart(session: pytest.Session) -> None:
    """With --lowlat-plugin: resolve the cases before collection; a bad option or plugin is a usage error."""
    config = session.config
    if not config.getoption("lowlat_plugin"):
        return
    from lowlat import fast_interpreter
    from lowlat.platform import installed_interpreter_problem, triton_interpreter_enabled

    if triton_interpreter_enabled():
        problem = installed_interpreter_problem()
        if problem:
            raise pytest.UsageError(f"TRITON_INTERPRET=1: {problem}")
        fast_interpreter.install()  # for the suite's own launches too, not only the plugin's builds
    from lowlat_contract.cases import ContractSetupError, build_cases
    from lowlat_contract.fixtures import register_module_plugin

    o = config.getoption
    try:
        name = o("lowlat_plugin")
        if ":" in name:  # NAME=package.module:OBJECT or package.module:OBJECT (docs/contract.md)
            import tempfile

            name = register_module_plugin(name, tempfile.mkdtemp(prefix="lowlat-contract-plugin-"))
        config.stash[PLUGIN_NAME] = name
        config.stash[_CASES] = build_cases(name, o("lowlat_arch"), o("lowlat_model"), o("lowlat_device"),
                                           o("lowlat_dtype"))
    except (ContractSetupError, ValueError, ImportError) as e:
        raise pytest.UsageError(f"lowlat contract suite: {e}") from None


def sweep_mode(config: pytest.Config) -> str:
    """"full" or "covering": --lowlat-sweep, else covering under TRITON_INTERPRET=1 and full otherwise."""
    from lowlat.platform import triton_interpreter_enabled

    return config.getoption("lowlat_sweep") or ("covering" if triton_interpreter_enabled() else "full")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "case" not in metafunc.fixturenames or metafunc.definition.get_closest_marker("lowlat_contract") is None:
        return
    if not metafunc.config.getoption("lowlat_plugin"):
        skip = pytest.mark.skip(reason="pass --lowlat-plugin NAME to run the lowlat contract suite")
        metafunc.parametrize("case", [pytest.param(None, marks=skip)], ids=["no-plugin"], scope="session")
        return
    cases = metafunc.config.stash[_CASES]
    metafunc.parametrize("case", cases, ids=[c.id for c in cases], scope="session")


class ContractReport:
    """Maps tests to contracts at collection, records outcomes, and writes the "lowlat contract" section."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.contracts: dict[str, dict[str, Any]] = {}  # name -> {"promise": str, "items": [nodeid]}
        self.outcomes: dict[str, tuple[str, str]] = {}  # nodeid -> (status, detail)
        self.empty_reason = ""

    @pytest.hookimpl(trylast=True)  # after -k / -m deselection
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            mark = item.get_closest_marker("lowlat_contract")
            if mark is None:
                continue
            name, promise = mark.args
            self.contracts.setdefault(name, {"promise": promise, "items": []})["items"].append(item.nodeid)
            item.user_properties.append(("lowlat_contract", name))
        if self.contracts and not self.config.getoption("lowlat_plugin") and not self._allow_empty() and \
                not self.config.option.collectonly:
            raise pytest.UsageError("lowlat contract suite: no --lowlat-plugin NAME given, so nothing would be "
                                    "checked; pass one (or --lowlat-allow-empty to accept an empty run)")

    def _allow_empty(self) -> bool:
        return bool(self.config.getoption("lowlat_allow_empty"))

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        """A run that checked nothing numeric is no pass: every selected test of NUMERIC_CONTRACTS skipped (e.g. a
        Triton plugin on a CPU without TRITON_INTERPRET=1, where the guard-only compatibility tests still pass)
        exits with NO_TESTS_COLLECTED (5) and a one-line reason."""
        if not self.contracts or not self.config.getoption("lowlat_plugin") or self._allow_empty() or \
                self.config.option.collectonly:
            return
        numeric = {n for name, e in self.contracts.items() if name in NUMERIC_CONTRACTS for n in e["items"]}
        if not numeric:
            return  # an explicit subset without numeric contracts (-k compatibility): what was asked for
        ran = [n for n in numeric if self.outcomes.get(n, ("", ""))[0] in ("passed", "failed")]
        if ran or exitstatus not in (0, pytest.ExitCode.OK):
            return
        reasons = sorted({self.outcomes[n][1] for n in numeric if self.outcomes.get(n, ("", ""))[0] == "skipped"})
        self.empty_reason = (f"lowlat contract suite: every selected numeric contract test was skipped, nothing was "
                             f"checked against the general path "
                             f"({reasons[0][:160] if reasons else 'no test ran'}); pass --lowlat-allow-empty "
                             f"to accept that")
        session.exitstatus = pytest.ExitCode.NO_TESTS_COLLECTED

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        prev = self.outcomes.get(report.nodeid)
        if report.failed:
            if prev is None or prev[0] != "failed":
                self.outcomes[report.nodeid] = ("failed", _first_line(report))
        elif report.skipped and prev is None:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            self.outcomes[report.nodeid] = ("skipped", reason.removeprefix("Skipped: "))
        elif report.when == "call" and report.passed and prev is None:
            self.outcomes[report.nodeid] = ("passed", "")

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.contracts or not self.config.getoption("lowlat_plugin"):
            return
        tr = terminalreporter
        if self.empty_reason:
            tr.write_line(self.empty_reason, red=True)
        tr.section("lowlat contract")
        cases = self.config.stash.get(_CASES, [])
        tr.write_line(f"plugin {self.config.stash.get(PLUGIN_NAME, self.config.getoption('lowlat_plugin'))}; "
                      f"sweep {sweep_mode(self.config)}; cases: "
                      f"{', '.join(c.id for c in cases) or 'none'}")
        for name, entry in self.contracts.items():
            self._write_contract(tr, name, entry)
        for note in self.config.stash[NOTES]:
            tr.write_line(note)

    def _write_contract(self, tr: Any, name: str, entry: dict[str, Any]) -> None:
        counts: dict[str, int] = defaultdict(int)
        failed, skipped = [], set()
        for nodeid in entry["items"]:
            status, detail = self.outcomes.get(nodeid, ("not run", ""))
            counts[status] += 1
            if status == "failed":
                failed.append((nodeid, detail))
            elif status == "skipped":
                skipped.add(detail)
        verdict = "FAIL" if failed else "PASS" if counts.get("passed") else "SKIP" if counts.get("skipped") else "----"
        tally = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
        tr.write_line(f"{verdict:4}  {name:16} {entry['promise']}", red=bool(failed), green=verdict == "PASS")
        tr.write_line(f"      {'':16} ({tally})")
        for nodeid, detail in failed:
            tr.write_line(f"      {'':16} failed {nodeid.split('::', 1)[-1]}: {detail[:300]}", red=True)
        for reason in sorted(skipped)[:3]:
            tr.write_line(f"      {'':16} skipped: {reason[:200]}")


def _first_line(report: pytest.TestReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    return text.strip().splitlines()[0] if text.strip() else "failed"
