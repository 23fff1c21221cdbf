"""The routing's top-k on int32 keys (``MoEKernelConfig.route_keys``, ``moe_route._top_k_by_keys``) against the
score search it replaces, under TRITON_INTERPRET=1 on CPU (or on a GPU): the same experts, weights, slots and
output for random routers and for crafted logits (ties, signed zeros, negatives, -inf, +inf, NaN, overflow), and
the one documented difference (equal float32 probabilities of different logits).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

pytestmark = pytest.mark.gpu  # also run on a GPU: python bench/gpu_jobs.py gpu-tests

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    pytest.skip("needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)

from lowlat_nvidia_mega.kernels.moe import MoEKernelConfig, MoEWorkspace  # noqa: E402
from test_kernels_moe import (  # noqa: E402
    CFG_ROW1,
    DEV,
    H,
    check_routing_metadata,
    make_weights,
    make_x,
    reference,
    run,
)

SCORES = dataclasses.replace(CFG_ROW1, route_keys=False)
KEYS = dataclasses.replace(CFG_ROW1, route_keys=True)
E3, K3 = 8, 3  # crafted routers: 8 experts, top 3


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values (-0 equals +0), NaN where the other has NaN."""
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan()) if a.is_floating_point() else a == b).all())


def both(x, residual, norm_w, gate_w, w13, w2, renormalize, top_k):  # type: ignore[no-untyped-def]
    """Run the score search and the key search on the same inputs (each in its own poisoned workspace, as ``run``
    allocates it); return their (out, workspace) pairs."""
    return tuple(run(x, residual, norm_w, gate_w, w13, w2, renormalize, cfg=cfg, top_k=top_k) for cfg in (SCORES, KEYS))


def assert_same_routing(a, b, rows: int, finite_rows: list[int] | None = None) -> None:  # type: ignore[no-untyped-def]
    (out_a, ws_a), (out_b, ws_b) = a, b
    for name in ("topk_ids", "topk_weights", "row_slot"):
        ta, tb = getattr(ws_a, name)[:rows].cpu(), getattr(ws_b, name)[:rows].cpu()
        assert same(ta, tb), f"{name}: scores {ta.tolist()} vs keys {tb.tolist()}"
    n = int(ws_a.num_slots)
    assert n == int(ws_b.num_slots) and torch.equal(ws_a.slot_expert[:n].cpu(), ws_b.slot_expert[:n].cpu())
    assert same(ws_a.slot_weight[:n, :rows].cpu(), ws_b.slot_weight[:n, :rows].cpu())
    assert same(out_a, out_b), "outputs differ"
    for r in finite_rows if finite_rows is not None else range(rows):
        assert bool(torch.isfinite(out_b[r]).all()), f"row {r} came out non-finite"
    if finite_rows is None:
        check_routing_metadata(ws_b, rows)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("seed", [0, 1])
def test_keys_match_scores_on_random_routers(dtype: torch.dtype, rows: int, seed: int) -> None:
    norm_w, gate_w, w13, w2 = make_weights(dtype, seed=70 + seed)
    x, residual = make_x(rows, dtype, seed=80 + seed)
    for renormalize in (True, False):
        assert_same_routing(*both(x, residual, norm_w, gate_w, w13, w2, renormalize, 2), rows)


def crafted(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """x [8, H] and a router [E3, H] whose logits (no norm, x one-hot per row) are chosen per row; a value ``big``
    squared overflows the dtype (bf16 / fp16) to +-inf. Returns x, the router, and the rows with a finite max (the
    experts' products of a ``big`` input overflow, so row 2's output is not finite although its routing is)."""
    big = 1e38 if dtype == torch.bfloat16 else 256.0
    nan = float("nan")
    rows = [  # (x value at the row's column, the router's column: one logit per expert)
        (1.0, [1, 3, 3, 2, 3, 0, -1, 1]),                          # a three-way tie: 1, 2, 4
        (1.0, [-0.0, 0.0, -0.5, -0.25, -0.0, -3, 0.0, -1e-3]),     # signed zeros tie: 0, 1, 4
        (big, [-big, -big, 2 / big, -big, -big, -big, -big, -big]),  # one finite, the rest -inf (p = 0 ties)
        (big, [0, big, 1 / big, 0.5 / big, -1 / big, 2 / big, 0, 0]),  # a +inf logit: every p NaN
        (nan, [1, 2, 3, 4, 5, 6, 7, 8]),                            # a NaN input: every logit NaN
        (big, [-big] * 8),                                          # every logit -inf: every p NaN
        (1.0, [100, -100, 50, 49.75, 1e-3, -1e-3, 7, 7]),           # wide range
        (1.0, [-5, -1, -3, -1, -2, -7, -0.5, -9]),                  # negatives only: 6, then the tie 1, 3
    ]
    x = torch.zeros(8, H)
    gate_w = torch.zeros(E3, H)
    for r, (xv, col) in enumerate(rows):
        x[r, r] = xv
        gate_w[:, r] = torch.tensor(col)
    return x.to(dtype), gate_w.to(dtype), [0, 1, 2, 6, 7]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 4, 8])
