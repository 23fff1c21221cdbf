"""Paged attention over the KV pool: write this step's K/V at ``out_cache_loc``, then attend.

Each request's keys live at slots ``req_to_token[req_pool_indices[b], :seq_lens[b]]`` of the layer's
``k_buffer`` / ``v_buffer`` [num_slots, Hkv, D] (SGLang's layout). New token ``i`` of request ``b`` (of ``n``)
sits at position ``seq_lens[b] - n + i`` and sees keys ``0 ..`` that position (causal among new tokens).

Backends:
- ``torch``: PREFILL uses SDPA (``sdpa``: never its cuDNN backend) per request on the gathered slots with host
  lengths (a PREFILL step is never graph-captured). DECODE/VERIFY gather every request's whole ``req_to_token``
  row (static ``max_context_len``) and mask by ``seq_lens`` on the device: no host sync, graph capturable.
- ``triton``: DECODE/VERIFY call ``lowlat.kernels.decode_attention.decode_attention`` (imported lazily, CUDA
  only); PREFILL uses the torch path.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from lowlat.forward_batch import ForwardBatch, ForwardMode
from lowlat.kv_cache import KVPool

BACKENDS = ("torch", "triton")
EXCLUDE_CUDNN = True  # False: SDPA as torch chooses (cuDNN's faster long prefill, with its replay slowdown)
_NON_CUDNN = ((SDPBackend.FLASH_ATTENTION, torch.backends.cuda.flash_sdp_enabled),
              (SDPBackend.EFFICIENT_ATTENTION, torch.backends.cuda.mem_efficient_sdp_enabled),
              (SDPBackend.MATH, torch.backends.cuda.math_sdp_enabled))


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: object) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` without its cuDNN backend: the backends the process has enabled, minus
    cuDNN (torch then picks flash, efficient or math). If cuDNN is the only one enabled, the user's choice stands.

    Why: measured on the H200 (torch 2.11, which prefers cuDNN there), one cuDNN SDPA call leaves every later
    kernel boundary of a CUDA-graph replay about 0.36 µs idler for the rest of the process, graphs captured
    afterwards included: +64 µs (6%) on the general path's llama-3.2-1b DECODE step after the first prefill;
    flash, efficient and math leave it unchanged (bench/results/2026-12-01-h200-cudnn-drift).

    ``sdpa_kernel`` sets torch's process-wide backend flags for the call and restores them: an SDPA call made on
    another thread at the same moment sees the narrowed set.
    """
    allowed = [b for b, enabled in _NON_CUDNN if enabled()] if EXCLUDE_CUDNN else []
    if not allowed:
        return F.scaled_dot_product_attention(q, k, v, **kwargs)  # type: ignore[arg-type]
    with sdpa_kernel(allowed):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)  # type: ignore[arg-type]


@functools.cache
def _lower_right_type() -> type:
    from torch.nn.attention.bias import CausalBias  # imports torch._dynamo (~2 s): only when a prefix is cached

    class LowerRight(CausalBias):
        """CausalBias without the storage its torch.Tensor base would allocate: ``CausalBias(variant, n, s)``
        reaches ``torch.Tensor(variant, n, s)``, an uninitialized float32 [2, n, s] (8 GiB at 8192 x 131072)."""

        def __new__(cls, *args: object, **kwargs: object) -> LowerRight:
            return torch.Tensor._make_subclass(cls, torch.empty(0))

    return LowerRight


def causal_lower_right(n: int, seq: int) -> torch.Tensor:
    """The attention bias of ``n`` new tokens over ``seq`` keys, the new ones last: token i sees keys 0 ..
    seq - n + i (``torch.nn.attention.bias.causal_lower_right``; SDPA runs it on flash or efficient, no mask
    tensor). Holds no storage."""
    from torch.nn.attention.bias import CausalVariant

    return _lower_right_type()(CausalVariant.LOWER_RIGHT, n, seq)


def resolve_backend(name: str, device: torch.device) -> str:
    """"auto" -> "triton" on CUDA, "torch" elsewhere. Raises ValueError for an unknown name or triton on CPU."""
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be auto, torch or triton, got {name!r}")
    if name == "triton" and device.type != "cuda":
        raise ValueError("the triton attention backend runs on CUDA devices; use attention_backend='torch' on CPU")
    return name


def host_lens(batch: ForwardBatch) -> tuple[list[int], list[int]] | None:
    """(seq_lens, extend_lens) as host lists for a PREFILL step (copied from the device if absent); else None."""
    if batch.forward_mode is not ForwardMode.PREFILL:
        return None
    seq = batch.seq_lens_cpu if batch.seq_lens_cpu is not None else batch.seq_lens.tolist()
    ext = batch.extend_lens_cpu if batch.extend_lens_cpu is not None else batch.extend_lens.tolist()
    return list(seq), list(ext)


