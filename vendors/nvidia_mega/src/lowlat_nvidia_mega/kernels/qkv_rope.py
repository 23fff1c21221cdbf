"""Fused attention input: RMSNorm -> QKV GEMM -> (Qwen3) q/k RMSNorm -> RoPE -> KV-cache write, one kernel.

    h = rmsnorm(x) * w_in                              (prologue, HF order; see small_gemm.py)
    [q | k | v] = h @ Wqkv^T                           (Wqkv rows: Hq q heads, Hkv k heads, Hkv v heads, D each)
    q, k = rmsnorm_head(q) * q_norm, ... * k_norm     (Qwen3 only, per head over D)
    q, k = q * cos + rotate_half(q) * sin              (RoPE, neox / HF ``rotate_half`` style)
    q -> q_out[t, head];  k, v -> k_buffer / v_buffer[out_cache_loc[t], kv_head]

One program owns one head (D output columns), computed as two half-head accumulators (columns [0, D/2) and
[D/2, D)), so ``rotate_half`` is a swap of the two halves and the per-head norm is a reduction over both:
no cross-lane shuffles. Split-K over H (when heads alone give too few programs) uses the deterministic
last-arriver reduction of ``small_gemm.py``; the epilogue (norm, RoPE, stores) runs in that last program.

At one row without q/k norm (Llama) the one-row loop can take the row-pair form instead: a program owns rows ``j``
and ``j + D/2`` of one head for a few ``j`` (``rotate_half`` pairs exactly those rows, so RoPE stays inside the
program), reads all of H, and needs no split-K, partials or ticket: the one-row GEMV's shape (``gemv.py``) with
RoPE and the KV write as its epilogue. A per-head q/k norm needs the whole head, so for Qwen3 the form stores q
and k raw (``qk_late``) and the attention kernel finishes them (``kernels/qk_late.py``).

RoPE rounds like the general path (``lowlat.layers.rotary``): cos/sin cast to the model dtype, each product and the
sum rounded to it (no-ops for fp32 models).
PDL: the first ``PRE_K`` columns of both half-head weight tiles, and the epilogue's inputs that no kernel of the
step writes (out_cache_loc, positions, their cos/sin rows, the q/k norm weights), are loaded before ``gdc_wait``;
nothing is written before it (see pdl.py).
Activation prefetch (``PREFETCH_ACT``, off by default): as in ``small_gemm.py``, the K loop loads the next raw x
and input-norm chunks one iteration ahead; bit-identical results.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from lowlat.plugin import rope_tables

from lowlat_nvidia_mega.kernels.gemm_plans import MAX_ROWS, GemmPlan, default_block_k, grow_split, make_plan
from lowlat_nvidia_mega.kernels.gemv import one_row_rstd, one_row_x
from lowlat_nvidia_mega.kernels.pdl import gdc_launch_dependents, gdc_wait, launch_kwargs, pdl_enabled
from lowlat_nvidia_mega.kernels.qk_late import check_row1_rows
from lowlat_nvidia_mega.kernels.rounding import rnd, to_act
from lowlat_nvidia_mega.kernels.small_gemm import (
    BLOCK_M,
    dot_acc,
    dot_in_f32,
    load_rows,
    load_tile,
    load_x_nw,
    prefetch_act_enabled,
    prefetched_rows,
    row_rstd,
)


@triton.jit
def _qkv_epilogue_inputs(
    head, offs_m, m_mask, offs_h, pos_ptr, loc_ptr, cos_ptr, sin_ptr, max_pos, qn_ptr, kn_ptr,
    HQ: tl.constexpr, HALF: tl.constexpr,
):
    """(loc, cos, sin, w_lo, w_hi) of this head's epilogue: batch metadata, RoPE rows and q/k norm weights. Nothing
    in the step writes them, so they are loaded before ``gdc_wait`` and their dependent loads (position, then the
    table row) leave the critical path."""
    loc = tl.load(loc_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    pos = tl.load(pos_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    pos = tl.minimum(tl.maximum(pos, 0), max_pos - 1)  # memory safety; the engine keeps pos < max_pos
    cs = tl.load(cos_ptr + pos[:, None] * HALF + offs_h[None, :])
    sn = tl.load(sin_ptr + pos[:, None] * HALF + offs_h[None, :])
    if head < HQ:
        nw_ptr = qn_ptr
    else:
        nw_ptr = kn_ptr
    w_lo = tl.load(nw_ptr + offs_h).to(tl.float32)
    w_hi = tl.load(nw_ptr + HALF + offs_h).to(tl.float32)
    return loc, cs, sn, w_lo, w_hi


@triton.jit
def _qkv_epilogue(
    lo, hi, head, offs_m, m_mask, offs_h, loc, cos, sin, w_lo, w_hi,
    q_ptr, stride_qt, k_ptr, v_ptr, stride_ks, eps,
    HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, HAS_QK_NORM: tl.constexpr, QK_LATE: tl.constexpr,
):
    dt = q_ptr.dtype.element_ty
    lo = rnd(lo, dt)  # the projection's output is rounded, as in the unfused path
    hi = rnd(hi, dt)
    mask = m_mask[:, None]
    if head < HQ + HKV:
        if QK_LATE:  # stored raw: the attention kernel finishes q and k (kernels/qk_late.py)
            out_lo = to_act(lo, dt)
            out_hi = to_act(hi, dt)
        else:
            if HAS_QK_NORM:
                ss = tl.sum(lo * lo, axis=1) + tl.sum(hi * hi, axis=1)
                r = 1.0 / tl.sqrt(ss / (2 * HALF) + eps)
                lo = rnd(w_lo[None, :] * rnd(lo * r[:, None], dt), dt)
                hi = rnd(w_hi[None, :] * rnd(hi * r[:, None], dt), dt)
            # cos/sin cast to the activation dtype and every product rounded, as lowlat.layers.rotary does in torch.
            cs = rnd(cos, dt)
            sn = rnd(sin, dt)
            out_lo = to_act(rnd(lo * cs, dt) + rnd(-hi * sn, dt), dt)
            out_hi = to_act(rnd(hi * cs, dt) + rnd(lo * sn, dt), dt)
        if head < HQ:
            dst = q_ptr + offs_m[:, None] * stride_qt + head * (2 * HALF) + offs_h[None, :]
        else:
            dst = k_ptr + loc[:, None] * stride_ks + (head - HQ) * (2 * HALF) + offs_h[None, :]
        tl.store(dst, out_lo, mask=mask)
        tl.store(dst + HALF, out_hi, mask=mask)
    else:
        dst = v_ptr + loc[:, None] * stride_ks + (head - HQ - HKV) * (2 * HALF) + offs_h[None, :]
        tl.store(dst, to_act(lo, dt), mask=mask)
        tl.store(dst + HALF, to_act(hi, dt), mask=mask)


@triton.jit
def _row1_k_loop(x_ptr, nw_ptr, wl0, wh0, w_lo, w_hi, all_h, k_start, k_end, eps, NORM_K: tl.constexpr,
                 RSTD_BLOCK: tl.constexpr, PRE_K: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                 HAS_NORM: tl.constexpr):
    """One row's [1, HALF] lo and hi projections over this split's K range, products reduced per chunk (the
    FMA form of ``gemv.py``); ``wl0``/``wh0`` are the first ``PRE_K`` columns, loaded before the PDL wait."""
    if HAS_NORM:
        rstd = one_row_rstd(x_ptr, NORM_K, eps, RSTD_BLOCK)
    else:
        rstd = 1.0
    ks = k_start + tl.arange(0, PRE_K)
    xk = one_row_x(x_ptr, ks, ks < k_end, rstd, nw_ptr, HAS_NORM).to(tl.float32)[None, :]
    lo = tl.sum(wl0.to(tl.float32) * xk, 1)
    hi = tl.sum(wh0.to(tl.float32) * xk, 1)
    for k0 in range(k_start + PRE_K, k_end, BLOCK_K):
        kl = k0 + tl.arange(0, BLOCK_K)
        kl_mask = kl < k_end
        wl = load_tile(w_lo + kl[None, :], all_h, kl_mask, EVEN_K)
        wh = load_tile(w_hi + kl[None, :], all_h, kl_mask, EVEN_K)
        xl = one_row_x(x_ptr, kl, kl_mask, rstd, nw_ptr, HAS_NORM).to(tl.float32)[None, :]
        lo += tl.sum(wl.to(tl.float32) * xl, 1)
        hi += tl.sum(wh.to(tl.float32) * xl, 1)
    return lo[None, :], hi[None, :]


@triton.jit
def _qkv_rope_kernel(
    x_ptr, stride_xm, w_ptr, stride_wn, nw_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, max_pos, pos_ptr, loc_ptr,
    q_ptr, stride_qt, k_ptr, v_ptr, stride_ks, ws_ptr, cnt_ptr,
    T, K, K_PER_SPLIT, eps,
    NORM_K: tl.constexpr, RSTD_BLOCK: tl.constexpr, PRE_K: tl.constexpr,
    HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, HAS_QK_NORM: tl.constexpr,
    SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH_ACT: tl.constexpr, ROW1: tl.constexpr,
    HAS_NORM: tl.constexpr, PAIRS: tl.constexpr, QK_LATE: tl.constexpr,
):
    head = tl.program_id(0)
    if PAIRS < HALF:  # row pairs (j, j + HALF) of one head per program (one row, no q/k norm, no split-K)
        pid_k = 0
        offs_h = tl.program_id(1) * PAIRS + tl.arange(0, PAIRS)
    else:
        pid_k = tl.program_id(1)
        offs_h = tl.arange(0, HALF)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < T
    all_h = offs_h < HALF
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    ks = k_start + tl.arange(0, PRE_K)
    k_mask = ks < k_end
    w_lo = w_ptr + (head * (2 * HALF) + offs_h)[:, None] * stride_wn
    w_hi = w_lo + HALF * stride_wn
    wl0 = load_tile(w_lo + ks[None, :], all_h, k_mask, EVEN_K)  # weights: safe before the wait
    wh0 = load_tile(w_hi + ks[None, :], all_h, k_mask, EVEN_K)
    loc, cs, sn, nw_lo, nw_hi = _qkv_epilogue_inputs(head, offs_m, m_mask, offs_h, pos_ptr, loc_ptr, cos_ptr, sin_ptr,
                                                     max_pos, qn_ptr, kn_ptr, HQ, HALF)
    gdc_launch_dependents(USE_PDL)
    gdc_wait(USE_PDL)

    if ROW1:  # one row on the FMA units (see gemv.py): x as a 1-D chunk, no padded rows
        lo, hi = _row1_k_loop(x_ptr, nw_ptr, wl0, wh0, w_lo, w_hi, all_h, k_start, k_end, eps, NORM_K, RSTD_BLOCK,
                              PRE_K, BLOCK_K, EVEN_K, HAS_NORM)
    else:
        if HAS_NORM:
            rstd = row_rstd(x_ptr, stride_xm, offs_m, m_mask, NORM_K, eps, RSTD_BLOCK)
        else:  # x is already normalized (kernels/norm_rows.py)
            rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
        xk = load_rows(x_ptr, stride_xm, offs_m, m_mask, ks, k_mask, rstd, nw_ptr, HAS_NORM)
        if PREFETCH_ACT:  # the loop's first raw activation chunk and norm weights (see small_gemm.py)
            kn = k_start + PRE_K + tl.arange(0, BLOCK_K)
            x_nx, nw_nx = load_x_nw(x_ptr, stride_xm, offs_m, m_mask, kn, kn < k_end, nw_ptr)
        lo = dot_acc(xk, tl.trans(wl0), tl.zeros([BLOCK_M, HALF], dtype=tl.float32), DOT_F32)
        hi = dot_acc(xk, tl.trans(wh0), tl.zeros([BLOCK_M, HALF], dtype=tl.float32), DOT_F32)
        for k0 in range(k_start + PRE_K, k_end, BLOCK_K):
            kl = k0 + tl.arange(0, BLOCK_K)
            kl_mask = kl < k_end
            wl = load_tile(w_lo + kl[None, :], all_h, kl_mask, EVEN_K)
            wh = load_tile(w_hi + kl[None, :], all_h, kl_mask, EVEN_K)
            if PREFETCH_ACT:
                xl, x_nx, nw_nx = prefetched_rows(x_nx, nw_nx, rstd, x_ptr, stride_xm, offs_m, m_mask, kl, k_end,
                                                  nw_ptr, BLOCK_K)
            else:
                xl = load_rows(x_ptr, stride_xm, offs_m, m_mask, kl, kl_mask, rstd, nw_ptr, HAS_NORM)
            lo = dot_acc(xl, tl.trans(wl), lo, DOT_F32)
            hi = dot_acc(xl, tl.trans(wh), hi, DOT_F32)

    if SPLIT_K == 1:
        _qkv_epilogue(lo, hi, head, offs_m, m_mask, offs_h, loc, cs, sn, nw_lo, nw_hi, q_ptr, stride_qt, k_ptr,
                      v_ptr, stride_ks, eps, HQ, HKV, HALF, HAS_QK_NORM, QK_LATE)
    else:
        # Partials: ws[split, row, head * D + col] fp32; the last arriver sums them in split order.
        NCOL: tl.constexpr = (HQ + 2 * HKV) * 2 * HALF
        tile = offs_m[:, None] * NCOL + head * (2 * HALF) + offs_h[None, :]
        pmask = m_mask[:, None]
        tl.store(ws_ptr + pid_k * T * NCOL + tile, lo, mask=pmask)
        tl.store(ws_ptr + pid_k * T * NCOL + tile + HALF, hi, mask=pmask)
        tl.debug_barrier()
        ticket = tl.atomic_add(cnt_ptr + head, 1, sem="acq_rel")
        if ticket == SPLIT_K - 1:
            tl.debug_barrier()
            lo = tl.zeros([BLOCK_M, HALF], dtype=tl.float32)
            hi = tl.zeros([BLOCK_M, HALF], dtype=tl.float32)
            for s in range(0, SPLIT_K):
                lo += tl.load(ws_ptr + s * T * NCOL + tile, mask=pmask, other=0.0, cache_modifier=".cg")
                hi += tl.load(ws_ptr + s * T * NCOL + tile + HALF, mask=pmask, other=0.0, cache_modifier=".cg")
            _qkv_epilogue(lo, hi, head, offs_m, m_mask, offs_h, loc, cs, sn, nw_lo, nw_hi, q_ptr, stride_qt, k_ptr,
                          v_ptr, stride_ks, eps, HQ, HKV, HALF, HAS_QK_NORM, QK_LATE)
            tl.atomic_xchg(cnt_ptr + head, 0)


def plan_qkv(num_heads: int, num_kv_heads: int, head_dim: int, hidden: int, dtype: torch.dtype, sms: int,
             *, split_k: int | None = None, block_k: int | None = None) -> GemmPlan:
    """Tiles for the fused QKV kernel: one program per head, split-K until ~1.75 x ``sms`` programs.

    ``block_n`` of the plan is the head dim. ``split_k`` and ``block_k`` override the heuristic.
    """
    heads = num_heads + 2 * num_kv_heads
    bk = block_k or default_block_k(hidden, dtype)
    s = split_k if split_k is not None else grow_split(heads, hidden, bk, sms)
    iters = triton.cdiv(triton.cdiv(hidden, s), bk)
    return make_plan(hidden, block_n=head_dim, block_k=bk, split_k=s, num_warps=4,
                     num_stages=2 if iters <= 2 else 3, weight_rows=head_dim)


def qkv_workspace_numel(plan: GemmPlan, num_heads: int, num_kv_heads: int, head_dim: int,
                        rows: int = MAX_ROWS) -> int:
    """fp32 elements of split-K partials the fused QKV kernel needs for up to ``rows`` rows (0 without split-K), the
    one-row loop's own split included when ``plan.row1`` is set."""
    ncol = (num_heads + 2 * num_kv_heads) * head_dim
    row1 = plan.row1.split_k * ncol if plan.row1 is not None and plan.row1.split_k > 1 else 0
    return max(0 if plan.split_k == 1 else plan.split_k * rows * ncol, row1)


