"""After the QKV GEMM: optional per-head q/k RMSNorm (Qwen3), neox RoPE, and the KV-cache write, in one kernel.

Per token t (position ``p = positions[t]``, KV slot ``loc[t]``) and head, with ``(x1, x2)`` the two halves of a
head vector and ``c, s = cos_cache[p, :D/2], sin_cache[p, :D/2]`` cast to the dtype:

    x  = rms_norm(x, q_norm_weight or k_norm_weight, eps)      (Qwen3 only; ``lowlat.layers.norm`` math)
    x' = (x1 * c - x2 * s, x2 * c + x1 * s)                     (each product and the sum rounded to the dtype)
    q_out[t, h] = x'  for query heads;  k_buffer[loc[t], h] = x', v_buffer[loc[t], h] = v  for KV heads

That is ``apply_rotary`` (HF ``rotate_half``: ``x * cos + rotate_half(x) * sin``) on the cos/sin rows that
``RotaryEmbedding.forward`` gathers, with torch's roundings, followed by ``write_kv``: the plain forward spends
two gathers, two casts, about a dozen element-wise kernels and two ``index_copy_`` on this. The cos/sin tables
hold ``cat(freqs, freqs)``, so both halves of a row are equal and only the first half is read.

Design: one program per (token, head) of q and k, the v row riding with its k head, as in the fused
"QKV-norm + RoPE + cache store" kernels of vLLM (``fused_qk_norm_rope``, ``reshape_and_cache``) and FlashInfer
(``apply_rope_pos_ids`` + ``append_paged_kv_cache``); written from the math above, not from their code. The
q/k heads are the first ``Hq + Hkv`` head-sized column blocks of the GEMM output, so head ``h`` of either sits
at column ``h * D``. Grid ``(T, Hq + Hkv)``: static in the shapes, so CUDA-graph capturable.
Launched with ``enable_fp_fusion=False``: no multiply-add is contracted into an FMA, so every rounding is
torch's (eager torch never fuses them either).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowlat.kernels._launch import check_cpu_launch, check_row_major

__all__ = ["qk_norm_rope_kv_write"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_INDEX_DTYPES = (torch.int64, torch.int32)


@triton.jit
def _qk_norm_rope_kv_kernel(
    qkv_ptr, pos_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, loc_ptr, q_out_ptr, k_ptr, v_ptr,
    stride_qkv, stride_cos, stride_sin, stride_qot, stride_qoh, stride_kt, stride_kh, stride_vt, stride_vh,
    eps,
    NUM_Q: tl.constexpr, NUM_KV: tl.constexpr, HEAD_DIM: tl.constexpr, HALF_BLOCK: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    half = HEAD_DIM // 2  # a constexpr (HEAD_DIM is one)
    offs = tl.arange(0, HALF_BLOCK)
    mask = offs < half
    dtype = qkv_ptr.dtype.element_ty
    row = qkv_ptr + t * stride_qkv + h * HEAD_DIM
    x1 = tl.load(row + offs, mask=mask, other=0.0)
    x2 = tl.load(row + half + offs, mask=mask, other=0.0)
    is_q = h < NUM_Q
    if HAS_NORM:
        w1 = tl.where(is_q, tl.load(qn_ptr + offs, mask=mask, other=0.0), tl.load(kn_ptr + offs, mask=mask, other=0.0))
        w2 = tl.where(is_q, tl.load(qn_ptr + half + offs, mask=mask, other=0.0),
                      tl.load(kn_ptr + half + offs, mask=mask, other=0.0))
        x1f = x1.to(tl.float32)
        x2f = x2.to(tl.float32)
        mean_sq = (tl.sum(x1f * x1f, axis=0) + tl.sum(x2f * x2f, axis=0)) / HEAD_DIM
        inv = 1.0 / tl.sqrt(mean_sq + eps)
        x1 = (w1.to(tl.float32) * (x1f * inv).to(dtype).to(tl.float32)).to(dtype)
        x2 = (w2.to(tl.float32) * (x2f * inv).to(dtype).to(tl.float32)).to(dtype)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    c = tl.load(cos_ptr + pos * stride_cos + offs, mask=mask, other=0.0).to(dtype).to(tl.float32)
    s = tl.load(sin_ptr + pos * stride_sin + offs, mask=mask, other=0.0).to(dtype).to(tl.float32)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    o1 = ((x1f * c).to(dtype).to(tl.float32) - (x2f * s).to(dtype).to(tl.float32)).to(dtype)
    o2 = ((x2f * c).to(dtype).to(tl.float32) + (x1f * s).to(dtype).to(tl.float32)).to(dtype)
    if is_q:
        q_row = q_out_ptr + t * stride_qot + h * stride_qoh
        tl.store(q_row + offs, o1, mask=mask)
        tl.store(q_row + half + offs, o2, mask=mask)
    else:
        kv_head = h - NUM_Q
        slot = tl.load(loc_ptr + t).to(tl.int64)
        k_row = k_ptr + slot * stride_kt + kv_head * stride_kh
        tl.store(k_row + offs, o1.to(k_ptr.dtype.element_ty), mask=mask)
        tl.store(k_row + half + offs, o2.to(k_ptr.dtype.element_ty), mask=mask)
        v_src = qkv_ptr + t * stride_qkv + (NUM_Q + NUM_KV + kv_head) * HEAD_DIM
        v_row = v_ptr + slot * stride_vt + kv_head * stride_vh
        v1 = tl.load(v_src + offs, mask=mask, other=0.0)
        v2 = tl.load(v_src + half + offs, mask=mask, other=0.0)
        tl.store(v_row + offs, v1.to(v_ptr.dtype.element_ty), mask=mask)
        tl.store(v_row + half + offs, v2.to(v_ptr.dtype.element_ty), mask=mask)


def _check(qkv, positions, cos_cache, sin_cache, out_cache_loc, k_buffer, v_buffer, hq, hkv, d,
           q_norm_weight, k_norm_weight) -> None:
    if qkv.dim() != 2 or qkv.dtype not in _DTYPES:
        raise ValueError(f"qkv must be a 2-D bf16/fp16/fp32 [T, (Hq + 2 Hkv) * D] tensor, got {qkv.dtype} "
                         f"{tuple(qkv.shape)}")
    if min(hq, hkv, d) < 1 or d % 2 or qkv.shape[1] != (hq + 2 * hkv) * d:
        raise ValueError(f"qkv has {qkv.shape[1]} columns; num_q_heads={hq}, num_kv_heads={hkv}, head_dim={d} "
                         f"(even) need (Hq + 2 Hkv) * D = {(hq + 2 * hkv) * d}")
    t = qkv.shape[0]
    for name, idx in (("positions", positions), ("out_cache_loc", out_cache_loc)):
        if idx.shape != (t,) or idx.dtype not in _INDEX_DTYPES:
            raise ValueError(f"{name} must be int64/int32 [{t}], got {idx.dtype} {tuple(idx.shape)}")
    for name, tab in (("cos_cache", cos_cache), ("sin_cache", sin_cache)):
        if tab.dim() != 2 or tab.shape[1] < d // 2 or tab.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 [max_positions, >= D/2 = {d // 2}], got {tab.dtype} "
                             f"{tuple(tab.shape)}")
        check_row_major(name, tab)
    for name, buf in (("k_buffer", k_buffer), ("v_buffer", v_buffer)):
        if buf.dim() != 3 or tuple(buf.shape[1:]) != (hkv, d) or buf.dtype not in _DTYPES:
            raise ValueError(f"{name} must be [num_slots, {hkv}, {d}] bf16/fp16/fp32, got {buf.dtype} "
                             f"{tuple(buf.shape)}")
        check_row_major(name, buf)
    check_row_major("qkv", qkv)
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("give both q_norm_weight and k_norm_weight (Qwen3) or neither (Llama)")
    tensors = [qkv, positions, cos_cache, sin_cache, out_cache_loc, k_buffer, v_buffer]
    for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if w is not None:
            if w.shape != (d,) or w.dtype != qkv.dtype or (d > 1 and w.stride(0) != 1):
                raise ValueError(f"{name} must be contiguous {qkv.dtype} [{d}], got {w.dtype} {tuple(w.shape)}")
            tensors.append(w)
    if len({x.device for x in tensors}) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted({str(x.device) for x in tensors})}")
    if qkv.device.type == "cpu":
        check_cpu_launch("qk_norm_rope_kv_write", _qk_norm_rope_kv_kernel)


def qk_norm_rope_kv_write(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    out_cache_loc: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """RoPE q and k (after the optional q/k RMSNorm), store k and v at ``out_cache_loc``; return q.

    Args:
        qkv: [T, (Hq + 2 Hkv) * D] bf16/fp16/fp32, the QKV GEMM output (q heads, then k heads, then v heads);
            last dim contiguous.
        positions: [T] int64/int32 position of each token (< max_positions; not checked: no host sync).
        cos_cache, sin_cache: [max_positions, D] float32 (``RotaryEmbedding`` buffers); the first D/2 columns
            are read.
        out_cache_loc: [T] int64/int32 KV slot of each token (every slot < num_slots; not checked).
        k_buffer, v_buffer: [num_slots, Hkv, D] the layer's KV pool buffers, written at ``out_cache_loc`` only
            (values cast to the buffers' dtype).
        num_q_heads, num_kv_heads, head_dim: Hq, Hkv, D (even) of this rank.
        q_norm_weight, k_norm_weight: [D] in qkv's dtype (Qwen3's q_norm / k_norm), both or neither.
        eps: the q/k RMSNorm epsilon.
    Returns:
        q: a new contiguous [T, Hq, D] tensor in qkv's dtype.
    Raises:
        ValueError: bad shapes, dtypes, strides or devices, one norm weight without the other, or CPU tensors
            without ``TRITON_INTERPRET=1``.
    """
    hq, hkv, d = num_q_heads, num_kv_heads, head_dim
    _check(qkv, positions, cos_cache, sin_cache, out_cache_loc, k_buffer, v_buffer, hq, hkv, d,
           q_norm_weight, k_norm_weight)
    t = qkv.shape[0]
    q = torch.empty((t, hq, d), dtype=qkv.dtype, device=qkv.device)
    if t == 0:
        return q
    has_norm = q_norm_weight is not None
    qn = q_norm_weight if has_norm else qkv
    kn = k_norm_weight if has_norm else qkv
    _qk_norm_rope_kv_kernel[(t, hq + hkv)](
        qkv, positions, cos_cache, sin_cache, qn, kn, out_cache_loc, q, k_buffer, v_buffer,
        qkv.stride(0), cos_cache.stride(0), sin_cache.stride(0), q.stride(0), q.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        float(eps),
        NUM_Q=hq, NUM_KV=hkv, HEAD_DIM=d, HALF_BLOCK=triton.next_power_of_2(d // 2), HAS_NORM=has_norm,
        num_warps=1 if d <= 128 else 2, enable_fp_fusion=False,
    )
    return q
