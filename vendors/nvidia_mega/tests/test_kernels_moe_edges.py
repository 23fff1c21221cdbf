"""moe_forward off the happy path, under TRITON_INTERPRET=1 on CPU (or on a GPU), against the torch reference of
``test_kernels_moe.py``: odd shapes and tiles, one workspace over many launches, router ties, strided and aliased
activations, config validation and a NaN row. Written as an attack on the kernels (helper-38, 2026-12-02); it found
the NaN row dropped by the routing's top-k.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu  # also run on a GPU: python bench/gpu_jobs.py gpu-tests

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    pytest.skip("needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)

from lowlat_nvidia_mega.kernels.moe import MoEKernelConfig, MoEWorkspace, moe_forward  # noqa: E402
from test_kernels_moe import (  # noqa: E402
    CFG,
    CFG_ROW1,
    DEV,
    EPS,
    E,
    H,
    I,
    K,
    check_routing_metadata,
    dev,
    make_weights,
    make_x,
    poisoned_alloc,
    reference,
    rms_norm,
    run,
    tol,
)

# Shapes and tiles off the happy path: H not a multiple of any column tile, I not a power of two and walked in
# several chunks (the last one partial), row1_block_k above / below H and not dividing it, E not a power of two,
# top_k 1 and E, rows 1..8, residual None / in place, norm_w None, renormalize False, the production defaults.
# Every dot's K side is >= 16, as a GPU needs: MoEKernelConfig refuses smaller K chunks, and the launcher pads a
# chunk to 16 where I or H is smaller (the I3 case).
F32, BF16 = torch.float32, torch.bfloat16
R1 = dataclasses.replace(CFG_ROW1, down_block_n=16, row1_block_n=4, route_programs=3)
SHAPES = [  # (H, I, E, top_k, rows, dtype, config, flags); flags: r residual, i in place, n norm, z renormalize
    pytest.param(100, 40, 6, 1, 1, F32, dataclasses.replace(R1, down_block_i=16, row1_block_n=16, row1_block_k=32),
                 "rnz",
                 id="row1-H100-I40x16-k1"),
    pytest.param(72, 24, 5, 5, 1, BF16, dataclasses.replace(R1, down_block_i=16, row1_block_k=256), "rin",
                 id="row1-bf16-bk>H-k=E-inplace"),
    pytest.param(160, 100, 16, 8, 1, BF16, dataclasses.replace(R1, down_block_n=128, down_block_i=64, row1_block_n=8,
                                                               row1_block_k=64), "nz", id="row1-bf16-I100-nores"),
    pytest.param(24, 3, 3, 2, 1, F32, dataclasses.replace(MoEKernelConfig(), route_programs=2), "rnz",
                 id="row1-defaults-I3"),
    pytest.param(40, 56, 4, 3, 1, F32, dataclasses.replace(CFG, down_block_n=16, down_block_i=16), "r",
                 id="tdot-1row-I56x16-nonorm"),
    pytest.param(136, 72, 16, 16, 8, F32, dataclasses.replace(CFG, gate_up_block_n=16, gate_up_block_k=32,
                                                              down_block_n=64, down_block_i=16), "rnz",
                 id="tdot-8rows-k=E-I72x16"),
    pytest.param(40, 20, 12, 3, 5, BF16, dataclasses.replace(CFG, gate_up_block_n=64, gate_up_block_k=16,
                                                             down_block_n=8, down_block_i=16), "",
                 id="tdot-bf16-5rows-bare"),
    pytest.param(96, 48, 8, 1, 2, BF16, dataclasses.replace(MoEKernelConfig(), route_programs=3), "riz",
                 id="tdot-defaults-k1-inplace"),
    pytest.param(48, 33, 7, 2, 7, F32, dataclasses.replace(CFG, down_block_n=32, down_block_i=16), "rnz",
                 id="tdot-7rows-I33x16"),
]


def nan_tailed(t: torch.Tensor) -> torch.Tensor:
    """``t`` on DEV as a contiguous view at the front of a buffer whose tail is NaN: a weight load that ignores its
    K / I mask at the last row reads NaN and poisons the output (NaN * 0 stays NaN)."""
    buf = torch.full((t.numel() + 1024,), float("nan"), dtype=t.dtype, device=DEV)
    view = buf[:t.numel()].view(t.shape)
    view.copy_(dev(t))
    return view


def check_ids(ws: MoEWorkspace, ids: torch.Tensor, x, norm_w, gate_w) -> None:  # type: ignore[no-untyped-def]
    """Top-k ids equal torch's, except in rows with tied router scores (the kernel picks the lower index there)."""
    h = rms_norm(x, norm_w) if norm_w is not None else x
    probs = torch.softmax(F.linear(h, gate_w), dim=-1, dtype=torch.float32)
    got = ws.topk_ids[:x.shape[0]].long().cpu()
    for r in range(x.shape[0]):
        if len(set(probs[r].tolist())) == probs.shape[1]:
            assert torch.equal(got[r], ids[r]), (r, got[r], ids[r])


