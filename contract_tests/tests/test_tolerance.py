"""The bfloat16 tolerance rule: one excused row in eight, left out of the mean as well (docs/contract.md)."""

from __future__ import annotations

import torch
from lowlat_contract.cases import TOLERANCES

BF16 = TOLERANCES["bfloat16"]


def _logits(rows: int = 8) -> torch.Tensor:
    return torch.linspace(-8, 8, rows * 64).reshape(rows, 64)


def test_one_flipped_row_in_eight_is_excused_from_the_element_bound_and_the_mean() -> None:
    want = _logits()
    got = want.clone()
    got[0] += 1.0  # 12.5% of the scale (8): a router flip's size; alone it would push the mean to 1.6% > 1%
    assert BF16.check(got, want, "logits") is None


def test_a_second_outlier_row_or_a_broad_drift_fails() -> None:
    want = _logits()
    two = want.clone()
    two[:2] += 1.0
    assert "2 row(s) over, 1 allowed" in (BF16.check(two, want, "logits") or "")
    drift = want + 0.1  # within the element bound everywhere (0.4), mean 0.1 > 0.08
    assert "mean" in (BF16.check(drift, want, "logits") or "")
    assert TOLERANCES["float32"].check(want + 1e-3, want, "logits") is not None


def test_rows_at_router_near_ties_are_excused_on_top_of_the_allowance_in_bf16_only() -> None:
    want = _logits()
    three = want.clone()
    three[:3] += 1.0
    assert BF16.check(three, want, "logits", tie_rows=frozenset({0, 1})) is None, "2 tie rows + 1 allowed"
    msg = BF16.check(three, want, "logits", tie_rows=frozenset({0})) or ""
    assert "2 row(s) over, 1 allowed, 1 more at router near-ties" in msg
    assert BF16.check(three, want, "logits", tie_rows=frozenset({5, 6})) is not None, "ties elsewhere excuse nothing"
    assert TOLERANCES["float32"].check(want + 1e-3, want, "logits", tie_rows=frozenset(range(8))) is not None
