"""Paged decode attention for 1 to 8 new query rows per request (DECODE, and VERIFY with causal masking).

Split-KV ("flash-decoding", Dao et al. 2023) in two kernels:

1. ``_attn_split_kernel``, grid (B * Hkv, NUM_SPLITS): one program per (request, KV head, KV chunk). The
   G = Hq / Hkv query heads sharing that KV head and the R new rows of the request are packed into one
   ``[G * R, D]`` query tile (row ``m = r * G + g``), so each K/V byte is read once per KV head. The chunk
   ``[s * C, (s + 1) * C)`` with ``C = ceil(ceil(L / S) / BLOCK_KV) * BLOCK_KV`` is processed with an online
   softmax (exp2, fp32 statistics); the program stores its normalized partial output and log-sum-exp.
   Query row r of a request of length L sits at position ``L - R + r`` and sees positions ``<= L - R + r``.
2. ``_attn_merge_kernel``, grid (T * Hq,): combines the splits of one (row, head) by their LSE weights and
   writes ``out[t, h * D:(h + 1) * D]`` in the model dtype.

K/V are gathered through ``req_to_token`` (one slot per position, so any page size works). The launch plan, an
``AttnPlan`` (S, BLOCK_KV, warps and stages of each kernel), comes from ``tuned_plans.attn_plan`` per shape.

PDL overlap: the page-table entries and the first K/V block of the chunk are loaded *before* ``gdc_wait``,
masked to positions ``< L - R`` (written by earlier steps, never by this step's QKV kernel); positions of
this step's new tokens are loaded after it, together with q.

Late q/k (``late=LateQK(...)``, ``kernels/qk_late.py``): q and the new K row arrive raw; every split program
finishes q as it loads it, and the program whose chunk holds the new position finishes that K row, uses it in
place of the raw one in every block, and stores it to the pool after its last block (no other program of the
step reads that slot; the merge kernel never reads K).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from lowlat_nvidia_mega.kernels.gemm_plans import MAX_ROWS
from lowlat_nvidia_mega.kernels.pdl import gdc_launch_dependents, gdc_wait, launch_kwargs, pdl_enabled
from lowlat_nvidia_mega.kernels.qk_late import LateQK, late_args, norm_rope_rows
from lowlat_nvidia_mega.kernels.rounding import to_act
from lowlat_nvidia_mega.kernels.small_gemm import dot_acc, dot_in_f32

LOG2E = 1.4426950408889634
MAX_SPLITS = 64


@triton.jit
def _attn_block(q, k, v, pos, kv_end, q_pos, m_i, l_i, acc, scale_log2, DOT_F32: tl.constexpr):
    s = dot_acc(q, tl.trans(k), tl.zeros([q.shape[0], k.shape[0]], dtype=tl.float32), DOT_F32) * scale_log2
    ok = (pos[None, :] <= q_pos[:, None]) & (pos < kv_end)[None, :]
    s = tl.where(ok, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = dot_acc(to_act(p, v.dtype), v, acc * alpha[:, None], DOT_F32)
    return m_new, l_i, acc


@triton.jit
def _attn_split_kernel(
    q_ptr, stride_qt, k_ptr, v_ptr, stride_ks, rtt_ptr, stride_rtt, rpi_ptr, seqlen_ptr, op_ptr, lse_ptr,
    scale_log2, qn_ptr, kn_ptr, cos_ptr, sin_ptr, pos_ptr, max_pos, eps,
    HKV: tl.constexpr, G: tl.constexpr, R: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_KV: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_F32: tl.constexpr, USE_PDL: tl.constexpr,
    LATE: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // HKV
    kvh = pid % HKV
    # Batch metadata is written before the step starts: safe to read before the wait.
    seq_len = tl.load(seqlen_ptr + b).to(tl.int32)
    req = tl.load(rpi_ptr + b).to(tl.int64)
    prefix = seq_len - R
    chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_KV) * BLOCK_KV
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)
    offs_d = tl.arange(0, D)
    offs_kv = tl.arange(0, BLOCK_KV)
    rtt_row = rtt_ptr + req * stride_rtt
    kv_col = kvh * D + offs_d[None, :]

    pos = start + offs_kv
    in_rng = pos < end
    old = in_rng & (pos < prefix)
    slot = tl.load(rtt_row + pos, mask=in_rng, other=0).to(tl.int64)
    k = tl.load(k_ptr + slot[:, None] * stride_ks + kv_col, mask=old[:, None], other=0.0)
    v = tl.load(v_ptr + slot[:, None] * stride_ks + kv_col, mask=old[:, None], other=0.0)
    if LATE:  # one row per request (R == 1): its RoPE position, and where its new K row lies
        row_pos = tl.load(pos_ptr + b)
        new_slot = tl.load(rtt_row + prefix, mask=prefix >= 0, other=0).to(tl.int64)  # an empty request reads none
    gdc_launch_dependents(USE_PDL)
    gdc_wait(USE_PDL)
    new = in_rng & (pos >= prefix)
    k = tl.where(new[:, None], tl.load(k_ptr + slot[:, None] * stride_ks + kv_col, mask=new[:, None], other=0.0), k)
    v = tl.where(new[:, None], tl.load(v_ptr + slot[:, None] * stride_ks + kv_col, mask=new[:, None], other=0.0), v)

    offs_m = tl.arange(0, BLOCK_M)
    r = offs_m // G
    m_valid = offs_m < G * R
    q_rows = (b * R + r).to(tl.int64) * stride_qt + (kvh * G + offs_m % G) * D
    if LATE:  # q and k left raw by qkv_rope (kernels/qk_late.py): finish q here, and the new K row in its owner
        q = norm_rope_rows(q_ptr + q_rows, m_valid, row_pos + offs_m * 0, qn_ptr, cos_ptr, sin_ptr, max_pos, eps, D,
                           q_ptr.dtype.element_ty)
        one = tl.arange(0, 1)
        k_row = k_ptr + new_slot * stride_ks + kvh * D + one  # the new position's K row
        owner = (start <= prefix) & (prefix < end)  # this program's chunk holds the new position
        k_new = tl.zeros([1, D], dtype=k_ptr.dtype.element_ty)
        if owner:
            k_new = norm_rope_rows(k_row, one < 1, row_pos + one, kn_ptr, cos_ptr, sin_ptr, max_pos, eps, D,
                                   k_ptr.dtype.element_ty)
        k = tl.where(((pos == prefix) & in_rng)[:, None], k_new, k)
    else:
        q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=m_valid[:, None], other=0.0)
    q_pos = prefix + r

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    m_i, l_i, acc = _attn_block(q, k, v, pos, end, q_pos, m_i, l_i, acc, scale_log2, DOT_F32)
    for blk in range(start + BLOCK_KV, end, BLOCK_KV):
        pos = blk + offs_kv
        in_rng = pos < end
        slot = tl.load(rtt_row + pos, mask=in_rng, other=0).to(tl.int64)
        k = tl.load(k_ptr + slot[:, None] * stride_ks + kv_col, mask=in_rng[:, None], other=0.0)
        v = tl.load(v_ptr + slot[:, None] * stride_ks + kv_col, mask=in_rng[:, None], other=0.0)
        if LATE:
            k = tl.where(((pos == prefix) & in_rng)[:, None], k_new, k)
        m_i, l_i, acc = _attn_block(q, k, v, pos, end, q_pos, m_i, l_i, acc, scale_log2, DOT_F32)

    if LATE:  # the pool keeps the finished row for later steps; stored last, so every block above used k_new itself
        if owner:
            tl.store(k_row[:, None] + offs_d[None, :], k_new)
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    base = pid * NUM_SPLITS + split
    tl.store(op_ptr + (base * BLOCK_M + offs_m)[:, None] * D + offs_d[None, :], out, mask=m_valid[:, None])
    tl.store(lse_ptr + base * BLOCK_M + offs_m, lse, mask=m_valid)


@triton.jit
def _attn_merge_kernel(
    op_ptr, lse_ptr, seqlen_ptr, out_ptr, stride_ot,
    HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, R: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_KV: tl.constexpr, NUM_SPLITS: tl.constexpr, USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    t = pid // HQ
    h = pid % HQ
    b = t // R
    m = (t % R) * G + h % G
    base = (b * HKV + h // G) * NUM_SPLITS
    seq_len = tl.load(seqlen_ptr + b).to(tl.int32)
    chunk = tl.maximum(tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_KV) * BLOCK_KV, 1)
    used = tl.cdiv(seq_len, chunk)  # splits that saw at least one position
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, D)
    s_mask = offs_s < used
    gdc_launch_dependents(USE_PDL)
    gdc_wait(USE_PDL)
    lse = tl.load(lse_ptr + (base + offs_s) * BLOCK_M + m, mask=s_mask, other=float("-inf"))
    mx = tl.max(lse, axis=0)
    wgt = tl.exp2(lse - tl.where(mx == float("-inf"), 0.0, mx))
    part = tl.load(op_ptr + ((base + offs_s) * BLOCK_M + m)[:, None] * D + offs_d[None, :], mask=s_mask[:, None],
                   other=0.0)
    tot = tl.sum(wgt, axis=0)
    o = tl.sum(wgt[:, None] * part, axis=0) / tl.where(tot > 0, tot, 1.0)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + h * D + offs_d, to_act(o, out_ptr.dtype.element_ty))


def attention_block_m(num_heads: int, num_kv_heads: int, rows_per_req: int) -> int:
    """Rows of the packed query tile: next power of two >= G * R, at least 16 (the ``tl.dot`` minimum)."""
    return max(16, triton.next_power_of_2((num_heads // num_kv_heads) * rows_per_req))


def attention_block_kv(head_dim: int) -> int:
    """The heuristic's KV positions per block: 64 (a [64, D] K tile is 8 to 16 KB in bf16)."""
    return 64


