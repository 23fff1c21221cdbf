"""bench/scripts/mutate_*.py: every mutation's original text occurs exactly once in its file, so a source edit
that moves an anchor fails here, in CI, instead of when the next mutation pass is run by hand (an anchor in
qkv_rope.py went stale that way once)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "bench" / "scripts").glob("mutate_*.py"))


def _mutations(script: Path) -> list[tuple]:
    """The script's mutations (name, file, original, mutated), loaded without running the pass: its list ``M``, or
    every group's list where it runs groups against several test files (``GROUPS``: [(mutations, test file)])."""
    sys.path.insert(0, str(script.parent))  # the scripts import mutation_runner from their folder
    try:
        spec = importlib.util.spec_from_file_location(script.stem, script)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(script.parent))
    groups = getattr(mod, "GROUPS", None)
    return [m for ms, _ in groups for m in ms] if groups else mod.M


def test_the_scripts_are_found() -> None:
    assert len(SCRIPTS) >= 7, [s.name for s in SCRIPTS]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s.stem)
def test_every_anchor_occurs_once(script: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # the scripts name files relative to the repository root
    muts = _mutations(script)
    assert muts, f"{script.name} has no mutations"
    for name, path, old, new in muts:
        text = (ROOT / path).read_text()
        assert old != new, f"{script.name}: {name!r} changes nothing"
        assert text.count(old) == 1, f"{script.name}: {name!r} anchor occurs {text.count(old)} times in {path}"
