"""The MoE's expert gate/up for a one-row step on the FMA units (``MoEKernelConfig.row1``, with the down kernel's
``ROW1`` form).

``_moe_gate_up_kernel`` multiplies each 16-row weight tile by the 8-row input tile with ``tl.dot`` whatever the
step's row count. At one row the GEMV form of ``gemv.py`` serves the dense gate/up faster (22.42 -> 19.66 µs on
llama-3.2-1b, bench/results/2026-12-02-h200-mega-gemv); this is the same loop for an expert: each program owns
``BLOCK_N`` gate rows and the matching up rows of its slot's expert, walks H in ``BLOCK_K`` chunks with ``h`` as a
1-D vector in the weight tile's column layout, multiplies in fp32 and reduces each chunk.

Grid, slots, workspace and roundings are ``_moe_gate_up_kernel``'s (``moe.py``): grid ``(cdiv(I, BLOCK_N), S)``,
programs of an unused slot exit after ``gdc_wait``; gate and up rounded to the activation dtype, ``silu(gate)``
rounded, times ``up``, rounded; only the fp32 summation order differs. Writes ``act[slot, 0, :]`` (row 0, the
step's only row); the down kernel reads only the rows that chose the slot.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lowlat_nvidia_mega.kernels.pdl import gdc_launch_dependents, gdc_wait
from lowlat_nvidia_mega.kernels.small_gemm import load_tile, rnd, to_act


@triton.jit
def _moe_gate_up_row1_kernel(
    h_ptr, w13_ptr, act_ptr, slot_expert_ptr, num_slots_ptr, H, INTER,
    ROWS_C: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    slot = tl.program_id(1)
    dtype = act_ptr.dtype.element_ty
    gdc_wait(USE_PDL)
    gdc_launch_dependents(USE_PDL)  # after the wait on purpose: the down kernel reads the routing pre-wait
    num = tl.load(num_slots_ptr)
    e = tl.load(slot_expert_ptr + slot).to(tl.int64)  # slot < S always: loaded beside num, used only if slot < num
    if slot < num:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < INTER
        gate_rows = w13_ptr + e * (2 * INTER * H) + offs_n[:, None] * H
        up_rows = gate_rows + INTER * H
        acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < H
            wg = load_tile(gate_rows + ks[None, :], n_mask, k_mask, EVEN_K)
            wu = load_tile(up_rows + ks[None, :], n_mask, k_mask, EVEN_K)
            hk = tl.load(h_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)[None, :]
            acc_g += tl.sum(wg.to(tl.float32) * hk, 1)
            acc_u += tl.sum(wu.to(tl.float32) * hk, 1)
        g = rnd(acc_g, dtype)
        a = rnd(g * tl.sigmoid(g), dtype) * rnd(acc_u, dtype)
        tl.store(act_ptr + slot * ROWS_C * INTER + offs_n, to_act(a, dtype), mask=n_mask)



@triton.jit
def _moe_down_row1_kernel(
    act_ptr, w2_ptr, out_ptr, residual_ptr, slot_expert_ptr, slot_weight_ptr, row_slot_ptr, H, INTER,
    TOP_K: tl.constexpr, TOPK_PAD: tl.constexpr, ROWS_C: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_I: tl.constexpr, EVEN_I: tl.constexpr, HAS_RESIDUAL: tl.constexpr, USE_PDL: tl.constexpr,
):
    """One program per ``BLOCK_N`` output columns, over all ``TOP_K`` experts of the step's one row: no partials,
    no ticket. Row ``r`` of the ``[TOPK_PAD * BLOCK_N, BLOCK_I]`` weight tile is column ``r % BLOCK_N`` of the
    row's ``r // BLOCK_N``-th expert."""
    pid = tl.program_id(0)
    dtype = out_ptr.dtype.element_ty
    r = tl.arange(0, TOPK_PAD * BLOCK_N)
    kk = r // BLOCK_N
    offs_n = pid * BLOCK_N + r % BLOCK_N
    k_ok = kk < TOP_K
    n_mask = k_ok & (offs_n < H)
    # Pre-wait: the routing is complete (gate/up released us only after its own wait on the routing kernel), so
    # the row's slots, their experts and weights, and each expert's first weight chunk load before gdc_wait.
    slot = tl.load(row_slot_ptr + kk, mask=k_ok, other=0, cache_modifier=".cg")
    e = tl.load(slot_expert_ptr + slot, mask=k_ok, other=0, cache_modifier=".cg").to(tl.int64)
    wk = tl.load(slot_weight_ptr + slot * ROWS_C, mask=k_ok, other=0.0, cache_modifier=".cg")
    w_rows = w2_ptr + (e * H * INTER + offs_n.to(tl.int64) * INTER)[:, None]
    a_rows = act_ptr + (slot * ROWS_C * INTER)[:, None]  # row 0 of each slot's act tile
    ks = tl.arange(0, BLOCK_I)
    w = load_tile(w_rows + ks[None, :], n_mask, ks < INTER, EVEN_I)
    gdc_wait(USE_PDL)
    gdc_launch_dependents(USE_PDL)
    a = tl.load(a_rows + ks[None, :], mask=k_ok[:, None] & (ks < INTER)[None, :], other=0.0)
    d = tl.sum(w.to(tl.float32) * a.to(tl.float32), 1)
    for i0 in range(BLOCK_I, INTER, BLOCK_I):
        ki = i0 + ks
        wi = load_tile(w_rows + ki[None, :], n_mask, ki < INTER, EVEN_I)
        ai = tl.load(a_rows + ki[None, :], mask=k_ok[:, None] & (ki < INTER)[None, :], other=0.0)
        d += tl.sum(wi.to(tl.float32) * ai.to(tl.float32), 1)
    d = to_act(d, dtype).to(tl.float32) * wk  # each expert's output rounded, then weighted (as the ticket path)
    acc = tl.sum(tl.reshape(d, [TOPK_PAD, BLOCK_N]), axis=0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    if HAS_RESIDUAL:
        acc += tl.load(residual_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
    tl.store(out_ptr + cols, to_act(acc, dtype), mask=cols < H)
