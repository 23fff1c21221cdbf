"""The MoE's expert kernels for a one-row step on the FMA units: gate/up (``MoEKernelConfig.gate_up_row1``) and
a down that needs no split-K (``down_fused``).

``_moe_gate_up_kernel`` multiplies each 16-row weight tile by the 8-row input tile with ``tl.dot`` whatever the
step's row count. At one row the GEMV form of ``gemv.py`` serves the dense gate/up faster (22.42 -> 19.66 µs on
llama-3.2-1b, bench/results/2026-12-02-h200-mega-gemv); this is the same loop for an expert: each program owns
``BLOCK_N`` gate rows and the matching up rows of its slot's expert, walks H in ``BLOCK_K`` chunks with ``h`` as a
1-D vector in the weight tile's column layout, multiplies in fp32 and reduces each chunk.

Grid, slots, workspace and roundings are ``_moe_gate_up_kernel``'s (``moe.py``): grid ``(cdiv(I, BLOCK_N), S)``,
programs of an unused slot exit after ``gdc_wait``; gate and up rounded to the activation dtype, ``silu(gate)``
rounded, times ``up``, rounded; only the fp32 summation order differs. Writes ``act[slot, 0, :]`` (row 0, the
step's only row); the down kernel reads only the rows that chose the slot.

``_moe_down_row1_kernel`` (``down_fused``): at one row there are exactly ``S = top_k`` slots, so each program owns
``BLOCK_N`` output columns for all slots at once. Before ``gdc_wait`` it loads the routing (slot experts and row-0
weights), the residual (both complete once the gate/up kernel released it: that kernel launches its dependents
only after its own wait, i.e. after routing; the residual was written before routing read it) and the
[S, BLOCK_N, I] weight tiles of all slots (one 3-D load, so every load is in flight together while gate/up runs).
After the wait it reads the slots' ``act`` rows and writes ``out = residual + sum_s w_s * rnd(act_s . W_s)``:
no fp32 partials, no ticket, no last-arriver pass. The expert outputs are rounded to the activation dtype as in
``_moe_down_kernel``; the weighted sum runs in fp32 over the slots (ascending expert id, HF's expert loop order)
as one reduction, and is rounded once.
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


def row1_block_k(block_k: int, hidden: int) -> int:
    """The K chunk the one-row kernel runs: ``block_k`` capped at H rounded up to a power of two."""
    return min(block_k, triton.next_power_of_2(hidden))


@triton.jit
def _moe_down_row1_kernel(
    act_ptr, w2_ptr, out_ptr, residual_ptr, slot_expert_ptr, slot_weight_ptr, num_slots_ptr, H, INTER,
    S: tl.constexpr, S_PAD: tl.constexpr, ROWS_C: tl.constexpr, BLOCK_N: tl.constexpr, I_PAD: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    dtype = out_ptr.dtype.element_ty
    ss = tl.arange(0, S_PAD)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    offs_i = tl.arange(0, I_PAD)
    i_mask = offs_i < INTER
    # Pre-wait (see the module docstring for why each is complete): routing, residual, every slot's weight tile.
    num = tl.load(num_slots_ptr, cache_modifier=".cg")
    s_ok = (ss < S) & (ss < num)
    e = tl.load(slot_expert_ptr + ss, mask=s_ok, other=0, cache_modifier=".cg").to(tl.int64)
    w_s = tl.load(slot_weight_ptr + ss * ROWS_C, mask=s_ok, other=0.0, cache_modifier=".cg")  # row 0's weights
    use = s_ok & (w_s != 0.0)  # as the tl.dot kernel's row mask: a zero weight contributes exactly 0
    if HAS_RESIDUAL:
        res = tl.load(residual_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    else:
        res = tl.zeros([BLOCK_N], dtype=tl.float32)
    w = tl.load(w2_ptr + e[:, None, None] * (H * INTER) + offs_n[None, :, None] * INTER + offs_i[None, None, :],
                mask=use[:, None, None] & n_mask[None, :, None] & i_mask[None, None, :], other=0.0)
    gdc_wait(USE_PDL)
    gdc_launch_dependents(USE_PDL)
    a = tl.load(act_ptr + ss[:, None] * (ROWS_C * INTER) + offs_i[None, :], mask=use[:, None] & i_mask[None, :],
                other=0.0).to(tl.float32)
    d = rnd(tl.sum(w.to(tl.float32) * a[:, None, :], 2), dtype)  # [S_PAD, BLOCK_N] expert outputs, rounded
    y = res + tl.sum(tl.where(use[:, None], d * w_s[:, None], 0.0), 0)
    tl.store(out_ptr + offs_n, to_act(y, dtype), mask=n_mask)