@dataclasses.dataclass(frozen=True)
class AttnPlan:
    """Launch plan of ``paged_decode_attention`` for one shape (chosen at build from shapes alone, never autotuned
    at capture: ``tuned_plans.attn_plan``).

    Fields (all ints):
        num_splits: KV splits per (request, KV head), a power of two in 1..``MAX_SPLITS``: the split kernel's
            second grid axis and the merge kernel's reduction width.
        block_kv: KV positions per block of the split kernel's loop, a power of two >= 16 (a ``tl.dot`` side);
            both kernels derive the chunk ``ceil(ceil(L / S) / block_kv) * block_kv`` from it.
        split_warps: warps per split program, a power of two in 1..32.
        split_stages: software-pipelining stages of the split kernel's KV loop, >= 1.
        merge_warps: warps per merge program, a power of two in 1..32.
    Raises:
        ValueError: naming the field, for a non-integer or out-of-range value.
    """

    num_splits: int
    block_kv: int = 64
    split_warps: int = 4
    split_stages: int = 2
    merge_warps: int = 4

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"AttnPlan.{f.name}={v!r} must be an integer")
        for name, lo, hi in (("num_splits", 1, MAX_SPLITS), ("block_kv", 16, None), ("split_warps", 1, 32),
                             ("merge_warps", 1, 32)):
            v = getattr(self, name)
            if v < lo or (hi is not None and v > hi) or v & (v - 1):
                rng = f">= {lo}" if hi is None else f"in {lo}..{hi}"
                raise ValueError(f"AttnPlan.{name}={v} must be a power of two {rng}")
        if self.split_stages < 1:
            raise ValueError(f"AttnPlan.split_stages={self.split_stages} must be >= 1")