def write_kv(kv_pool: KVPool, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store k, v [T, Hkv, D] at slots ``loc`` [T] int64 of layer ``layer_id`` (cast to the pool dtype)."""
    kv_pool.k_buffers[layer_id].index_copy_(0, loc, k.to(kv_pool.dtype))
    kv_pool.v_buffers[layer_id].index_copy_(0, loc, v.to(kv_pool.dtype))


def prefill_attention_torch(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                            req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                            seq_lens: list[int], extend_lens: list[int], sm_scale: float) -> torch.Tensor:
    """Ragged causal attention with a cached prefix, one SDPA call per request.

    Args:
        q: [T, Hq, D], requests concatenated (``extend_lens[b]`` rows each).
        k_buffer, v_buffer: [num_slots, Hkv, D], already holding this step's K/V.
        req_to_token: [max_reqs, max_context_len] int32; req_pool_indices: [B] int64.
        seq_lens, extend_lens: host lists of length B (tokens after the step; new tokens).
    Returns:
        [T, Hq, D] in q's dtype.
    """
    out = torch.empty_like(q)
    rows = req_to_token.index_select(0, req_pool_indices)
    start = 0
    for b, (seq, n) in enumerate(zip(seq_lens, extend_lens)):
        if n == 0:
            continue
        slots = rows[b, :seq].to(torch.int64)
        k = k_buffer.index_select(0, slots).transpose(0, 1)[None].to(q.dtype)  # [1, Hkv, L, D]
        v = v_buffer.index_select(0, slots).transpose(0, 1)[None].to(q.dtype)
        qb = q[start:start + n].transpose(0, 1)[None]  # [1, Hq, n, D]
        prefix = seq - n
        if prefix == 0:
            o = sdpa(qb, k, v, is_causal=True, scale=sm_scale, enable_gqa=True)
        else:  # new token i sees keys 0 .. prefix + i: causal aligned to the lower right (flash, no mask tensor)
            # K/V repeated to Hq heads: a transient Hq / Hkv times the gathered rows (1 GiB each at Hq 32, Hkv 4,
            # D 128 and 131072 keys); flash could take them unrepeated, not checked on a GPU yet
            group = qb.shape[1] // k.shape[1]
            o = sdpa(qb, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                     attn_mask=causal_lower_right(n, seq), scale=sm_scale)
        out[start:start + n] = o[0].transpose(0, 1)
        start += n
    return out


def decode_attention_torch(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                           req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                           tokens_per_req: int, sm_scale: float) -> torch.Tensor:
    """Attention for DECODE/VERIFY without host lengths (the same contract as the Triton decode kernel).

    Args:
        q: [T, Hq, D] with T = B * tokens_per_req, request-major.
        k_buffer, v_buffer: [num_slots, Hkv, D]; req_to_token: [max_reqs, L] int32.
        req_pool_indices: [B] int64; seq_lens: [B] int32 (tokens after the step).
    Returns:
        [T, Hq, D] in q's dtype. Scores and softmax in float32. Static shapes: every request gathers all L
        slots of its row and masks keys past its position, so this is CUDA-graph capturable. A request
        with seq_len 0 (a padded row) yields zeros, as the Triton kernel does.
    """
    n = tokens_per_req
    bsz, length = req_pool_indices.shape[0], req_to_token.shape[1]
    hq, d = q.shape[1], q.shape[2]
    hkv = k_buffer.shape[1]
    slots = req_to_token.index_select(0, req_pool_indices).to(torch.int64)  # [B, L]
    k = k_buffer[slots].float()  # [B, L, Hkv, D]
    v = v_buffer[slots].float()
    qf = q.float().reshape(bsz, n, hkv, hq // hkv, d)
    scores = torch.einsum("bnhgd,blhd->bhgnl", qf, k) * sm_scale
    limit = seq_lens.to(torch.int64)[:, None] - n + torch.arange(n, device=q.device)  # [B, n] last visible key
    visible = torch.arange(length, device=q.device)[None, None, :] <= limit[:, :, None]  # [B, n, L]
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.where(visible[:, None, None], probs, 0.0)  # a request with seq_len 0 (padding) gives zeros
    o = torch.einsum("bhgnl,blhd->bnhgd", probs, v)
    return o.reshape(bsz * n, hq, d).to(q.dtype)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layer_id: int, batch: ForwardBatch,
                    kv_pool: KVPool, sm_scale: float, backend: str,
                    lens: tuple[list[int], list[int]] | None) -> torch.Tensor:
    """Write this step's k, v [T, Hkv, D] at ``batch.out_cache_loc`` and attend with q [T, Hq, D].

    Args:
        backend: "torch" or "triton" (``resolve_backend``).
        lens: ``host_lens(batch)``, required for PREFILL, ignored otherwise.
    Returns:
        [T, Hq, D] in q's dtype.
    Raises:
        ValueError: for a DECODE/VERIFY batch without ``tokens_per_req``.
    """
    write_kv(kv_pool, layer_id, batch.out_cache_loc, k, v)
    return attend_cached(q, layer_id=layer_id, batch=batch, kv_pool=kv_pool, sm_scale=sm_scale, backend=backend,
                         lens=lens)


def attend_cached(q: torch.Tensor, *, layer_id: int, batch: ForwardBatch, kv_pool: KVPool, sm_scale: float,
                  backend: str, lens: tuple[list[int], list[int]] | None) -> torch.Tensor:
    """Attend with q [T, Hq, D] over the KV pool, this step's K/V already written (``paged_attention``'s second
    half; the fused general path writes K/V in its RoPE kernel). Same arguments, result and errors."""
    kb, vb = kv_pool.k_buffers[layer_id], kv_pool.v_buffers[layer_id]
    if batch.forward_mode is ForwardMode.PREFILL:
        assert lens is not None, "PREFILL attention needs host_lens(batch)"
        return prefill_attention_torch(q, kb, vb, kv_pool.req_to_token, batch.req_pool_indices, *lens, sm_scale)
    if batch.tokens_per_req is None:
        raise ValueError(f"a {batch.forward_mode.name} batch needs tokens_per_req (1 for DECODE, k+1 for VERIFY)")
    if backend == "triton":
        from lowlat.kernels.decode_attention import decode_attention

        return decode_attention(q, kb, vb, kv_pool.req_to_token, batch.req_pool_indices, batch.seq_lens,
                                batch.tokens_per_req, sm_scale)
    return decode_attention_torch(q, kb, vb, kv_pool.req_to_token, batch.req_pool_indices, batch.seq_lens,
                                  batch.tokens_per_req, sm_scale)
