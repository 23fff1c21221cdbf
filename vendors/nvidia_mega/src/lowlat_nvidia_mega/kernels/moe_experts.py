"""The MoE's expert kernels at 1-8 rows: gate/up (``tl.dot`` form) and down (``tl.dot`` and one-row ``ROW1``
forms, split-K over slots with a fixed-order last-arriver sum). ``moe.py`` describes the three-kernel chain, its
grids, PDL ordering and precision, and launches these through ``MoEStages``; the one-row gate/up is in
``moe_row1.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lowlat_nvidia_mega.kernels.pdl import gdc_launch_dependents, gdc_wait
from lowlat_nvidia_mega.kernels.rounding import to_act
from lowlat_nvidia_mega.kernels.small_gemm import dot_acc
from lowlat_nvidia_mega.kernels.tp_epilogue import publish_epilogue


@triton.jit
def _moe_gate_up_kernel(
    h_ptr, w13_ptr, act_ptr, slot_expert_ptr, slot_weight_ptr, num_slots_ptr,
    n_rows, H, INTER,
    ROWS_C: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    slot = tl.program_id(1)
    dtype = act_ptr.dtype.element_ty
    gdc_wait(USE_PDL)
    gdc_launch_dependents(USE_PDL)  # after the wait on purpose: see the module docstring
    num = tl.load(num_slots_ptr)
    # slot < S always: the expert and weights load beside num (one round trip), used only if slot < num
    e = tl.load(slot_expert_ptr + slot).to(tl.int64)
    rows = tl.arange(0, ROWS_C)
    wrow = tl.load(slot_weight_ptr + slot * ROWS_C + rows)
    if slot < num:
        rmask = (wrow != 0.0) & (rows < n_rows)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = offs_n < INTER
        gate_ptr = w13_ptr + e * (2 * INTER * H) + offs_n[:, None] * H
        up_ptr = gate_ptr + INTER * H
        acc_g = tl.zeros([BLOCK_N, ROWS_C], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N, ROWS_C], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            kmask = offs_k < H
            wmask = nmask[:, None] & kmask[None, :]
            wg = tl.load(gate_ptr + offs_k[None, :], mask=wmask, other=0.0)
            wu = tl.load(up_ptr + offs_k[None, :], mask=wmask, other=0.0)
            h_t = tl.load(h_ptr + rows[None, :] * H + offs_k[:, None], mask=kmask[:, None] & rmask[None, :],
                          other=0.0)
            acc_g = dot_acc(wg, h_t, acc_g, DOT_F32)
            acc_u = dot_acc(wu, h_t, acc_u, DOT_F32)
        g = to_act(acc_g, dtype).to(tl.float32)
        u = to_act(acc_u, dtype).to(tl.float32)
        a = to_act(g * tl.sigmoid(g), dtype).to(tl.float32) * u
        tl.store(act_ptr + (slot * ROWS_C + rows[None, :]) * INTER + offs_n[:, None], to_act(a, dtype),
                 mask=nmask[:, None])


@triton.jit
def _moe_down_kernel(
    act_ptr, w2_ptr, partial_ptr, out_ptr, residual_ptr,
    slot_expert_ptr, slot_weight_ptr, num_slots_ptr, row_slot_ptr, counters_ptr,
    n_rows, H, INTER, stride_out, stride_res,
    data_ptrs, flag_ptrs, tag_ptr, rank, cap, cap_tiles, publish,
    TOP_K: tl.constexpr, TOPK_PAD: tl.constexpr, ROWS_C: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_I: tl.constexpr, HAS_RESIDUAL: tl.constexpr, DOT_F32: tl.constexpr, ROW1: tl.constexpr,
    USE_PDL: tl.constexpr, PUBLISH: tl.constexpr, WORLD: tl.constexpr,
):
    pid_n = tl.program_id(0)
    slot = tl.program_id(1)
    dtype = out_ptr.dtype.element_ty
    rows = tl.arange(0, ROWS_C)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < H
    offs_i = tl.arange(0, BLOCK_I)  # the first I chunk (the whole of I unless BLOCK_I < I)
    imask = offs_i < INTER
    # Pre-wait: the routing (written by the kernel before the previous one, complete once the previous kernel
    # released us: slot count, expert, row weights) and this slot's first chunk of down weights.
    num = tl.load(num_slots_ptr, cache_modifier=".cg")
    active = slot < num
    e = tl.load(slot_expert_ptr + slot, cache_modifier=".cg").to(tl.int64)  # slot < S: beside num; masked below
    n_lim = tl.where(active, H, 0)  # (a scalar & tensor mask breaks the interpreter; limit the range instead)
    w_rows = w2_ptr + e * (H * INTER) + offs_n[:, None] * INTER
    w = tl.load(w_rows + offs_i[None, :], mask=(offs_n < n_lim)[:, None] & imask[None, :], other=0.0)
    wrow = tl.load(slot_weight_ptr + slot * ROWS_C + rows, cache_modifier=".cg")
    gdc_wait(USE_PDL)
    gdc_launch_dependents(USE_PDL)
    if active:
        rmask = (wrow != 0.0) & (rows < n_rows)
        if ROW1:  # one row: the products on the FMA units, row 0's act as a 1-D vector
            a_row = act_ptr + slot * ROWS_C * INTER
            a0 = tl.load(a_row + offs_i, mask=imask, other=0.0).to(tl.float32)
            d0 = tl.sum(w.to(tl.float32) * a0[None, :], 1)
            for i0 in range(BLOCK_I, INTER, BLOCK_I):  # further I chunks
                oi = i0 + offs_i
                wi = tl.load(w_rows + oi[None, :], mask=nmask[:, None] & (oi < INTER)[None, :], other=0.0)
                ai = tl.load(a_row + oi, mask=oi < INTER, other=0.0).to(tl.float32)
                d0 += tl.sum(wi.to(tl.float32) * ai[None, :], 1)
            d = tl.where((rmask & (rows == 0))[None, :], d0[:, None], 0.0)  # as the masked tile gives
        else:
            a_rows = act_ptr + (slot * ROWS_C + rows[None, :]) * INTER
            a_t = tl.load(a_rows + offs_i[:, None], mask=imask[:, None] & rmask[None, :], other=0.0)
            d = dot_acc(w, a_t, tl.zeros([BLOCK_N, ROWS_C], dtype=tl.float32), DOT_F32)
            for i0 in range(BLOCK_I, INTER, BLOCK_I):  # further I chunks, software-pipelined (down_stages)
                oi = i0 + offs_i
                im = oi < INTER
                wi = tl.load(w_rows + oi[None, :], mask=nmask[:, None] & im[None, :], other=0.0)
                a_ti = tl.load(a_rows + oi[:, None], mask=im[:, None] & rmask[None, :], other=0.0)
                d = dot_acc(wi, a_ti, d, DOT_F32)
        d = to_act(d, dtype).to(tl.float32) * wrow[None, :]
        tl.store(partial_ptr + (slot * ROWS_C + rows[None, :]) * H + offs_n[:, None], d, mask=nmask[:, None])
        tl.debug_barrier()
        ticket = tl.atomic_add(counters_ptr + pid_n, 1, sem="acq_rel")
        if ticket == num - 1:
            tl.atomic_xchg(counters_ptr + pid_n, 0)
            kk = tl.arange(0, TOPK_PAD)
            row_ok = rows < n_rows
            rk_mask = row_ok[:, None] & (kk < TOP_K)[None, :]
            rs = tl.load(row_slot_ptr + rows[:, None] * TOP_K + kk[None, :], mask=rk_mask, other=0)
            parts = tl.load(partial_ptr + (rs[:, :, None] * ROWS_C + rows[:, None, None]) * H
                            + offs_n[None, None, :],
                            mask=rk_mask[:, :, None] & nmask[None, None, :], other=0.0, cache_modifier=".cg")
            acc = tl.sum(parts, axis=1)
            omask = row_ok[:, None] & nmask[None, :]
            if HAS_RESIDUAL:
                acc += tl.load(residual_ptr + rows[:, None] * stride_res + offs_n[None, :], mask=omask,
                               other=0.0).to(tl.float32)
            if PUBLISH:  # tp_size > 1: this rank's partial of the MoE output to every rank (tp_epilogue.py)
                publish_epilogue(acc, rows, offs_n, omask, H, dtype, data_ptrs, flag_ptrs, tag_ptr, rank, cap,
                                 cap_tiles, pid_n, publish, WORLD)
            else:
                tl.store(out_ptr + rows[:, None] * stride_out + offs_n[None, :], to_act(acc, dtype), mask=omask)