def split_cap(max_context_len: int, block_kv: int) -> int:
    """Most useful splits: one ``block_kv`` block of ``max_context_len`` per split, as a power of two <= MAX_SPLITS
    (more splits than blocks only add empty programs)."""
    return max(1, min(MAX_SPLITS, triton.next_power_of_2(triton.cdiv(max_context_len, block_kv))))


def plan_splits(batch_size: int, num_kv_heads: int, max_context_len: int, head_dim: int, sms: int) -> int:
    """KV splits per (request, KV head): a power of two giving ~2 x ``sms`` programs, at most ``MAX_SPLITS`` and
    at most one block of ``max_context_len`` per split."""
    want = triton.cdiv(2 * sms, batch_size * num_kv_heads)
    return max(1, min(triton.next_power_of_2(want), split_cap(max_context_len, attention_block_kv(head_dim))))


def default_merge_warps(num_splits: int, head_dim: int) -> int:
    """The heuristic's merge warps: 4, or 8 when the merged tile (splits x D) exceeds 4096 elements."""
    return 4 if num_splits * head_dim <= 4096 else 8


def default_attn_plan(batch_size: int, rows_per_req: int, num_heads: int, num_kv_heads: int, head_dim: int,
                      max_context_len: int, sms: int) -> AttnPlan:
    """The heuristic plan: ``plan_splits`` splits, ``attention_block_kv`` positions per block, 4 split warps (8 when
    the query tile holds more than 4096 elements), 2 stages, 4 merge warps (8 when splits x D > 4096)."""
    splits = plan_splits(batch_size, num_kv_heads, max_context_len, head_dim, sms)
    tile = attention_block_m(num_heads, num_kv_heads, rows_per_req) * head_dim
    return AttnPlan(num_splits=splits, block_kv=attention_block_kv(head_dim), split_warps=4 if tile <= 4096 else 8,
                    split_stages=2, merge_warps=default_merge_warps(splits, head_dim))


