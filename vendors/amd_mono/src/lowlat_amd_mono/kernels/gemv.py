"""Shared Triton building blocks: HF-style rounding, RMSNorm rows, and skinny GEMV tiles.

A "GEMV" here multiplies up to 8 activation rows (padded to ``BM`` = 16 rows, the smallest ``tl.dot`` shape)
by a row-major weight ``W[N, K]``: one tile covers ``BN`` output columns and loops over ``K`` in ``BK`` chunks,
accumulating ``acc[BM, BN]`` in float32 with ``tl.dot`` (tensor cores on GPUs; Triton pipelines the loop's
loads). Activations are float32 in registers and rounded to the model dtype where HF rounds (every linear
output, RMSNorm's ``x * rstd`` and ``weight * h``), so results track the HF/torch math.

Interpreter note (``INTERP``): Triton 3.9's interpreter keeps bf16 as raw uint16, so arithmetic and ``tl.dot``
on bf16 values are wrong there and its fp32->bf16 cast truncates. With ``INTERP`` every loaded value is
widened to float32 before use and ``rnd`` rounds to nearest even by bit manipulation. On GPUs the weight
tiles stay in the model dtype so ``tl.dot`` runs on tensor cores.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

# In the GEMV loops that RMS-normalize their input (NORM: QKV, gate/up, router, experts' gate/up, LM head), load
# the next activation chunk and norm weights one K chunk ahead into registers, so their round trip and the norm's
# arithmetic overlap the current chunk's dot. Measured on the H200 (bench/results/2026-12-01-h200-amd-gemv,
# bench_gemv.py, 1 row): gate/up 32.7 -> 26.3 us (llama-3.2-1b), 99.1 -> 70.5 us (qwen3-8b); the loops without a
# norm (o_proj, down) were slower with it (llama down 20.0 -> 26.2 us), so they keep Triton's own pipelining.
# A process-wide switch, read once here: LOWLAT_MONO_GEMV_PREFETCH=0 turns it off (MonoOptions.gemv_prefetch).
PREFETCH_ACT = tl.constexpr(os.environ.get("LOWLAT_MONO_GEMV_PREFETCH", "1").lower() in ("1", "true", "yes", "on"))


@triton.jit
def rnd(x, DT: tl.constexpr, INTERP: tl.constexpr):
    """Round float32 ``x`` to the model dtype ``DT`` (nearest even) and return it as float32."""
    if DT == tl.float32:
        y = x
    elif INTERP and DT == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        y = b.to(tl.float32, bitcast=True)
    else:
        y = x.to(DT).to(tl.float32)
    return y


@triton.jit
def as_operand(x, DT: tl.constexpr, INTERP: tl.constexpr):
    """A ``tl.dot`` operand: the model dtype on GPUs, float32 under the interpreter."""
    if INTERP:
        y = x.to(tl.float32)
    else:
        y = x.to(DT)
    return y


@triton.jit
def load_w(w_ptr, row0, N, stride, k0, K, BN: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr,
           INTERP: tl.constexpr):
    """Weight chunk ``W[row0:row0+BN, k0:k0+BK]`` transposed to ``[BK, BN]`` (zeros outside ``N`` x ``K``)."""
    rows = row0 + tl.arange(0, BN)
    ks = k0 + tl.arange(0, BK)
    w = tl.load(w_ptr + rows[None, :].to(tl.int64) * stride + ks[:, None],
                mask=(rows[None, :] < N) & (ks[:, None] < K), other=0.0)
    return as_operand(w, DT, INTERP)


@triton.jit
def load_a(a_ptr, stride, T, k0, K, BM: tl.constexpr, BK: tl.constexpr, XC: tl.constexpr):
    """Activation chunk ``A[0:BM, k0:k0+BK]`` as float32; rows ``>= T`` and columns ``>= K`` read as zero."""
    r = tl.arange(0, BM)
    ks = k0 + tl.arange(0, BK)
    a = tl.load(a_ptr + r[:, None] * stride + ks[None, :], mask=(r[:, None] < T) & (ks[None, :] < K), other=0.0,
                cache_modifier=XC)
    return a.to(tl.float32)


@triton.jit
def row_rstd(x_ptr, stride, T, K, eps, BM: tl.constexpr, BK: tl.constexpr, XC: tl.constexpr):
    """``rsqrt(mean(x**2) + eps)`` per row of ``x[T, K]`` (float32 ``[BM]``), as HF's RMSNorm computes it."""
    ss = tl.zeros([BM], tl.float32)
    for k in range(0, K, BK):
        a = load_a(x_ptr, stride, T, k, K, BM, BK, XC)
        ss += tl.sum(a * a, axis=1)
    return tl.rsqrt(ss / K + eps)


