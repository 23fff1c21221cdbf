"""Paged decode attention (DECODE and VERIFY steps): a flash-decoding split-K Triton kernel.

Each request ``b`` adds ``n = tokens_per_req`` new tokens whose K/V are already in the KV pool; new token
``j`` (0-based) attends to the request's positions ``p < seq_lens[b] - n + j + 1`` (causal among the new
tokens; for DECODE, n = 1, that is every cached position). Position ``p`` of request ``b`` lives at slot
``req_to_token[req_pool_indices[b], p]`` of ``k_buffer`` / ``v_buffer``.

Design (flash-decoding, Dao et al. 2023, "Flash-Decoding for long-context inference"; the same two-stage
layout as SGLang's ``decode_attention.py`` / ``extend_attention.py`` Triton kernels):

* Stage 1, grid ``(B * M_BLOCKS, Hkv, S)``: a program owns one (request, KV head, split of the context) and
  every query row that reads that KV head: the GQA group's ``Hq / Hkv`` heads times the ``n`` new tokens,
  packed into one ``BLOCK_M`` tile (rows padded to 16 and head_dim to a power of two >= 16, so ``tl.dot``
  always applies), so each K/V tile is read once per KV head (groups x tokens above 64 rows use more tiles).
  It runs the online softmax (Milakov & Gimelshein 2018) in float32 over its live range only and writes the
  normalized partial output and its log-sum-exp (base 2).
* Stage 2, grid ``(T, Hq)``: merges the live splits of each row with log-sum-exp weights.

The grid depends only on shapes (CUDA-graph capturable, no host sync). The split length is computed in the
kernel from the real ``seq_lens[b]`` (``ceil(seq_len / S)`` rounded up to ``BLOCK_N``), so programs whose
split starts past the context exit at once and the cost follows the real length, not ``max_len``.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

__all__ = ["decode_attention", "decode_attention_reference", "default_num_kv_splits"]

_LOG2E = 1.4426950408889634
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MAX_BLOCK_M = 64  # query rows per stage-1 tile; larger GQA groups x tokens use several M blocks
_MAX_SPLITS = 64
_MIN_TOKENS_PER_SPLIT = 128
_INTERPRETER_SPLITS = 4


@triton.jit
def _dot(a, b, F32_OPERANDS: tl.constexpr):
    """a @ b in float32. F32_OPERANDS upcasts first: Triton 3.9's interpreter multiplies bf16 operands of
    tl.dot as raw uint16 bits, so the launcher sets it for bf16 under TRITON_INTERPRET=1 only."""
    if F32_OPERANDS:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    # "ieee": exact fp32 products for fp32 operands (not TF32); ignored for 16-bit operands.
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _decode_attn_stage1_kernel(
    q_ptr, k_ptr, v_ptr, r2t_ptr, pool_idx_ptr, seq_lens_ptr, mid_o_ptr, mid_lse_ptr,
    qk_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_r2t,
    stride_mot, stride_moh, stride_mos, stride_mlt, stride_mlh,
    HEAD_DIM: tl.constexpr, N_NEW: tl.constexpr, GROUP: tl.constexpr, NUM_SPLITS: tl.constexpr,
    M_BLOCKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    F32_OPERANDS: tl.constexpr,
):
    b = tl.program_id(0) // M_BLOCKS
    m_blk = tl.program_id(0) % M_BLOCKS
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    split_len = tl.maximum(split_len, BLOCK_N)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    if start >= end:
        return

    # Tile row r = g * N_NEW + j: query head kv_head * GROUP + g, new token j of request b.
    rows = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP * N_NEW
    g = rows // N_NEW
    j = rows % N_NEW
    tok = b * N_NEW + j
    head = kv_head * GROUP + g
    limit = seq_len - N_NEW + j + 1  # row attends to positions < limit
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    q_off = tok[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    r2t_row = r2t_ptr + tl.load(pool_idx_ptr + b).to(tl.int64) * stride_r2t
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        slots = tl.load(r2t_row + offs_n, mask=n_ok, other=0).to(tl.int64)
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + slots[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + slots[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        qk = _dot(q, tl.trans(k), F32_OPERANDS) * qk_scale
        visible = (offs_n[None, :] < limit[:, None]) & n_ok[None, :]
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, F32_OPERANDS)
        m_i = m_new

    # A row may see nothing in this split (VERIFY rows whose limit falls before it): l = 0, lse = -inf.
    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    mo_off = tok[:, None].to(tl.int64) * stride_mot + head[:, None] * stride_moh + split * stride_mos + offs_d[None, :]
    tl.store(mid_o_ptr + mo_off, out, mask=row_ok[:, None] & d_ok[None, :])
    tl.store(mid_lse_ptr + tok.to(tl.int64) * stride_mlt + head * stride_mlh + split, lse, mask=row_ok)


@triton.jit
def _decode_attn_stage2_kernel(
    mid_o_ptr, mid_lse_ptr, seq_lens_ptr, o_ptr,
    stride_mot, stride_moh, stride_mos, stride_mlt, stride_mlh, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, N_NEW: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + tok // N_NEW).to(tl.int32)
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    split_len = tl.maximum(split_len, BLOCK_N)
    num_live = tl.cdiv(seq_len, split_len)  # same split boundaries as stage 1

    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    mo_row = mid_o_ptr + tok.to(tl.int64) * stride_mot + head * stride_moh
    ml_row = mid_lse_ptr + tok.to(tl.int64) * stride_mlt + head * stride_mlh
    m = tl.full([], -1.0e30, dtype=tl.float32)
    denom = tl.zeros([], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s in range(num_live):
        lse = tl.load(ml_row + s)
        part = tl.load(mo_row + s * stride_mos + offs_d, mask=d_ok, other=0.0)
        m_new = tl.maximum(m, lse)
        scale = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)
        acc = acc * scale + w * part
        denom = denom * scale + w
        m = m_new
    out = acc / tl.where(denom > 0.0, denom, 1.0)
    o_row = o_ptr + tok.to(tl.int64) * stride_ot + head * stride_oh
    tl.store(o_row + offs_d, out.to(o_ptr.dtype.element_ty), mask=d_ok)


def _interpreting() -> bool:
    """True when this module's kernels were built by Triton's interpreter (TRITON_INTERPRET=1 at import)."""
    return not isinstance(_decode_attn_stage1_kernel, triton.runtime.JITFunction)


def _check_cpu_launch() -> None:
    """CPU tensors need the interpreter, both for these kernels and for triton.language's own jit helpers
    (tl.max, tl.sum, tl.cdiv), which Triton decorates when ``triton`` is first imported."""
    if not _interpreting():
        raise ValueError("decode_attention got CPU tensors but Triton is not in interpreter mode; use "
                         "decode_attention_reference on CPU, or set TRITON_INTERPRET=1 before importing triton")
    if isinstance(tl.max, triton.runtime.JITFunction):
        raise ValueError("TRITON_INTERPRET=1 was set after triton was first imported, so triton.language's jit "
                         "helpers are compiled-mode objects that the interpreter cannot call; set it before the "
                         "first `import triton` (for pytest: at the top of conftest.py)")


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_num_kv_splits(batch_size: int, num_kv_heads: int, max_len: int, m_blocks: int,
                          device: torch.device) -> int:
    """The number of KV splits S when the caller gives none; depends only on static shapes.

    CUDA: aim for about two programs per SM in stage 1 (latency hiding for the gathered K/V loads):
    ``S = ceil(2 * num_SMs / (B * Hkv * m_blocks))``, capped so a split of the longest possible context
    (``max_len`` = ``req_to_token.shape[1]``) keeps at least 128 tokens, and at most 64. Shorter real
    contexts use fewer live splits by themselves (the split length is rounded up to BLOCK_N in the kernel).
    Interpreter / CPU: ``min(4, ceil(max_len / 32))``, small but enough to exercise the merge.
    """
    if device.type != "cuda":
        return max(1, min(_INTERPRETER_SPLITS, math.ceil(max_len / 32)))
    index = device.index if device.index is not None else torch.cuda.current_device()
    programs = max(1, batch_size * num_kv_heads * m_blocks)
    want = math.ceil(2 * _sm_count(index) / programs)
    cap = max(1, min(_MAX_SPLITS, math.ceil(max_len / _MIN_TOKENS_PER_SPLIT)))
    return max(1, min(want, cap))


def _check_inputs(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, tokens_per_req, out) -> None:
    """Shape, dtype, stride and device checks shared by the kernel launcher and the reference."""
    tensors = {"q": q, "k_buffer": k_buffer, "v_buffer": v_buffer, "req_to_token": req_to_token,
               "req_pool_indices": req_pool_indices, "seq_lens": seq_lens}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 3 or k_buffer.dim() != 3:
        raise ValueError(f"q must be [T, Hq, D] and k_buffer [num_slots, Hkv, D]; got q {tuple(q.shape)}, "
                         f"k_buffer {tuple(k_buffer.shape)}")
    if v_buffer.shape != k_buffer.shape:
        raise ValueError(f"v_buffer shape {tuple(v_buffer.shape)} must equal k_buffer shape {tuple(k_buffer.shape)}")
    if q.shape[2] != k_buffer.shape[2]:
        raise ValueError(f"head_dim differs: q has {q.shape[2]}, k_buffer has {k_buffer.shape[2]}")
    hq, hkv = q.shape[1], k_buffer.shape[1]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a positive multiple of KV heads ({hkv}) for GQA")
    if q.dtype not in _DTYPES or k_buffer.dtype != q.dtype or v_buffer.dtype != q.dtype:
        raise ValueError(f"q, k_buffer and v_buffer must share one dtype among bf16/fp16/fp32; got "
                         f"{q.dtype}, {k_buffer.dtype}, {v_buffer.dtype}")
    if req_to_token.dim() != 2 or req_to_token.dtype != torch.int32:
        raise ValueError(f"req_to_token must be a 2-D int32 [max_reqs, max_len] tensor; got "
                         f"{req_to_token.dtype} {tuple(req_to_token.shape)}")
    if req_pool_indices.dim() != 1 or req_pool_indices.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"req_pool_indices must be a 1-D int64 [B] tensor; got "
                         f"{req_pool_indices.dtype} {tuple(req_pool_indices.shape)}")
    if seq_lens.dim() != 1 or seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"seq_lens must be a 1-D int32 [B] tensor; got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    if seq_lens.shape[0] != req_pool_indices.shape[0]:
        raise ValueError(f"seq_lens has {seq_lens.shape[0]} requests but req_pool_indices has "
                         f"{req_pool_indices.shape[0]}")
    if isinstance(tokens_per_req, bool) or not isinstance(tokens_per_req, int) or tokens_per_req < 1:
        raise ValueError(f"tokens_per_req must be an int >= 1, got {tokens_per_req!r}")
    if q.shape[0] != seq_lens.shape[0] * tokens_per_req:
        raise ValueError(f"q has T={q.shape[0]} rows but B * tokens_per_req = {seq_lens.shape[0]} * "
                         f"{tokens_per_req} = {seq_lens.shape[0] * tokens_per_req}")
    for name in ("q", "k_buffer", "v_buffer", "req_to_token"):
        t = tensors[name]
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension (stride {t.stride(-1)}); "
                             f"pass {name}.contiguous()")
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.shape != q.shape or out.dtype != q.dtype:
            raise ValueError(f"out must be a {q.dtype} tensor of q's shape {tuple(q.shape)}; got "
                             f"{getattr(out, 'dtype', type(out).__name__)} {tuple(getattr(out, 'shape', ()))}")
        if out.shape[-1] > 1 and out.stride(-1) != 1:
            raise ValueError(f"out must be contiguous in its last dimension (stride {out.stride(-1)})")
        tensors["out"] = out
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(str(d) for d in devices)}")


def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    tokens_per_req: int,
    sm_scale: float,
    num_kv_splits: int | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Paged attention of the new tokens of a DECODE / VERIFY step over their requests' KV cache.

    Args:
        q: [T, Hq, D] bf16/fp16/fp32, T = B * tokens_per_req, requests in order, each request's new tokens
            contiguous. Rows and heads may be strided; the last dim must be contiguous.
        k_buffer, v_buffer: [num_slots, Hkv, D], same dtype as q; Hq must be a multiple of Hkv (GQA: query
            head h reads KV head h // (Hq / Hkv)). The new tokens' K/V must already be written.
        req_to_token: [max_reqs, max_len] int32 slot of each request position.
        req_pool_indices: [B] int64 row of each request in ``req_to_token``.
        seq_lens: [B] int32 context length after this step (cached prefix + new tokens); the caller
            guarantees ``tokens_per_req <= seq_lens[b] <= max_len`` (not checked: that would need a host
            sync). A request with ``seq_lens[b] == 0`` yields zeros.
        tokens_per_req: n, new tokens per request (1 for DECODE, k+1 for VERIFY).
        sm_scale: softmax scale applied to q.k (usually D ** -0.5).
        num_kv_splits: split-K factor S of stage 1; None picks ``default_num_kv_splits``.
        out: optional [T, Hq, D] tensor in q's dtype to write into (a static buffer for CUDA graphs).

    Returns:
        ``out`` (or a new [T, Hq, D] tensor) in q's dtype: ``softmax(q.k * sm_scale, masked) @ v`` per row,
        new token j of request b seeing positions ``< seq_lens[b] - n + j + 1``.

    Raises:
        ValueError: bad shapes, dtypes, strides, devices, ``T != B * tokens_per_req``, ``num_kv_splits < 1``,
            a bad ``out``, or CPU tensors without ``TRITON_INTERPRET=1`` set before triton's first import
            (use ``decode_attention_reference`` on CPU).
    """
    _check_inputs(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, tokens_per_req, out)
    if q.device.type == "cpu":
        _check_cpu_launch()
    num_tokens, hq, head_dim = q.shape
    hkv = k_buffer.shape[1]
    batch = seq_lens.shape[0]
    n = tokens_per_req
    group = hq // hkv
    if out is None:
        out = torch.empty((num_tokens, hq, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or head_dim == 0:
        return out

    rows = group * n
    block_m = max(16, min(_MAX_BLOCK_M, triton.next_power_of_2(rows)))
    m_blocks = triton.cdiv(rows, block_m)
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_n = 64 if block_d <= 128 and not _interpreting() else 32
    if num_kv_splits is None:
        num_kv_splits = default_num_kv_splits(batch, hkv, req_to_token.shape[1], m_blocks, q.device)
    if isinstance(num_kv_splits, bool) or not isinstance(num_kv_splits, int) or num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be an int >= 1 or None, got {num_kv_splits!r}")

    mid_o = torch.empty((num_tokens, hq, num_kv_splits, head_dim), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((num_tokens, hq, num_kv_splits), dtype=torch.float32, device=q.device)
    _decode_attn_stage1_kernel[(batch * m_blocks, hkv, num_kv_splits)](
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, mid_o, mid_lse,
        float(sm_scale) * _LOG2E,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        req_to_token.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        HEAD_DIM=head_dim, N_NEW=n, GROUP=group, NUM_SPLITS=num_kv_splits, M_BLOCKS=m_blocks,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        F32_OPERANDS=_interpreting() and q.dtype == torch.bfloat16,
        num_warps=4, num_stages=2,
    )
    _decode_attn_stage2_kernel[(num_tokens, hq)](
        mid_o, mid_lse, seq_lens, out,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, N_NEW=n, NUM_SPLITS=num_kv_splits, BLOCK_N=block_n, BLOCK_D=block_d,
        num_warps=1 if block_d <= 64 else 2,
    )
    return out


def decode_attention_reference(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    tokens_per_req: int,
    sm_scale: float,
    num_kv_splits: int | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-torch oracle of ``decode_attention`` (same arguments, shapes and result; ``num_kv_splits`` unused).

    Gathers each request's slots, computes the masked softmax in float32 and casts the result to q's dtype.
    Reads ``seq_lens`` on the host (one sync per call), so it is for tests and the CPU path, not for graphs.

    Raises:
        ValueError: as ``decode_attention`` (except the CPU/interpreter check), and when a ``seq_lens`` entry
            is outside ``[0, max_len]``.
    """
    _check_inputs(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, tokens_per_req, out)
    n = tokens_per_req
    group = q.shape[1] // k_buffer.shape[1]
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    out.zero_()
    lens = seq_lens.tolist()
    rows = req_pool_indices.tolist()
    for b, (length, row) in enumerate(zip(lens, rows)):
        if not 0 <= length <= req_to_token.shape[1]:
            raise ValueError(f"seq_lens[{b}] = {length} is outside [0, max_len={req_to_token.shape[1]}]")
        if length == 0:
            continue
        slots = req_to_token[row, :length].to(torch.int64)
        k = k_buffer[slots].float().repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v_buffer[slots].float().repeat_interleave(group, dim=1)
        qb = q[b * n:(b + 1) * n].float()  # [n, Hq, D]
        scores = torch.einsum("jhd,lhd->hjl", qb, k) * sm_scale  # [Hq, n, L]
        pos = torch.arange(length, device=q.device)
        limit = length - n + 1 + torch.arange(n, device=q.device)
        visible = pos[None, :] < limit[:, None]  # [n, L]
        scores = scores.masked_fill(~visible[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows that see nothing give zeros
        out[b * n:(b + 1) * n] = torch.einsum("hjl,lhd->jhd", probs, v).to(q.dtype)
    return out