def qkv_rope(
    x: torch.Tensor, norm_weight: torch.Tensor | None, w_qkv: torch.Tensor, *, num_heads: int, num_kv_heads: int,
    q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
    positions: torch.Tensor, out_cache_loc: torch.Tensor, q_out: torch.Tensor, k_buffer: torch.Tensor,
    v_buffer: torch.Tensor, eps: float, plan: GemmPlan, workspace: torch.Tensor | None = None,
    counters: torch.Tensor | None = None, use_pdl: bool | None = None, prefetch_act: bool | None = None,
    qk_late: bool = False,
) -> torch.Tensor:
    """Launch the fused norm + QKV + q/k-norm + RoPE + KV-write kernel.

    Args:
        x: [T, H] residual stream (T in 1..8), unit stride along H.
        norm_weight: [H] input_layernorm weight; None: x is already normalized (``norm_rows``), no prologue.
        w_qkv: [(Hq + 2*Hkv) * D, H] contiguous; rows q heads, then k heads, then v heads.
        num_heads, num_kv_heads: Hq and Hkv.
        q_norm, k_norm: [D] Qwen3 per-head norm weights, both or neither.
        cos, sin: [max_pos, D/2] fp32 RoPE tables (``rope_cache.rope_cos_sin``).
        positions: [T] integer positions; out_cache_loc: [T] integer KV slots.
        q_out: [T, Hq * D] (or [T, Hq, D]) output, rows contiguous.
        k_buffer, v_buffer: [num_slots, Hkv, D] contiguous, the layer's KV-pool buffers; only rows
            ``out_cache_loc`` are written.
        eps: RMSNorm epsilon (shared by input norm and q/k norm, as in HF).
        plan: from ``plan_qkv``; workspace / counters as for ``small_gemm`` when ``plan.split_k > 1``. With
            ``plan.row1`` a one-row step runs the K loop on the FMA units with x as a 1-D chunk (as ``gemv.py``),
            at ``row1``'s K chunk, split-K, warps and stages (its split's workspace is checked the same way); a
            ``row1.block_n`` below the head dim takes the row-pair form (``check_row1_rows``).
        use_pdl: launch with PDL; default ``pdl_enabled(x.device)``.
        prefetch_act: load each activation chunk one K chunk ahead (bit-identical results); default
            ``small_gemm.prefetch_act_enabled()``.
        qk_late: store q and k raw, without q/k norm and RoPE, for ``paged_decode_attention(..., late=...)`` to
            finish (``qk_late.late_qk`` says when: q/k norm, the row-pair form, one row).
    Returns:
        ``q_out``.
    Raises:
        ValueError: on a shape, stride, dtype or device mismatch.
    """
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be 2-D with unit column stride, got shape {tuple(x.shape)} strides {x.stride()}")
    t, hidden = x.shape
    d = k_buffer.shape[-1]
    if not 1 <= t <= MAX_ROWS:
        raise ValueError(f"qkv_rope serves 1..{MAX_ROWS} rows, got {t}")
    if d < 2 or d & (d - 1):
        raise ValueError(f"head_dim must be a power of two, got {d}")
    if plan.block_n != d:
        raise ValueError(f"plan is for head_dim {plan.block_n}, the KV buffers have {d}; build it with plan_qkv")
    nq = (num_heads + 2 * num_kv_heads) * d
    if w_qkv.shape != (nq, hidden) or not w_qkv.is_contiguous():
        raise ValueError(f"w_qkv must be contiguous [{nq}, {hidden}], got {tuple(w_qkv.shape)}")
    for name, buf in (("k_buffer", k_buffer), ("v_buffer", v_buffer)):
        if buf.dim() != 3 or buf.shape[1:] != (num_kv_heads, d) or not buf.is_contiguous():
            raise ValueError(f"{name} must be contiguous [num_slots, {num_kv_heads}, {d}], got {tuple(buf.shape)}")
    if v_buffer.shape != k_buffer.shape:
        raise ValueError("k_buffer and v_buffer must have the same shape")
    q2 = q_out.reshape(t, -1) if q_out.is_contiguous() else q_out
    if q2.shape != (t, num_heads * d) or q2.stride(1) != 1:
        raise ValueError(f"q_out must be [{t}, {num_heads * d}] with unit column stride, got {tuple(q_out.shape)}")
    for name, tns in (("norm_weight", norm_weight), ("w_qkv", w_qkv), ("q_out", q_out), ("k_buffer", k_buffer),
                      ("v_buffer", v_buffer)):
        if tns is not None and (tns.dtype != x.dtype or tns.device != x.device):
            raise ValueError(f"{name} is {tns.dtype} on {tns.device}; x is {x.dtype} on {x.device}")
    if norm_weight is not None and norm_weight.shape != (hidden,):
        raise ValueError(f"norm_weight must be [{hidden}], got {tuple(norm_weight.shape)}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("pass both q_norm and k_norm (Qwen3) or neither (Llama)")
    for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
        if w is not None and (w.shape != (d,) or w.dtype != x.dtype or w.device != x.device or not w.is_contiguous()):
            raise ValueError(f"{name} must be a contiguous [{d}] {x.dtype} tensor on {x.device}, got {tuple(w.shape)} "
                             f"{w.dtype} on {w.device} with strides {w.stride()}")
    for name, tab in (("cos", cos), ("sin", sin)):
        if tab.shape != cos.shape or tab.dim() != 2 or tab.shape[0] < 1 or tab.shape[1] != d // 2 \
                or tab.dtype != torch.float32 or not tab.is_contiguous() or tab.device != x.device:
            raise ValueError(f"cos and sin must be contiguous fp32 [max_pos >= 1, {d // 2}] tensors of one shape on "
                             f"{x.device}; {name} is {tuple(tab.shape)} {tab.dtype} on {tab.device}")
    for name, idx in (("positions", positions), ("out_cache_loc", out_cache_loc)):
        if idx.shape != (t,) or idx.dtype not in (torch.int32, torch.int64) or idx.device != x.device \
                or not idx.is_contiguous():
            raise ValueError(f"{name} must be a contiguous int32/int64 [{t}] tensor on {x.device}, got "
                             f"{tuple(idx.shape)} {idx.dtype} with strides {idx.stride()}")
    row1 = plan.row1 is not None and t == 1
    if qk_late and not row1:
        raise ValueError(f"qk_late serves the one-row loop's row-pair form; this step has {t} rows and plan.row1 "
                         f"{plan.row1}")
    pairs = d // 2  # rotary pairs per program: a whole head unless the one-row plan asks for fewer
    if row1:  # the one-row FMA loop, with its own tiles and split (chosen by shape alone, like gemv.gemm)
        r1 = plan.row1
        pairs = check_row1_rows(r1, d, q_norm is not None, qk_late)
        plan = make_plan(hidden, block_n=d, block_k=r1.block_k, split_k=r1.split_k, num_warps=r1.num_warps,
                         num_stages=r1.num_stages, weight_rows=2 * pairs)
    if plan.split_k > 1:
        need = qkv_workspace_numel(plan, num_heads, num_kv_heads, d, rows=t)
        if workspace is None or workspace.dtype != torch.float32 or workspace.numel() < need:
            raise ValueError(f"split-K={plan.split_k} needs an fp32 workspace of >= {need} elements")
        if counters is None or counters.dtype != torch.int32 or counters.numel() < num_heads + 2 * num_kv_heads:
            raise ValueError(f"split-K needs int32 zero counters of >= {num_heads + 2 * num_kv_heads} elements")
    use_pdl = pdl_enabled(x.device) if use_pdl is None else use_pdl
    prefetch = prefetch_act_enabled() if prefetch_act is None else prefetch_act
    has_norm = norm_weight is not None
    nw = norm_weight if has_norm else w_qkv  # unread placeholders (no prologue / no q/k norm); never written
    qn = q_norm if q_norm is not None else nw
    kn = k_norm if k_norm is not None else nw
    grid = (num_heads + 2 * num_kv_heads, plan.split_k if pairs == d // 2 else d // 2 // pairs)
    _qkv_rope_kernel[grid](
        x, x.stride(0), w_qkv, w_qkv.stride(0), nw, qn, kn, cos, sin, cos.shape[0], positions,
        out_cache_loc, q2, q2.stride(0), k_buffer, v_buffer, k_buffer.stride(0),
        workspace if workspace is not None else cos, counters if counters is not None else cos,
        t, hidden, plan.k_per_split, eps,
        NORM_K=hidden, RSTD_BLOCK=min(triton.next_power_of_2(hidden), 512), PRE_K=plan.pre_k,
        HQ=num_heads, HKV=num_kv_heads, HALF=d // 2, HAS_QK_NORM=q_norm is not None, SPLIT_K=plan.split_k,
        EVEN_K=(hidden % plan.block_k == 0 and plan.k_per_split % plan.block_k == 0),
        BLOCK_M=1 if row1 else BLOCK_M, BLOCK_K=plan.block_k, DOT_F32=dot_in_f32(x.dtype), USE_PDL=use_pdl,
        PREFETCH_ACT=bool(prefetch) and not row1 and has_norm, ROW1=row1, HAS_NORM=has_norm, PAIRS=pairs,
        QK_LATE=qk_late,
        num_warps=plan.num_warps, num_stages=plan.num_stages, **launch_kwargs(use_pdl),
    )
    return q_out


def rope_cos_sin(head_dim: int, rope_theta: float, max_pos: int, rope_scaling: dict | None,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``cos, sin`` tables [max_pos, head_dim / 2] for positions 0..max_pos-1.

    Core's tables through plugin API 2 (``lowlat.plugin.rope_tables``): the first half of the general path's
    tables, bit for bit (HF's default, linear and Llama-3 rules; angles ``float(pos) * inv_freq`` in fp32).

    Raises:
        ValueError: for a rope type ``rope_inv_freq`` does not support.
    """
    return rope_tables(head_dim, rope_theta, rope_scaling, max_pos, device)