@triton.jit
def normed(a, rstd, lnw_ptr, k0, K, BK: tl.constexpr, DT: tl.constexpr, INTERP: tl.constexpr):
    """HF RMSNorm of a chunk: ``weight * (x * rstd).to(dtype)``, rounded to the model dtype (float32 out)."""
    ks = k0 + tl.arange(0, BK)
    w = tl.load(lnw_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
    return rnd(rnd(a * rstd[:, None], DT, INTERP) * w[None, :], DT, INTERP)


@triton.jit
def dot_chunk(acc, w, a_ptr, a_stride, T, k0, K, rstd, lnw_ptr, NORM: tl.constexpr, BM: tl.constexpr,
              BK: tl.constexpr, DT: tl.constexpr, INTERP: tl.constexpr, PREC: tl.constexpr, XC: tl.constexpr):
    """``acc += A[:, k0:k0+BK] @ w`` for an already loaded weight chunk ``w`` (RMS-normalized A if NORM)."""
    a = load_a(a_ptr, a_stride, T, k0, K, BM, BK, XC)
    if NORM:
        a = normed(a, rstd, lnw_ptr, k0, K, BK, DT, INTERP)
    return tl.dot(as_operand(a, DT, INTERP), w, acc, input_precision=PREC)


@triton.jit
def norm_w(lnw_ptr, k0, K, BK: tl.constexpr, NORM: tl.constexpr):
    """The RMSNorm weight chunk ``lnw[k0:k0+BK]`` as float32 (zeros past ``K``; not loaded unless ``NORM``)."""
    ks = k0 + tl.arange(0, BK)
    if NORM:
        w = tl.load(lnw_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
    else:
        w = tl.zeros([BK], tl.float32)
    return w


@triton.jit
def apply_norm(a, rstd, w, NORM: tl.constexpr, DT: tl.constexpr, INTERP: tl.constexpr):
    """``normed`` with the weight chunk already loaded (identity unless ``NORM``)."""
    if NORM:
        a = rnd(rnd(a * rstd[:, None], DT, INTERP) * w[None, :], DT, INTERP)
    return a


@triton.jit
def gemv_loop(acc, a_ptr, a_stride, T, w_ptr, w_stride, row0, N, k_start, k_end, K, rstd, lnw_ptr,
              NORM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr,
              INTERP: tl.constexpr, PREC: tl.constexpr, XC: tl.constexpr):
    """``acc[BM, BN] += A[:, k_start:k_end] @ W[row0:row0+BN, k_start:k_end]^T`` in BK chunks."""
    if PREFETCH_ACT and NORM:
        a_nx = load_a(a_ptr, a_stride, T, k_start, K, BM, BK, XC)
        w_nx = norm_w(lnw_ptr, k_start, K, BK, NORM)
        for k in range(k_start, k_end, BK):
            w = load_w(w_ptr, row0, N, w_stride, k, K, BN, BK, DT, INTERP)
            a, lw = a_nx, w_nx
            a_nx = load_a(a_ptr, a_stride, T, k + BK, K, BM, BK, XC)  # the next chunk's, in flight during the dot
            w_nx = norm_w(lnw_ptr, k + BK, K, BK, NORM)
            a = as_operand(apply_norm(a, rstd, lw, NORM, DT, INTERP), DT, INTERP)
            acc = tl.dot(a, w, acc, input_precision=PREC)
    else:
        for k in range(k_start, k_end, BK):
            w = load_w(w_ptr, row0, N, w_stride, k, K, BN, BK, DT, INTERP)
            acc = dot_chunk(acc, w, a_ptr, a_stride, T, k, K, rstd, lnw_ptr, NORM, BM, BK, DT, INTERP, PREC, XC)
    return acc


@triton.jit
def gemv2_loop(acc_g, acc_u, a_ptr, a_stride, T, w_ptr, w_stride, g0, u0, N, k_start, k_end, K, rstd, lnw_ptr,
               NORM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr,
               INTERP: tl.constexpr, PREC: tl.constexpr, XC: tl.constexpr):
    """Two tiles of one weight sharing the activation chunk: gate rows from ``g0`` and up rows from ``u0``."""
    if PREFETCH_ACT and NORM:
        a_nx = load_a(a_ptr, a_stride, T, k_start, K, BM, BK, XC)
        w_nx = norm_w(lnw_ptr, k_start, K, BK, NORM)
        for k in range(k_start, k_end, BK):
            wg = load_w(w_ptr, g0, N, w_stride, k, K, BN, BK, DT, INTERP)
            wu = load_w(w_ptr, u0, N, w_stride, k, K, BN, BK, DT, INTERP)
            a, lw = a_nx, w_nx
            a_nx = load_a(a_ptr, a_stride, T, k + BK, K, BM, BK, XC)  # the next chunk's, in flight during the dots
            w_nx = norm_w(lnw_ptr, k + BK, K, BK, NORM)
            a = as_operand(apply_norm(a, rstd, lw, NORM, DT, INTERP), DT, INTERP)
            acc_g = tl.dot(a, wg, acc_g, input_precision=PREC)
            acc_u = tl.dot(a, wu, acc_u, input_precision=PREC)
    else:
        for k in range(k_start, k_end, BK):
            wg = load_w(w_ptr, g0, N, w_stride, k, K, BN, BK, DT, INTERP)
            wu = load_w(w_ptr, u0, N, w_stride, k, K, BN, BK, DT, INTERP)
            a = load_a(a_ptr, a_stride, T, k, K, BM, BK, XC)
            if NORM:
                a = normed(a, rstd, lnw_ptr, k, K, BK, DT, INTERP)
            a = as_operand(a, DT, INTERP)
            acc_g = tl.dot(a, wg, acc_g, input_precision=PREC)
            acc_u = tl.dot(a, wu, acc_u, input_precision=PREC)
    return acc_g, acc_u


@triton.jit
def l2_prefetch(w_ptr, row0, N, stride, k0, K, TILE_BYTES: tl.constexpr, BN: tl.constexpr, ENABLE: tl.constexpr):
    """Ask L2 to fetch about ``TILE_BYTES`` of the weight tile ``W[row0:row0+BN, k0:K]`` (sm90+ only).

    Each of the ``BN`` rows gets ``TILE_BYTES / BN`` bytes (16-byte multiple) from column ``k0`` on, clipped to
    the row. ``cp.async.bulk.prefetch.L2`` returns at once; it keeps HBM busy while the workgroup waits for a
    tag. The host enables it only on CUDA sm90+ when every row stride and K is a multiple of 8 elements (so
    addresses and sizes are 16-byte multiples, as the instruction requires).
    """
    ROW_BYTES: tl.constexpr = TILE_BYTES // BN // 16 * 16
    if ENABLE and ROW_BYTES > 0:
        ELEM: tl.constexpr = w_ptr.dtype.element_ty.primitive_bitwidth // 8
        rows = row0 + tl.arange(0, BN)
        ptrs = w_ptr + rows.to(tl.int64) * stride + k0
        nbytes = tl.minimum(ROW_BYTES, (K - k0) * ELEM)
        ok = ((rows < N) & (nbytes > 0)).to(tl.int32)
        tl.inline_asm_elementwise(
            "{\n.reg .pred %pf;\nsetp.ne.s32 %pf, $2, 0;\n@%pf cp.async.bulk.prefetch.L2.global [$1], $3;\n"
            "mov.u32 $0, 0;\n}",
            "=r,l,r,r", [ptrs, ok, tl.full([BN], 0, tl.int32) + nbytes], dtype=tl.int32, is_pure=False, pack=1)
