"""The vendors' test harnesses refuse a Triton / NumPy pair the interpreter cannot run, once, with the fix
(``lowlat.platform.interpreter_problem``), instead of failing every kernel test with Triton's ``TypeError``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFTESTS = [ROOT / "vendors" / v / "tests" / "conftest.py" for v in ("nvidia_mega", "amd_mono")]


def _load(path: Path):  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(f"conftest_{path.parent.parent.name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


class _Config:
    def addinivalue_line(self, name: str, line: str) -> None:
        pass


@pytest.mark.parametrize("path", CONFTESTS, ids=lambda p: p.parent.parent.name)
@pytest.mark.parametrize("interpret, problem, refused", [("1", "Triton 3.6.0's interpreter ...", True),
                                                         ("0", "Triton 3.6.0's interpreter ...", False),
                                                         ("1", None, False)])
def test_vendor_harness_refuses_an_interpreter_it_cannot_run(monkeypatch: pytest.MonkeyPatch, path: Path,
                                                             interpret: str, problem: str | None,
                                                             refused: bool) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    mod = _load(path)
    monkeypatch.setattr(mod, "installed_interpreter_problem", lambda: problem)
    if refused:
        with pytest.raises(pytest.UsageError, match=r"TRITON_INTERPRET=1: Triton 3\.6\.0's interpreter"):
            mod.pytest_configure(_Config())
    else:
        mod.pytest_configure(_Config())


def test_installed_versions_are_the_ones_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """``installed_interpreter_problem`` reads the installed distributions' versions (here: a working pair)."""
    import lowlat.platform as lp

    seen: dict[str, str] = {}
    monkeypatch.setattr(lp, "_dist_version", lambda name: {"triton": "3.6.0", "numpy": "2.4.6"}.get(name))
    assert "'numpy<2.4'" in (lp.installed_interpreter_problem() or "")
    monkeypatch.setattr(lp, "_dist_version",
                        lambda name: seen.setdefault(name, "3.9.0" if name == "triton" else "2.4.6"))
    assert lp.installed_interpreter_problem() is None and set(seen) == {"triton", "numpy"}
    assert lp.detect_platform("cpu").numpy_version == "2.4.6"
