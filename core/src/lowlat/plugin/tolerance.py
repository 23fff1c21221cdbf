"""The contract's numeric bounds (docs/contract.md, "Tolerances"): the one place their values are defined.

A plugin row (one token: its logits, or its K/V over all layers) may differ from the general forward's row
``want`` by at most ``MAX_REL[dtype] * scale`` in any element and ``MEAN_REL[dtype] * scale`` on average,
with ``scale = max(1, max |want|)``. The contract suite (``lowlat_contract.cases.Tolerance``) checks with
them; ``lowlat run --compare`` labels a greedy divergence a near-tie by ``MAX_REL``. They live in core so
both can use them: core never imports the suite.

Derivation: the general path rounds each of its R = ROUNDINGS intermediates to the model dtype, a fused
plugin may keep float32 instead; to first order each rounding moves the output by at most u (the unit
roundoff) relative to its scale. Worst case the R errors add up (``R * u``); on average they are independent
with random sign and add in quadrature (``sqrt(R) * u``). float32: both paths compute in float32 and differ
only by summation order: ``R * sqrt(n) * u`` and ``sqrt(R * n) * u`` with n = FP32_REDUCTION.
"""

from __future__ import annotations

import math

ROUNDINGS = 26
"""Rounding points between the embedding and the logits of a tiny preset's general forward: 12 per decoder layer
(input norm, q/k/v, q/k norm + RoPE, attention, o_proj, residual, post norm, gate/up, activation x up, down,
residual) x 2 layers, plus the final norm and the lm_head."""

UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -9, "float16": 2.0 ** -11}
"""u = eps / 2 of each dtype: the relative error of one rounding to nearest."""

FP32_REDUCTION = 4096
"""The longest dot product of the real presets (hidden or intermediate size): float32 paths differ by summation
order only, which is at most n*u per reduction (Higham's gamma_n) and typically sqrt(n)*u."""


def bounds(dtype: str) -> tuple[float, float]:
    """``(per-element, row-mean)`` bounds of ``dtype`` ("float32", "bfloat16", "float16"), relative to the scale.

    Raises:
        KeyError: a dtype the contract has no bound for.
    """
    u, r = UNIT_ROUNDOFF[dtype], ROUNDINGS
    if dtype == "float32":
        return r * math.sqrt(FP32_REDUCTION) * u, math.sqrt(r * FP32_REDUCTION) * u
    return r * u, math.sqrt(r) * u


MAX_REL = {d: bounds(d)[0] for d in UNIT_ROUNDOFF}
"""Per-element bound relative to ``max(1, max |want_row|)``: bfloat16 5.08e-2, float16 1.27e-2, float32 9.92e-5."""

MEAN_REL = {d: bounds(d)[1] for d in UNIT_ROUNDOFF}
"""Row-mean bound relative to ``max(1, max |want_row|)``: bfloat16 9.96e-3, float16 2.49e-3, float32 1.95e-5."""