@pytest.mark.parametrize(("hidden", "inter", "experts", "top_k", "rows", "dtype", "cfg", "flags"), SHAPES)
def test_shapes_and_tiles_match_reference(hidden: int, inter: int, experts: int, top_k: int, rows: int,
                                          dtype: torch.dtype, cfg: MoEKernelConfig, flags: str) -> None:
    norm_w, gate_w, w13, w2 = make_weights(dtype, seed=hidden + inter, h=hidden, i=inter, e=experts)
    norm_w = norm_w if "n" in flags else None
    x, residual = make_x(rows, dtype, seed=rows + experts, h=hidden)
    residual = residual if "r" in flags else None
    want, ids, _ = reference(x, residual, norm_w, gate_w, w13, w2, "z" in flags, top_k=top_k)
    if "i" in flags:  # out is the residual tensor itself
        ws = MoEWorkspace.allocate(8, hidden, inter, experts, top_k, dtype, DEV, alloc=poisoned_alloc)
        out = dev(residual.clone())
        moe_forward(dev(x), out, dev(norm_w), EPS, nan_tailed(gate_w), nan_tailed(w13), nan_tailed(w2), top_k,
                    "z" in flags, out, ws, pdl=False, config=cfg)
        out = out.cpu()
    else:
        out, ws = run(x, residual, norm_w, nan_tailed(gate_w), nan_tailed(w13), nan_tailed(w2), "z" in flags,
                      cfg=cfg, top_k=top_k)
    torch.testing.assert_close(out.float(), want.float(), **tol(dtype))
    check_ids(ws, ids, x, norm_w, gate_w)
    check_routing_metadata(ws, rows)


def test_one_workspace_many_launches() -> None:
    """One poisoned workspace serves launches of 8, 1 (one-row forms), 3, 1 (tl.dot) and 1 row again with other
    tiles and flags: nothing stale (act rows, partials, slots, tickets) leaks from one launch into the next."""
    hidden, inter, experts, top_k = 72, 40, 6, 2
    norm_w, gate_w, w13, w2 = make_weights(F32, seed=21, h=hidden, i=inter, e=experts)
    ws = MoEWorkspace.allocate(8, hidden, inter, experts, top_k, F32, DEV, alloc=poisoned_alloc)
    chunked = dataclasses.replace(CFG, down_block_n=16, down_block_i=16)
    plan = [(8, chunked, True), (1, R1, False), (3, CFG, True), (1, chunked, True),
            (1, dataclasses.replace(R1, down_block_n=64, down_block_i=32, row1_block_k=128), False), (8, CFG, False)]
    for seed, (rows, cfg, renormalize) in enumerate(plan):
        x, residual = make_x(rows, F32, seed=30 + seed, h=hidden)
        out, _ = run(x, residual, norm_w, gate_w, w13, w2, renormalize, ws=ws, cfg=cfg, top_k=top_k)
        want, ids, _ = reference(x, residual, norm_w, gate_w, w13, w2, renormalize, top_k=top_k)
        torch.testing.assert_close(out, want, **tol(F32), msg=lambda m, s=seed: f"launch {s}: {m}")
        assert torch.equal(ws.topk_ids[:rows].long().cpu(), ids)
        check_routing_metadata(ws, rows)


