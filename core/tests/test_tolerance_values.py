"""The contract's bounds have one source (``lowlat.plugin.tolerance``): ``lowlat run --compare`` uses it, and
docs/contract.md's "Tolerances" table prints its values (three significant figures)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from lowlat.cli.compare import NEAR_TIE_REL, near_tie_rel
from lowlat.plugin.tolerance import MAX_REL, MEAN_REL

DOC = Path(__file__).resolve().parents[2] / "docs" / "contract.md"
DTYPES = ("float32", "bfloat16", "float16")


def _doc_table() -> dict[str, tuple[str, str]]:
    """docs/contract.md's Tolerances table: dtype -> (per-element, row-mean) figures as printed."""
    text = DOC.read_text().split("## Tolerances", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\w+) \| `<= ([0-9.e+-]+) \* scale` \| `<= ([0-9.e+-]+) \* scale` \|", text, re.M)
    return {d: (a, b) for d, a, b in rows}


def test_compare_near_tie_bound_is_the_contracts_per_element_bound() -> None:
    assert {str(k).removeprefix("torch."): v for k, v in NEAR_TIE_REL.items()} == MAX_REL
    assert near_tie_rel(torch.float64) == MAX_REL["bfloat16"]  # a dtype without a bound gets bfloat16's


@pytest.mark.parametrize("dtype", DTYPES)
def test_docs_contract_table_prints_the_bounds(dtype: str) -> None:
    table = _doc_table()
    assert set(table) == set(DTYPES), f"docs/contract.md's Tolerances table: {sorted(table)}"
    per_element, row_mean = table[dtype]
    assert float(per_element) == float(f"{MAX_REL[dtype]:.3g}"), (dtype, per_element, MAX_REL[dtype])
    assert float(row_mean) == float(f"{MEAN_REL[dtype]:.3g}"), (dtype, row_mean, MEAN_REL[dtype])