def partial_numel(batch_size: int, num_heads: int, num_kv_heads: int, head_dim: int, rows_per_req: int,
                  plan: AttnPlan) -> tuple[int, int]:
    """fp32 elements of (partial outputs, partial LSEs) one launch with ``plan`` needs (its splits decide)."""
    n = batch_size * num_kv_heads * plan.num_splits * attention_block_m(num_heads, num_kv_heads, rows_per_req)
    return n * head_dim, n


def paged_decode_attention(
    q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor, *, rows_per_req: int,
    sm_scale: float, plan: AttnPlan, o_partial: torch.Tensor, lse_partial: torch.Tensor,
    use_pdl: bool | None = None, late: LateQK | None = None,
) -> torch.Tensor:
    """Attention of T = B * R new query rows over each request's cached K/V (new rows included).

    Args:
        q: [T, Hq, D] or [T, Hq * D], rows contiguous; requests' rows consecutive (row t = b * R + r).
        k_buffer, v_buffer: [num_slots, Hkv, D] contiguous, the layer's KV-pool buffers (already holding
            this step's K/V at the new positions).
        req_to_token: [max_reqs, max_context_len] int32 slot map; req_pool_indices: [B]; seq_lens: [B]
            lengths *after* the step (integer dtypes).
        out: [T, Hq * D] output in q's dtype, unit column stride.
        rows_per_req: R, 1 (DECODE) to 8 (VERIFY).
        sm_scale: softmax scale, usually D ** -0.5.
        plan: the launch plan (``tuned_plans.attn_plan``: splits, KV block, warps, stages); any valid plan gives
            the same result up to rounding (the chunks of the online softmax differ).
        o_partial, lse_partial: fp32 workspaces of >= ``partial_numel(..., plan)`` elements.
        late: q and the new K rows are raw (qkv_rope's row-pair form for a model with q/k norm,
            ``qk_late.late_qk``): their q/k norm and RoPE are applied here, and each new K row is written back
            finished (one row per request only).
    Returns:
        ``out``.
    Raises:
        ValueError: on a shape, stride, dtype or device mismatch, or a ``plan`` that is not an AttnPlan.
    """
    num_slots, hkv, d = k_buffer.shape if k_buffer.dim() == 3 else (0, 0, 0)
    if k_buffer.dim() != 3 or v_buffer.shape != k_buffer.shape or not (k_buffer.is_contiguous()
                                                                       and v_buffer.is_contiguous()):
        raise ValueError(f"k_buffer and v_buffer must be contiguous [num_slots, Hkv, D], got {tuple(k_buffer.shape)} "
                         f"and {tuple(v_buffer.shape)}")
    t = q.shape[0]
    q2 = q.reshape(t, -1)
    if q2.stride(1) != 1 or q2.shape[1] % d:
        raise ValueError(f"q must be [T, Hq * {d}] with unit column stride, got {tuple(q.shape)}")
    hq = q2.shape[1] // d
    b = seq_lens.shape[0]
    r = rows_per_req
    if hq % hkv:
        raise ValueError(f"query heads {hq} are not a multiple of KV heads {hkv}")
    if not 1 <= r <= MAX_ROWS or b * r != t:
        raise ValueError(f"T={t} rows must be batch {b} x rows_per_req {r} with 1 <= R <= {MAX_ROWS}")
    if d & (d - 1) or d < 16:
        raise ValueError(f"head_dim must be a power of two >= 16, got {d}")
    if not isinstance(plan, AttnPlan):
        raise ValueError(f"plan must be an AttnPlan, got {type(plan).__name__}")
    if out.shape != (t, hq * d) or out.stride(1) != 1 or out.dtype != q.dtype:
        raise ValueError(f"out must be [{t}, {hq * d}] {q.dtype} with unit column stride, got {tuple(out.shape)} "
                         f"{out.dtype}")
    for name, tns in (("k_buffer", k_buffer), ("v_buffer", v_buffer), ("out", out)):
        if tns.dtype != q.dtype or tns.device != q.device:
            raise ValueError(f"{name} is {tns.dtype} on {tns.device}; q is {q.dtype} on {q.device}")
    if req_to_token.dim() != 2 or req_to_token.stride(1) != 1 or req_to_token.dtype not in (torch.int32, torch.int64):
        raise ValueError("req_to_token must be a 2-D int32/int64 tensor with unit column stride")
    if req_pool_indices.shape != (b,) or req_pool_indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"req_pool_indices must be an integer [{b}] tensor")
    if seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError("seq_lens must be an integer tensor")
    n_o, n_l = partial_numel(b, hq, hkv, d, r, plan)
    if o_partial.dtype != torch.float32 or o_partial.numel() < n_o or lse_partial.dtype != torch.float32 \
            or lse_partial.numel() < n_l:
        raise ValueError(f"o_partial / lse_partial must be fp32 with >= {n_o} / {n_l} elements")
    if late is not None:
        if r != 1:
            raise ValueError(f"late q/k serves one row per request, got rows_per_req {r}")
        late.check(t, d, q.dtype, q.device)
    use_pdl = pdl_enabled(q.device) if use_pdl is None else use_pdl
    g = hq // hkv
    block_m = attention_block_m(hq, hkv, r)
    splits, block_kv = plan.num_splits, plan.block_kv  # the merge kernel's `used` needs the split kernel's chunk
    _attn_split_kernel[(b * hkv, splits)](
        q2, q2.stride(0), k_buffer, v_buffer, k_buffer.stride(0), req_to_token, req_to_token.stride(0),
        req_pool_indices, seq_lens, o_partial, lse_partial, sm_scale * LOG2E, **late_args(late, seq_lens),
        HKV=hkv, G=g, R=r, D=d, BLOCK_M=block_m, BLOCK_KV=block_kv, NUM_SPLITS=splits,
        DOT_F32=dot_in_f32(q.dtype), USE_PDL=use_pdl, LATE=late is not None, num_warps=plan.split_warps,
        num_stages=plan.split_stages,
        **launch_kwargs(use_pdl),
    )
    _attn_merge_kernel[(t * hq,)](
        o_partial, lse_partial, seq_lens, out, out.stride(0),
        HQ=hq, HKV=hkv, G=g, R=r, D=d, BLOCK_M=block_m, BLOCK_KV=block_kv, NUM_SPLITS=splits,
        USE_PDL=use_pdl, num_warps=plan.merge_warps, **launch_kwargs(use_pdl),
    )
    return out
