"""compat_matrix.toml: the repository's file parses, unknown keys are errors, results are rewritten in place."""

from __future__ import annotations

from pathlib import Path

import pytest
from lowlat_contract.matrix import TESTED_MARKER, MatrixError, TestedCombination, load_matrix, parse_matrix, with_result

ROOT = Path(__file__).resolve().parents[2]
BASE = """schema = 1
[[core]]
version = "0.1.0"
commit = "abc"
plugin_api = 1
[[vendor]]
name = "lowlat-x"
plugin = "x"
path = "vendors/x"
version = "0.1.0"
commit = ""
plugin_api = 1
core_range = ">=0.1,<0.2"
"""


def test_repository_matrix_parses_and_names_known_releases():
    m = load_matrix(ROOT / "compat_matrix.toml")
    assert {v.plugin for v in m.vendors} >= {"nvidia_mega", "amd_mono"}
    assert len({c.version for c in m.core}) >= 2
    for t in m.tested:
        m.core_release(t.core)
        m.vendor_release(t.vendor, t.vendor_version)


@pytest.mark.parametrize(("text", "message"), [
    ("colour = 1\n" + BASE, "unknown top-level key"),
    (BASE.replace('plugin_api = 1\n[[vendor]]', 'plugin_api = 1\nlts = true\n[[vendor]]'), r"\[\[core\]\].*lts"),
    (BASE + '[[tested]]\ncore = "9.9"\nvendor = "lowlat-x"\nvendor_version = "0.1.0"\nplatform = "cpu-interpreter"\n'
            'result = "pass"\ndate = "2026-11-30"\n', "no \\[\\[core\\]\\] entry with version '9.9'"),
    (BASE + '[[tested]]\ncore = "0.1.0"\nvendor = "lowlat-x"\nvendor_version = "0.1.0"\nplatform = "tpu"\n'
            'result = "pass"\ndate = "2026-11-30"\n', "platform must be one of"),
])
def test_malformed_matrix_is_rejected(text, message):
    with pytest.raises(MatrixError, match=message):
        parse_matrix(text)


def test_records_are_frozen():
    m = parse_matrix(BASE)
    with pytest.raises(AttributeError):
        m.core[0].version = "2"  # type: ignore[misc]


def test_with_result_replaces_and_adds():
    t1 = TestedCombination("0.1.0", "lowlat-x", "0.1.0", "cpu-interpreter", "fail", "2026-11-29")
    text = with_result(BASE, t1)
    assert TESTED_MARKER in text and text.startswith(BASE.rstrip("\n"))
    t2 = TestedCombination("0.1.0", "lowlat-x", "0.1.0", "cpu-interpreter", "pass", "2026-11-30")
    t3 = TestedCombination("0.1.0", "lowlat-x", "0.1.0", "cuda-sm90", "pass", "2026-11-30", note="H200")
    m = parse_matrix(with_result(with_result(text, t2), t3))
    assert m.tested == (t2, t3)