@pytest.mark.parametrize("cfg", [CFG, CFG_ROW1], ids=["tl.dot", "row1"])
def test_equal_router_scores_pick_the_lower_expert(cfg: MoEKernelConfig) -> None:
    """Experts 2, 5 and 6 have identical router rows (the only nonzero ones): every row scores them equally and
    must pick 2 then 5 (first-occurrence order, moe_route.py), weights 1/2 each after renormalization."""
    norm_w, gate_w, w13, w2 = make_weights(F32, seed=40)
    gate_w = torch.zeros_like(gate_w)
    gate_w[[2, 5, 6]] = torch.rand(H, generator=torch.Generator().manual_seed(41)) + 0.1
    for rows in (1, 4):
        x, residual = make_x(rows, F32, seed=42)
        out, ws = run(x.abs() + 0.1, residual, None, gate_w, w13, w2, True, cfg=cfg)
        assert ws.topk_ids[:rows].tolist() == [[2, 5]] * rows
        assert ws.topk_weights[:rows].tolist() == [[0.5, 0.5]] * rows
        check_routing_metadata(ws, rows)
        assert bool(torch.isfinite(out).all())


@pytest.mark.parametrize("cfg", [CFG, CFG_ROW1], ids=["tl.dot", "row1"])
@pytest.mark.parametrize("rows", [1, 3])
def test_strided_and_aliased_activations(rows: int, cfg: MoEKernelConfig) -> None:
    """x, residual and out as column slices of wider buffers (row stride > H, stride_x / stride_res / stride_out
    differ), and out = residual = x (the residual stream updated in place, x read by the routing only)."""
    norm_w, gate_w, w13, w2 = make_weights(F32, seed=50)
    x, residual = make_x(rows, F32, seed=51)
    want, _, _ = reference(x, residual, norm_w, gate_w, w13, w2, True)
    ws = MoEWorkspace.allocate(8, H, I, E, K, F32, DEV, alloc=poisoned_alloc)
    xb, rb, ob = (torch.full((rows, H + pad), float("nan"), device=DEV) for pad in (16, 40, 8))
    xv, rv, ov = xb[:, 16:], rb[:, :H], ob[:, 8:]
    xv.copy_(dev(x))
    rv.copy_(dev(residual))
    moe_forward(xv, rv, dev(norm_w), EPS, dev(gate_w), dev(w13), dev(w2), K, True, ov, ws, pdl=False, config=cfg)
    torch.testing.assert_close(ov.cpu(), want, **tol(F32))
    assert bool(ob[:, :8].isnan().all()) and bool(rb[:, H:].isnan().all())  # nothing written outside the views
    stream = dev(x.clone())
    want, _, _ = reference(x, x, norm_w, gate_w, w13, w2, True)
    moe_forward(stream, stream, dev(norm_w), EPS, dev(gate_w), dev(w13), dev(w2), K, True, stream, ws, pdl=False,
                config=cfg)
    torch.testing.assert_close(stream.cpu(), want, **tol(F32))


# K sides below 16 cannot be tl.dot operands; no strings or floats; at most 32 warps a program
@pytest.mark.parametrize(("field", "value"), [
    ("down_block_i", 0), ("down_block_i", 48), ("row1_block_n", 3), ("row1_block_k", 0), ("gate_up_block_k", 96),
    ("gate_up_block_n", 12), ("down_block_n", 4), ("down_warps", 6), ("route_warps", 0), ("route_programs", 0),
    ("down_stages", 0), ("gate_up_stages", -1), ("down_block_i", 8), ("gate_up_block_k", 8), ("row1", "no"),
    ("down_block_n", 16.0), ("down_warps", 64), ("row1_warps", 1024), ("route_min_rows", 16),
    ("route_min_rows", 3), ("route_min_rows", 0)])
def test_config_rejects_bad_fields(field: str, value: int) -> None:
    with pytest.raises(ValueError, match=field):
        MoEKernelConfig(**{field: value})


