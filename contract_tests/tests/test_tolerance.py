"""The tolerance rules (docs/contract.md, "Tolerances"): per-row bounds derived from the unit roundoff, no row
excused in a dense model, only rows with a routing difference excused in low-precision MoE steps."""

from __future__ import annotations

import math

import pytest
import torch
from lowlat_contract.cases import ROUNDINGS, TOLERANCES, UNIT_ROUNDOFF

BF16 = TOLERANCES["bfloat16"]


def _logits(rows: int = 8) -> torch.Tensor:
    return torch.linspace(-8, 8, rows * 64).reshape(rows, 64)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_bounds_are_derived_from_the_unit_roundoff(dtype: str) -> None:
    t = TOLERANCES[dtype]
    assert t.max_rel == pytest.approx(ROUNDINGS * UNIT_ROUNDOFF[dtype])
    assert t.mean_rel == pytest.approx(math.sqrt(ROUNDINGS) * UNIT_ROUNDOFF[dtype])
    assert 4e-2 < BF16.max_rel < 6e-2 and 8e-3 < BF16.mean_rel < 1.2e-2, "the 0.2 numbers, now derived"


def test_one_wrong_row_in_eight_fails_in_a_dense_model() -> None:
    want = _logits()
    got = want.clone()
    got[3] += 1.0  # 12.5% of the row scale: the 0.2 suite excused one such row in eight
    msg = BF16.check(got, want, "logits") or ""
    assert "1 of 8 row(s) out of bounds" in msg and "worst row 3" in msg, msg


def test_a_row_drifting_within_the_element_bound_fails_on_its_mean() -> None:
    want = _logits()
    got = want.clone()
    got[7] += 0.3  # row 7's scale is 8: 3.75% of it, under the element bound (5.1%), over the mean bound (1%)
    assert "worst row 7" in (BF16.check(got, want, "logits") or "")
    assert BF16.check(want + 0.01, want, "logits") is None, "a drift of 0.1% of the scale is rounding"


def test_rows_are_bounded_by_their_own_scale() -> None:
    want = _logits()
    want[0] = want[0] / 100  # a row of small logits (scale 1, not 8)
    got = want.clone()
    got[0, 0] += 0.2  # one element: 2.5% of the tensor's scale (8), 20% of that row's (1)
    assert "worst row 0" in (BF16.check(got, want, "logits") or "")


def test_routing_difference_rows_are_excused_in_low_precision_only() -> None:
    want = _logits()
    got = want.clone()
    got[:2] += 1.0
    assert BF16.check(got, want, "logits", tie_rows=frozenset({0, 1})) is None
    msg = BF16.check(got, want, "logits", tie_rows=frozenset({0})) or ""
    assert "1 of 8 row(s) out of bounds; 1 more at a routing difference" in msg, msg
    assert BF16.check(got, want, "logits", tie_rows=frozenset({5, 6})) is not None, "excuses elsewhere excuse nothing"
    assert TOLERANCES["float32"].check(want + 1e-3, want, "logits", tie_rows=frozenset(range(8))) is not None


def test_nan_and_shape_mismatch_fail() -> None:
    want = _logits()
    bad = want.clone()
    bad[0, 0] = float("nan")
    assert "NaN" in (BF16.check(bad, want, "logits") or "")
    assert "shape" in (BF16.check(want[:4], want, "logits") or "")


def _conditioned(spread_row: int, spread: float) -> tuple[torch.Tensor, object]:
    """want, and a Conditioned bound whose float32 twin differs from want by ``spread`` in one row only."""
    from lowlat_contract.conditioning import Conditioned

    want = _logits()
    ref = want.clone()
    ref[spread_row] += spread
    return want, Conditioned(BF16, {"logits": ref})


def test_conditioning_widens_only_the_ill_conditioned_row() -> None:
    """conditioning.Conditioned: a row may be FACTOR x its measured spread away; other rows keep the dtype bound."""
    from lowlat_contract.conditioning import FACTOR

    want, tol = _conditioned(2, 1.0)
    got = want.clone()
    got[2] += 0.95 * FACTOR  # inside FACTOR x spread (1.0), far outside the dtype bound (0.41)
    assert tol.check(got, want, "logits") is None
    got[2] = want[2] + 1.05 * FACTOR
    msg = tol.check(got, want, "logits")
    assert msg is not None and "widened by this step's conditioning" in msg
    got = want.clone()
    got[5] += 1.0  # a row whose twin agrees: the dtype bound, not the widened one
    assert tol.check(got, want, "logits") is not None and "row 5" in tol.check(got, want, "logits")


def test_conditioning_never_tightens_and_never_excuses_nan() -> None:
    want, tol = _conditioned(2, 0.0)  # the twin agrees everywhere: the dtype bound holds
    got = want.clone()
    got[:, ::8] += 0.04  # within every row's dtype bound (scale >= 1: 0.0508 per element, 0.00996 mean)
    assert tol.check(got, want, "logits") is None
    want, tol = _conditioned(2, 100.0)
    got = want.clone()
    got[2, 0] = float("nan")
    assert "NaN" in (tol.check(got, want, "logits") or "")


def test_conditioning_picks_the_reference_by_what_it_checks() -> None:
    """The K/V check reads refs["kv"], the logits check refs["logits"]; a shape mismatch falls back to the dtype
    bound (never to no check)."""
    from lowlat_contract.conditioning import Conditioned

    want = _logits()
    tol = Conditioned(BF16, {"logits": want + 5.0, "kv": want.clone()})
    got = want + 2.0
    assert tol.check(got, want, "step: logits") is None  # widened to 20 by the logits twin
    assert tol.check(got, want, "step: K/V stored at out_cache_loc") is not None  # the kv twin agrees
    assert Conditioned(BF16, {"logits": want[:4]}).check(got, want, "step: logits") is not None


def test_conditioning_floors_max_and_mean_apart() -> None:
    """One element's spread widens the element bound (max), not the row's mean bound by as much."""
    from lowlat_contract.conditioning import FACTOR, Conditioned

    want = _logits()
    ref = want.clone()
    ref[2, 0] += 1.0
    tol = Conditioned(BF16, {"logits": ref})
    got = want.clone()
    got[2, 0] += 0.9 * FACTOR  # one element: max within FACTOR x 1.0, mean 0.056 within FACTOR x 1/64
    assert tol.check(got, want, "logits") is None
    got[2] += 0.1  # every element off by 0.1 more: max 3.7 still inside, mean 0.16 past FACTOR x 1/64 and the dtype
    assert tol.check(got, want, "logits") is not None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_the_suite_and_lowlat_run_compare_use_the_same_bounds(dtype: str) -> None:
    """One source (core's ``lowlat.plugin.tolerance``): a copy in the suite or in ``--compare`` that drifts fails."""
    from lowlat.cli.compare import NEAR_TIE_REL
    from lowlat.plugin.tolerance import MAX_REL, MEAN_REL

    t = TOLERANCES[dtype]
    assert (t.max_rel, t.mean_rel) == (MAX_REL[dtype], MEAN_REL[dtype])
    assert NEAR_TIE_REL[getattr(torch, dtype)] == t.max_rel
