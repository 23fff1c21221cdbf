"""Paged decode/verify attention for K2, split over the KV length (flash-decoding) and then combined.

Item (b, kv head, split) of ``attention_item``: the ``tpr * G`` query rows of request ``b`` that share kv head
``kvh`` (``G`` = Hq / Hkv; row ``r`` = token ``r // G``, q head ``kvh * G + r % G``) attend to positions
``[split * span, (split + 1) * span)`` of the request, read through ``req_to_token`` from the KV pool. New
token ``j`` (0-based within the request) sees positions ``<= seq_len - tpr + j`` (causal among new tokens).
Online softmax in float32 with exp2 (FlashAttention-2, Dao 2023; split-KV as in Flash-Decoding, Dao et al.
2023); ``P`` is rounded to the model dtype before ``P @ V``, as HF rounds the softmax output.
The partial output (unnormalized), running max and sum go to ``op [Hkv, NSPLIT_MAX, 8 G, D]`` and
``ml [Hkv, NSPLIT_MAX, 8 G, 2]`` float32; ``combine_item`` merges the splits into ``attn_out [8, Hq*D]``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lowlat_amd_mono.kernels.gemv import as_operand, rnd


@triton.jit
def attention_item(i, q_ptr, kc_ptr, vc_ptr, seq_ptr, req_ptr, r2t_ptr, r2t_stride, op_ptr, ml_ptr, NSPLIT,
                   scale_log2, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, TPR: tl.constexpr,
                   M_ATT: tl.constexpr, BLOCK_S: tl.constexpr, NSPLIT_MAX: tl.constexpr, DT: tl.constexpr,
                   INTERP: tl.constexpr, PREC: tl.constexpr, QXC: tl.constexpr):
    """One (request, kv head, split) item: partial attention of its query rows over its share of the keys.
    ``QXC`` is the cache modifier of the q and K/V loads (``.cg`` when the same launch wrote them)."""
    G: tl.constexpr = HQ // HKV
    b = i // (HKV * NSPLIT)
    kvh = (i // NSPLIT) % HKV
    sp = i % NSPLIT
    r = tl.arange(0, M_ATT)
    j = r // G
    rvalid = r < TPR * G
    d = tl.arange(0, D)
    tok = b * TPR + j
    q = tl.load(q_ptr + tok[:, None] * (HQ * D) + (kvh * G + r % G)[:, None] * D + d[None, :],
                mask=rvalid[:, None], other=0.0, cache_modifier=QXC)
    q = as_operand(q, DT, INTERP)
    seq = tl.load(seq_ptr + b).to(tl.int32)
    req = tl.load(req_ptr + b).to(tl.int64)
    last = seq - TPR + j  # the last position row r may attend to
    span = tl.cdiv(tl.cdiv(seq, NSPLIT), BLOCK_S) * BLOCK_S
    s_lo = sp * span
    s_hi = tl.minimum(s_lo + span, seq)
    m_i = tl.full([M_ATT], float("-inf"), tl.float32)
    l_i = tl.zeros([M_ATT], tl.float32)
    acc = tl.zeros([M_ATT, D], tl.float32)
    for s0 in range(s_lo, s_hi, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        smask = s < s_hi
        slot = tl.load(r2t_ptr + req * r2t_stride + s, mask=smask, other=0).to(tl.int64)
        kt = tl.load(kc_ptr + slot[None, :] * (HKV * D) + kvh * D + d[:, None], mask=smask[None, :], other=0.0,
                     cache_modifier=QXC)
        sc = tl.dot(q, as_operand(kt, DT, INTERP), input_precision=PREC) * scale_log2
        sc = tl.where(smask[None, :] & (s[None, :] <= last[:, None]), sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(sc - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(vc_ptr + slot[:, None] * (HKV * D) + kvh * D + d[None, :], mask=smask[:, None], other=0.0,
                    cache_modifier=QXC)
        pv = tl.dot(as_operand(p, DT, INTERP), as_operand(v, DT, INTERP), input_precision=PREC)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    row = (kvh * NSPLIT_MAX + sp) * (8 * G) + b * TPR * G + r
    tl.store(op_ptr + row[:, None] * D + d[None, :], acc, mask=rvalid[:, None])
    tl.store(ml_ptr + row * 2, m_i, mask=rvalid)
    tl.store(ml_ptr + row * 2 + 1, l_i, mask=rvalid)


@triton.jit
def combine_item(i, op_ptr, ml_ptr, ao_ptr, NSPLIT, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                 TPR: tl.constexpr, M_ATT: tl.constexpr, NSPLIT_MAX: tl.constexpr, DT: tl.constexpr,
                 INTERP: tl.constexpr, XC: tl.constexpr):
    """One (request, kv head) item: merge the splits' partial softmax states into ``attn_out`` rows."""
    G: tl.constexpr = HQ // HKV
    b = i // HKV
    kvh = i % HKV
    r = tl.arange(0, M_ATT)
    rvalid = r < TPR * G
    d = tl.arange(0, D)
    rows = kvh * NSPLIT_MAX * (8 * G) + b * TPR * G + r
    m_max = tl.full([M_ATT], float("-inf"), tl.float32)
    for sp in range(0, NSPLIT):
        m_sp = tl.load(ml_ptr + (rows + sp * 8 * G) * 2, mask=rvalid, other=float("-inf"), cache_modifier=XC)
        m_max = tl.maximum(m_max, m_sp)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    acc = tl.zeros([M_ATT, D], tl.float32)
    den = tl.zeros([M_ATT], tl.float32)
    for sp in range(0, NSPLIT):
        rr = rows + sp * 8 * G
        m_sp = tl.load(ml_ptr + rr * 2, mask=rvalid, other=float("-inf"), cache_modifier=XC)
        l_sp = tl.load(ml_ptr + rr * 2 + 1, mask=rvalid, other=0.0, cache_modifier=XC)
        o_sp = tl.load(op_ptr + rr[:, None] * D + d[None, :], mask=rvalid[:, None], other=0.0, cache_modifier=XC)
        w = tl.exp2(m_sp - m_safe)
        acc += o_sp * w[:, None]
        den += l_sp * w
    out = rnd(acc / tl.where(den > 0, den, 1.0)[:, None], DT, INTERP)
    tok = b * TPR + r // G
    dst = ao_ptr + tok[:, None] * (HQ * D) + (kvh * G + r % G)[:, None] * D + d[None, :]
    tl.store(dst, out.to(DT), mask=rvalid[:, None])