def test_keys_match_scores_on_crafted_logits(dtype: torch.dtype, rows: int) -> None:
    """Ties (the lower index wins), -0 and +0 as equals, negatives, -inf (probability 0, ties by index), a +inf or
    NaN logit and an all -inf row (every probability NaN: experts 0..k-1, NaN weights), at 1-8 rows (the
    selection tile is next_pow2(rows) rows)."""
    _, _, w13, w2 = make_weights(dtype, seed=90, e=E3)
    x, gate_w, finite = crafted(dtype)
    residual = torch.zeros(8, H, dtype=dtype)
    res = both(x[:rows], residual[:rows], None, gate_w, w13, w2, True, K3)
    assert_same_routing(*res, rows, finite_rows=[r for r in finite if r < rows and r != 2])
    ids = res[1][1].topk_ids[:rows].tolist()
    want = [[1, 2, 4], [0, 1, 4], [2, 0, 1], [0, 1, 2], [0, 1, 2], [0, 1, 2], [0, 2, 3], [6, 1, 3]][:rows]
    assert ids == want
    weights = res[1][1].topk_weights[:rows].cpu()
    for r in range(rows):
        assert bool(weights[r].isnan().all()) is (r not in finite), (r, weights[r].tolist())


def test_keys_rank_equal_probabilities_by_logit() -> None:
    """The documented difference: logits 1e-7 and 0 beside a max of 10 give the same float32 probability
    (1e-7 - 10 rounds to -10); the score search takes the lower index (expert 1, logit 0), the key search the
    higher logit (expert 2). Weights are equal, so only the expert differs."""
    dtype = torch.bfloat16
    _, _, w13, w2 = make_weights(dtype, seed=91, e=E3)
    x = torch.zeros(1, H, dtype=dtype)
    x[0, 0] = 1.0
    gate_w = torch.zeros(E3, H)
    gate_w[:, 0] = torch.tensor([10, 0, 1e-7, -1, -2, -3, -4, -5])
    gate_w = gate_w.to(dtype)
    assert float(gate_w[2, 0]) != 0.0
    (_, ws_s), (_, ws_k) = both(x, None, None, gate_w, w13, w2, False, 2)
    assert ws_s.topk_ids[0].tolist() == [0, 1] and ws_k.topk_ids[0].tolist() == [0, 2]
    assert torch.equal(ws_s.topk_weights[0], ws_k.topk_weights[0])


def test_keys_need_16_bit_activations() -> None:
    """float32 logits do not fit the key: a float32 launch keeps the score search (bit-identical output)."""
    norm_w, gate_w, w13, w2 = make_weights(torch.float32, seed=92)
    x, residual = make_x(3, torch.float32, seed=93)
    (out_s, _), (out_k, ws_k) = both(x, residual, norm_w, gate_w, w13, w2, True, 2)
    assert torch.equal(out_s, out_k)
    assert torch.equal(ws_k.topk_ids[:3].long().cpu(), reference(x, residual, norm_w, gate_w, w13, w2, True)[1])


@pytest.mark.parametrize("rows", [1, 2])
def test_keys_signed_zero_and_a_nan_logit(rows: int) -> None:
    """-0 and +0 logits are equal probabilities (the lower index wins); a -0 logit is a negative float32 dot below
    half bf16's smallest subnormal (2**-70 * -2**-70), rounded. And a NaN in one expert's router row makes that
    logit NaN in every row, so every probability is NaN: experts 0..k-1, NaN weights, in both searches."""
    dtype = torch.bfloat16
    _, _, w13, w2 = make_weights(dtype, seed=94, e=E3)
    x = torch.zeros(rows, H)
    x[:, 0] = 2.0**-70
    gate_w = torch.zeros(E3, H)
    gate_w[:, 0] = torch.tensor([-3.0, -1.0, -1.0, 0.0, -1.0, -2.0, 0.0, -5.0]) * 2.0**60
    gate_w[[1, 4], 0] = -(2.0**-70)
    res = both(x.to(dtype), None, None, gate_w.to(dtype), w13, w2, True, K3)
    assert_same_routing(*res, rows)
    logits = res[1][1].logits[:rows].cpu()
    assert str(float(logits[0, 1])) == "-0.0" and str(float(logits[0, 3])) == "0.0"  # the test's premise
    assert res[1][1].topk_ids[:rows].tolist() == [[1, 3, 4]] * rows
    gate_w[5, 7] = float("nan")
    res = both(x.to(dtype), None, None, gate_w.to(dtype), w13, w2, True, K3)
    assert_same_routing(*res, rows, finite_rows=[])
    assert res[1][1].topk_ids[:rows].tolist() == [[0, 1, 2]] * rows
    assert bool(res[1][1].topk_weights[:rows].isnan().all())


def test_keys_on_by_default_and_launched_for_16_bit_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """``route_keys`` is on by default (measured faster in the step on an H100); on, the routing launch gets
    ``KEYS`` for bf16 and fp16 activations and not for float32."""
    from lowlat_nvidia_mega.kernels import moe
    from sm90_launch import LaunchRecorder

    assert MoEKernelConfig().route_keys is True
    log: list = []
    for name in ("moe_route_kernel", "_moe_gate_up_kernel", "_moe_gate_up_row1_kernel", "_moe_down_kernel"):
        monkeypatch.setattr(moe, name, LaunchRecorder(name, log))
    for dtype, want in ((torch.bfloat16, True), (torch.float16, True), (torch.float32, False)):
        norm_w, gate_w, w13, w2 = (t.to(DEV) for t in make_weights(dtype))
        x, residual = (t.to(DEV) for t in make_x(2, dtype))
        for cfg, on in ((KEYS, want), (SCORES, False)):
            log.clear()
            ws = MoEWorkspace.allocate(8, H, w2.shape[2], w2.shape[0], 2, dtype, DEV)
            moe.moe_forward(x, residual, norm_w, 1e-6, gate_w, w13, w2, 2, True, torch.empty_like(x), ws, pdl=False,
                            config=cfg)
            assert log[0][0] == "moe_route_kernel" and log[0][3]["KEYS"] is on, (dtype, cfg.route_keys)
