"""The MoE's expert kernels for a one-row step on the FMA units (``MoEKernelConfig.row1``): gate/up here, down in
the down kernel's ``ROW1`` form or, with ``MoEKernelConfig.row1_down_loop``, here without the split over slots.

``_moe_gate_up_kernel`` multiplies each 16-row weight tile by the 8-row input tile with ``tl.dot`` whatever the
step's row count. At one row the GEMV form of ``gemv.py`` serves the dense gate/up faster (22.42 -> 19.66 µs on
llama-3.2-1b, bench/results/2026-12-02-h200-mega-gemv); this is the same loop for an expert: each program owns
``BLOCK_N`` gate rows and the matching up rows of its slot's expert, walks H in ``BLOCK_K`` chunks with ``h`` as a
1-D vector in the weight tile's column layout, multiplies in fp32 and reduces each chunk.

Grid, slots, workspace and roundings are ``_moe_gate_up_kernel``'s (``moe.py``): grid ``(cdiv(I, BLOCK_N), S)``,
programs of an unused slot exit after ``gdc_wait``; gate and up rounded to the activation dtype, ``silu(gate)``
rounded, times ``up``, rounded; only the fp32 summation order differs. Writes ``act[slot, 0, :]`` (row 0, the
step's only row); the down kernel reads only the rows that chose the slot.

``_moe_down_row1_kernel`` (``row1_down_loop``) is the one-row down without ``_moe_down_kernel``'s split over slots:
grid ``(cdiv(H, BLOCK_N),)``, each program owns ``BLOCK_N`` output columns and walks the row's top-k experts in k
order, I in ``BLOCK_I`` chunks, as one flat loop of ``TOP_K * cdiv(I, BLOCK_I)`` iterations that requests the next
chunk (of the same or the next expert) before it multiplies the current one: Triton does not software-pipeline a
loop whose loads feed no ``tl.dot`` (no ``cp.async`` in the sm90 build), so the prefetch is written out. Each
expert's product is rounded to the activation dtype and times its routing weight, summed in fp32 in k order with
the residual, and rounded once: ``_moe_down_kernel``'s roundings, without its float32 partials, its ticket and its
last arriver's loads (split-K's round trips; the down stage alone took 10.4 µs against a 6.0 µs floor at one row,
bench/results/2026-12-02-h200-mega-moe/call4). As there, the routing is read before ``gdc_wait`` (the gate/up
kernel released us only after its own wait), with the first weight chunk. tp_size 1 only (at TP the split kernel
publishes its tiles to the peers).
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
    act_ptr, w2_ptr, out_ptr, residual_ptr, slot_expert_ptr, slot_weight_ptr, row_slot_ptr, H,
    INTER: tl.constexpr, TOP_K: tl.constexpr, ROWS_C: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_I: tl.constexpr, HAS_RESIDUAL: tl.constexpr, USE_PDL: tl.constexpr,
):
    NCH: tl.constexpr = (INTER + BLOCK_I - 1) // BLOCK_I
    EVEN_I: tl.constexpr = INTER % BLOCK_I == 0
    dtype = out_ptr.dtype.element_ty
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    offs_i = tl.arange(0, BLOCK_I)
    w_cols = offs_n[:, None] * INTER + offs_i[None, :]
    # Pre-wait: row 0's first expert (routing complete, see the module docstring) and its first chunk.
    s = tl.load(row_slot_ptr, cache_modifier=".cg")
    e = tl.load(slot_expert_ptr + s, cache_modifier=".cg").to(tl.int64)
    w = load_tile(w2_ptr + e * H * INTER + w_cols, n_mask, offs_i < INTER, EVEN_I)
    gdc_wait(USE_PDL)
    gdc_launch_dependents(USE_PDL)
    d = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in range(0, TOP_K * NCH):  # branch-free; chunk j + 1 is requested before chunk j is multiplied
        jn = j + 1
        sn = tl.load(row_slot_ptr + tl.minimum(jn // NCH, TOP_K - 1))  # past the end: a valid slot, not loaded
        en = tl.load(slot_expert_ptr + sn).to(tl.int64)
        i0n = (jn % NCH) * BLOCK_I
        n_lim = tl.where(jn < TOP_K * NCH, H, 0)  # (a scalar & tensor mask breaks the interpreter)
        w_next = load_tile(w2_ptr + en * H * INTER + i0n + w_cols, offs_n < n_lim, i0n + offs_i < INTER, EVEN_I)
        i0 = (j % NCH) * BLOCK_I
        a = tl.load(act_ptr + s * ROWS_C * INTER + i0 + offs_i, mask=i0 + offs_i < INTER, other=0.0)
        d += tl.sum(w.to(tl.float32) * a.to(tl.float32)[None, :], 1)
        done = jn % NCH == 0  # expert j // NCH is complete: round, weight, add in k order
        wt = tl.load(slot_weight_ptr + s * ROWS_C)
        acc += tl.where(done, rnd(d, dtype) * wt, 0.0)
        d = tl.where(done, 0.0, d)
        w = w_next
        s = sn
    if HAS_RESIDUAL:
        acc += tl.load(residual_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_n, to_act(acc, dtype), mask=n_mask)