def test_config_and_workspace_accept_edges() -> None:
    cfg = MoEKernelConfig(route_programs=3, down_stages=7, down_block_n=8, down_block_i=16, row1_block_n=1)
    assert (cfg.route_programs, cfg.down_stages) == (3, 7)  # not powers of two: counts and depths
    for args in ((0, H, I, E, K), (8, H, 0, E, K), (8, H, I, E, 0), (8, H, I, E, E + 1)):
        with pytest.raises(ValueError):
            MoEWorkspace.allocate(*args, F32, DEV)
    ws = MoEWorkspace.allocate(1, H, I, E, E, F32, DEV)  # top_k = E at one row: E slots
    assert ws.slot_expert.shape == (E,) and int(ws.counters.abs().sum()) == 0


@pytest.mark.parametrize("cfg", [CFG, CFG_ROW1], ids=["tl.dot", "row1"])
@pytest.mark.parametrize("rows", [1, 2])
def test_nan_row_propagates_and_out_is_written(rows: int, cfg: MoEKernelConfig) -> None:
    """A NaN in row 0 makes its softmax NaN; HF (torch.topk ranks NaN highest) then gives a NaN output row. The
    routing must rank NaN first too: before, its top-k found no ``work == best``, stored id E_PAD, selected no
    expert, so the row came out as the residual (rows=2) or ``out`` was never written (rows=1, num_slots 0)."""
    norm_w, gate_w, w13, w2 = (dev(t) for t in make_weights(F32, seed=60))
    x, residual = (dev(t) for t in make_x(rows, F32, seed=61))
    x[0, 3] = float("nan")
    ws = MoEWorkspace.allocate(8, H, I, E, K, F32, DEV, alloc=poisoned_alloc)
    out = torch.zeros_like(x)
    moe_forward(x, residual, norm_w, EPS, gate_w, w13, w2, K, False, out, ws, pdl=False, config=cfg)
    problems = [] if bool(out[0].isnan().all()) else [f"NaN row came out finite: {out[0, :4].tolist()}..."]
    if int(ws.topk_ids[:rows].max()) >= E:
        problems.append(f"top-k ids {ws.topk_ids[:rows].tolist()} out of [0, {E})")
    if not bool(ws.topk_weights[0].isnan().all()):  # HF: the NaN probabilities are the weights
        problems.append(f"the NaN row's weights are {ws.topk_weights[0].tolist()}")
    assert not problems, "; ".join(problems)
    assert int(ws.counters.abs().sum()) == 0


@pytest.mark.parametrize("dtype", [F32, BF16])  # the score search and (bf16) the key search
def test_nan_row_leaves_other_slots_zero_with_renormalize(dtype: torch.dtype) -> None:
    """With ``renormalize`` a NaN row's denominator is NaN; it must scale only the row's own picks (experts 0..k-1,
    NaN weights), so in every other expert's slot tile the row's weight stays 0 (found by helper-15, 2026-12-07: 0
    / NaN made them NaN). Row 1 picks other experts and stays finite."""
    norm_w, gate_w, w13, w2 = make_weights(dtype, seed=62)
    gate_w[:K] = -1.0  # row 1 (positive x, no norm) scores experts 0 and 1 lowest: it picks others
    x, residual = make_x(2, dtype, seed=63)
    x = x.abs() + 0.1
    x[0, 3] = float("nan")
    out, ws = run(x, residual, None, gate_w, w13, w2, True)
    assert ws.topk_ids[0].tolist() == list(range(K)) and bool(ws.topk_weights[0].isnan().all())
    assert not set(ws.topk_ids[1].tolist()) & set(range(K)) and bool(torch.isfinite(out[1]).all())
    n = int(ws.num_slots)
    experts = ws.slot_expert[:n].tolist()
    row0 = ws.slot_weight[:n, 0].cpu()
    for s, e in enumerate(experts):
        if e < K:
            assert bool(row0[s].isnan()), (e, float(row0[s]))
        else:
            assert float(row0[s]) == 0.0, (e, float(row0[s]))
