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
from lowlat_nvidia_mega.kernels.rounding import rnd, to_act
from lowlat_nvidia_mega.kernels.small_gemm import load_tile


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

