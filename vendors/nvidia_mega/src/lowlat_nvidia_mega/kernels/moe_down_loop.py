"""The MoE's down projection for 2-8 rows without split-K partials (``MoEKernelConfig.down_loop``).

``_moe_down_kernel`` (``moe.py``) gives every (H tile, slot) pair its own program: at 8 rows about 50 slots x 128
tiles, 6400 programs, each running the whole chain of a split-K program (load its 24 KB weight tile and the slot's
12 KB ``act``, one ``tl.dot``, store a fp32 partial, take a ticket, and for the last arriver load every partial of
the tile) in about 12 waves; on the H200 it ran 112.8 µs against a 39.1 µs byte floor at 8 rows
(bench/results/2026-12-02-h200-mega-moe/call1, ``bench_moe_head.py --stages``).

Here a program owns ``BLOCK_N`` output columns for every row and loops over the step's slots, so the grid is
``cdiv(H, BLOCK_N)`` programs that stream: iteration s loads slot s's expert id and row weights, the expert's
[BLOCK_N, I] weight tile and the slot's [I, 8] ``act`` tile (``num_stages`` deep, software-pipelined by Triton),
multiplies with ``tl.dot``, rounds the expert output to the activation dtype as HF's bf16 module does, and adds
``w[s, r] * out`` in fp32. After the loop it adds the sum to the residual (loaded before ``gdc_wait``: written
before the routing kernel read it) and stores once. No partials, no tickets; the sum over a row's experts runs in
slot order (ascending expert id, HF's expert loop order) and is rounded once, so results are deterministic.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lowlat_nvidia_mega.kernels.pdl import gdc_launch_dependents, gdc_wait
from lowlat_nvidia_mega.kernels.small_gemm import dot_acc, rnd, to_act


@triton.jit
def _moe_down_loop_kernel(
    act_ptr, w2_ptr, out_ptr, residual_ptr, slot_expert_ptr, slot_weight_ptr, num_slots_ptr,
    n_rows, H, INTER, stride_out, stride_res,
    ROWS_C: tl.constexpr, BLOCK_N: tl.constexpr, I_PAD: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    DOT_F32: tl.constexpr, USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    dtype = out_ptr.dtype.element_ty
    rows = tl.arange(0, ROWS_C)
    row_ok = rows < n_rows
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    offs_i = tl.arange(0, I_PAD)
    i_mask = offs_i < INTER
    o_mask = n_mask[:, None] & row_ok[None, :]
    # Pre-wait: the slot count (complete once the gate/up kernel released us) and the residual.
    num = tl.load(num_slots_ptr, cache_modifier=".cg")
    if HAS_RESIDUAL:
        res = tl.load(residual_ptr + rows[None, :] * stride_res + offs_n[:, None], mask=o_mask,
                      other=0.0).to(tl.float32)
    else:
        res = tl.zeros([BLOCK_N, ROWS_C], dtype=tl.float32)
    acc = tl.zeros([BLOCK_N, ROWS_C], dtype=tl.float32)
    gdc_wait(USE_PDL)
    gdc_launch_dependents(USE_PDL)
    for s in range(num):
        e = tl.load(slot_expert_ptr + s).to(tl.int64)
        wrow = tl.load(slot_weight_ptr + s * ROWS_C + rows)
        rmask = (wrow != 0.0) & row_ok
        w = tl.load(w2_ptr + e * (H * INTER) + offs_n[:, None] * INTER + offs_i[None, :],
                    mask=n_mask[:, None] & i_mask[None, :], other=0.0)
        a_t = tl.load(act_ptr + (s * ROWS_C + rows[None, :]) * INTER + offs_i[:, None],
                      mask=i_mask[:, None] & rmask[None, :], other=0.0)
        d = dot_acc(w, a_t, tl.zeros([BLOCK_N, ROWS_C], dtype=tl.float32), DOT_F32)
        acc += rnd(d, dtype) * wrow[None, :]
    tl.store(out_ptr + rows[None, :] * stride_out + offs_n[:, None], to_act(res + acc, dtype), mask=o_mask)
