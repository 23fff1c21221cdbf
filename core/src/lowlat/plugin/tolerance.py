"""The contract's numeric bounds (docs/contract.md, "Tolerances"): the one place their values are defined.

A plugin row (one token: its logits, or its K/V over all layers) may differ from the general forward's row
``want`` by at most ``MAX_REL[dtype] * scale`` in any element and ``MEAN_REL[dtype] * scale`` on average,
with ``scale = max(1, max |want|)``. The contract suite (``lowlat_contract.cases.Tolerance``) checks with
them; ``lowlat run --compare`` labels a greedy divergence a near-tie by ``MAX_REL``. They live in core so
both can use them: core never imports the suite. So do the MoE router near-tie rule's (``ROUTER_TIE_ULPS``,
``router_gap_ulps``, ``router_near_tie_rows``): the suite excuses a greedy divergence that such a tie precedes
(``lowlat_contract.router_ties``), and so does ``lowlat run --compare``.

Derivation: the general path rounds each of its R = ROUNDINGS intermediates to the model dtype, a fused
plugin may keep float32 instead; to first order each rounding moves the output by at most u (the unit
roundoff) relative to its scale. Worst case the R errors add up (``R * u``); on average they are independent
with random sign and add in quadrature (``sqrt(R) * u``). float32: both paths compute in float32 and differ
only by summation order: ``R * sqrt(n) * u`` and ``sqrt(R * n) * u`` with n = FP32_REDUCTION.
"""

from __future__ import annotations

import math

import torch

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

ROUTER_TIE_ULPS = 4
"""A MoE router row whose top-k boundary gap (k-th minus (k+1)-th logit) is at most this many ulps, at the row's
largest |logit|, is a near-tie: the two paths' router inputs differ by an ulp or two, so rounding may pick another
expert there. Twice the largest flipping gap seen (0-2 ulps on the H200, bench/results/2026-11-30-h200-router-flips;
docs/contract.md, "Tolerances")."""


def router_gap_ulps(router_logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Per row of ``router_logits`` [T, E]: the gap between the k-th and (k+1)-th largest logits, in ulps of the
    logits' dtype at the row's largest |logit| (float32 [T]; the two paths' router logits differ by a few of
    those: their inputs differ by an ulp or two, so a small logit gets the noise of the large ones)."""
    lg = router_logits.float()
    v = lg.topk(top_k + 1, dim=-1).values
    big = lg.abs().amax(dim=-1).clamp_min(1e-30)
    ulp = torch.finfo(router_logits.dtype).eps * torch.exp2(torch.floor(torch.log2(big)))
    return (v[:, top_k - 1] - v[:, top_k]) / ulp


def router_near_tie_rows(router_logits: torch.Tensor, top_k: int, ulps: int = ROUTER_TIE_ULPS) -> list[int]:
    """Rows of ``router_logits`` [T, E] (low-precision dtype) whose top-k boundary gap is at most ``ulps`` ulps
    (``router_gap_ulps``); none for float32 or when E <= top_k."""
    if router_logits.dtype not in (torch.bfloat16, torch.float16) or router_logits.shape[-1] <= top_k:
        return []
    return (router_gap_ulps(router_logits, top_k) <= ulps).nonzero().flatten().tolist()
