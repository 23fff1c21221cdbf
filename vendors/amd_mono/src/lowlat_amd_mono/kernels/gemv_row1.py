"""The one-row GEMV on the FMA units (``ROW1``), and the tile functions the stages call for either form.

At a step of one row (batch-1 decode) the ``tl.dot`` form of ``gemv`` pads the row to ``BM`` = 16 and
RMS-normalizes 16 rows per K chunk, 15 of them zeros. With ``ROW1`` (a constexpr the host sets when the step
has exactly one row, ``MonoOptions.row1_fma``) a GEMV instead holds the row as a 1-D float32 vector ``x [BK]``,
loads each weight chunk as ``[BN, BK]`` (rows contiguous, so the loads along K are 16 bytes wide; not
transposed) and accumulates ``acc[BN] += sum(w * x[None, :], axis=1)`` in float32, with the norm applied to the
one row. A 2-D ``[1, BK]`` x made nvidia_mega's same loop 1.3-2x slower on the H200 (layout conversions), so x
stays 1-D. The roundings are the ``tl.dot`` path's (``x * rstd`` and ``weight * h`` to the model dtype; the
stages round the outputs); products of two bf16 values are exact in float32, so the two forms differ only in
the float32 summation order. Split-K, tiles, stages and flags are the same in both forms.

The tile functions (``w_chunk``, ``gemv_tile``, ``gemv2_tile``, ...) return the accumulator as ``[RM, BN]``
float32 with ``RM`` = 1 under ``ROW1`` and ``BM`` otherwise, so a stage's epilogue serves both forms.
``PREFETCH_ACT`` applies to the ``tl.dot`` form only (one row's chunk is ``BK`` elements).
"""

from __future__ import annotations

import triton
import triton.language as tl

from lowlat_amd_mono.kernels.gemv import as_operand, dot_chunk, gemv2_loop, gemv_loop, load_w, rnd, row_rstd


@triton.jit
def load_w1(w_ptr, row0, N, stride, k0, K, BN: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr,
            INTERP: tl.constexpr):
    """Weight chunk ``W[row0:row0+BN, k0:k0+BK]`` as ``[BN, BK]`` (zeros outside ``N`` x ``K``): the model dtype
    on GPUs, float32 under the interpreter."""
    rows = row0 + tl.arange(0, BN)
    ks = k0 + tl.arange(0, BK)
    w = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride + ks[None, :],
                mask=(rows[:, None] < N) & (ks[None, :] < K), other=0.0)
    return as_operand(w, DT, INTERP)


@triton.jit
def load_x1(a_ptr, k0, K, BK: tl.constexpr, XC: tl.constexpr):
    """Row 0 of the activations, ``a[k0:k0+BK]``, as a float32 vector ``[BK]`` (zeros past ``K``)."""
    ks = k0 + tl.arange(0, BK)
    return tl.load(a_ptr + ks, mask=ks < K, other=0.0, cache_modifier=XC).to(tl.float32)


@triton.jit
def rstd1(x_ptr, K, eps, BK: tl.constexpr, XC: tl.constexpr):
    """``rsqrt(mean(x**2) + eps)`` of row 0 of ``x [., K]`` (a float32 scalar), as HF's RMSNorm computes it."""
    ss = tl.zeros([BK], tl.float32)
    for k in range(0, K, BK):
        a = load_x1(x_ptr, k, K, BK, XC)
        ss += a * a
    return tl.rsqrt(tl.sum(ss, axis=0) / K + eps)


@triton.jit
def normed1(a, rstd, lnw_ptr, k0, K, BK: tl.constexpr, DT: tl.constexpr, INTERP: tl.constexpr):
    """HF RMSNorm of one row's chunk ``a [BK]``: ``weight * (a * rstd).to(dtype)``, rounded (float32 out)."""
    ks = k0 + tl.arange(0, BK)
    w = tl.load(lnw_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
    return rnd(rnd(a * rstd, DT, INTERP) * w, DT, INTERP)


@triton.jit
def fma1(acc, w, x):
    """``acc[BN] + sum_k w[BN, BK] * x[BK]`` in float32."""
    return acc + tl.sum(w.to(tl.float32) * x[None, :], axis=1)


@triton.jit
def x1_chunk(a_ptr, k0, K, rstd, lnw_ptr, NORM: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr,
             INTERP: tl.constexpr, XC: tl.constexpr):
    """One row's activation chunk ``[BK]`` float32, RMS-normalized (``rstd``, weights ``lnw``) if ``NORM``."""
    x = load_x1(a_ptr, k0, K, BK, XC)
    if NORM:
        x = normed1(x, rstd, lnw_ptr, k0, K, BK, DT, INTERP)
    return x


@triton.jit
def gemv1_loop(acc, a_ptr, w_ptr, w_stride, row0, N, k_start, k_end, K, rstd, lnw_ptr, NORM: tl.constexpr,
               BN: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr, INTERP: tl.constexpr, XC: tl.constexpr):
    """``acc[BN] += W[row0:row0+BN, k_start:k_end] @ a[k_start:k_end]`` in BK chunks (one row)."""
    for k in range(k_start, k_end, BK):
        w = load_w1(w_ptr, row0, N, w_stride, k, K, BN, BK, DT, INTERP)
        acc = fma1(acc, w, x1_chunk(a_ptr, k, K, rstd, lnw_ptr, NORM, BK, DT, INTERP, XC))
    return acc


@triton.jit
def gemv1_2_loop(acc_g, acc_u, a_ptr, w_ptr, w_stride, g0, u0, N, k_start, k_end, K, rstd, lnw_ptr,
                 NORM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr, INTERP: tl.constexpr,
                 XC: tl.constexpr):
    """``gemv1_loop`` over two tiles of one weight (gate rows from ``g0``, up rows from ``u0``) sharing each
    activation chunk."""
    for k in range(k_start, k_end, BK):
        wg = load_w1(w_ptr, g0, N, w_stride, k, K, BN, BK, DT, INTERP)
        wu = load_w1(w_ptr, u0, N, w_stride, k, K, BN, BK, DT, INTERP)
        x = x1_chunk(a_ptr, k, K, rstd, lnw_ptr, NORM, BK, DT, INTERP, XC)
        acc_g = fma1(acc_g, wg, x)
        acc_u = fma1(acc_u, wu, x)
    return acc_g, acc_u


# ----- the tile functions the stages call (both forms) ----------------------------------------------------------
@triton.jit
def w_chunk(w_ptr, row0, N, stride, k0, K, BN: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr,
            INTERP: tl.constexpr, ROW1: tl.constexpr):
    """A tile's first weight chunk, requested before a stage's wait: ``[BN, BK]`` with ``ROW1``, else
    ``[BK, BN]`` (``gemv.load_w``, the ``tl.dot`` operand)."""
    if ROW1:
        w = load_w1(w_ptr, row0, N, stride, k0, K, BN, BK, DT, INTERP)
    else:
        w = load_w(w_ptr, row0, N, stride, k0, K, BN, BK, DT, INTERP)
    return w


@triton.jit
def rstd_init(BM: tl.constexpr, ROW1: tl.constexpr):
    """Zeros of the shape ``rows_rstd`` returns: a float32 scalar with ``ROW1``, else ``[BM]``."""
    if ROW1:
        r = tl.zeros([], tl.float32)
    else:
        r = tl.zeros([BM], tl.float32)
    return r


@triton.jit
def rows_rstd(x_ptr, stride, T, K, eps, BM: tl.constexpr, BK: tl.constexpr, XC: tl.constexpr,
              ROW1: tl.constexpr):
    """The RMSNorm factors of the step's rows of ``x [T, K]``: row 0's (scalar) with ``ROW1``, else ``[BM]``."""
    if ROW1:
        r = rstd1(x_ptr, K, eps, BK, XC)
    else:
        r = row_rstd(x_ptr, stride, T, K, eps, BM, BK, XC)
    return r


@triton.jit
def gemv_tile(w0, a_ptr, a_stride, T, w_ptr, w_stride, row0, N, k_start, k_end, K, rstd, lnw_ptr,
              NORM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr,
              INTERP: tl.constexpr, PREC: tl.constexpr, XC: tl.constexpr, ROW1: tl.constexpr):
    """``acc [RM, BN]`` float32 ``= A[:, k_start:k_end] @ W[row0:row0+BN, k_start:k_end]^T`` (A RMS-normalized if
    ``NORM``), with ``w0`` the chunk at ``k_start`` already loaded by ``w_chunk``; ``RM`` = 1 with ``ROW1``."""
    if ROW1:
        acc1 = fma1(tl.zeros([BN], tl.float32), w0,
                    x1_chunk(a_ptr, k_start, K, rstd, lnw_ptr, NORM, BK, DT, INTERP, XC))
        acc1 = gemv1_loop(acc1, a_ptr, w_ptr, w_stride, row0, N, k_start + BK, k_end, K, rstd, lnw_ptr, NORM,
                          BN, BK, DT, INTERP, XC)
        acc = acc1[None, :]
    else:
        acc = dot_chunk(tl.zeros([BM, BN], tl.float32), w0, a_ptr, a_stride, T, k_start, K, rstd, lnw_ptr, NORM,
                        BM, BK, DT, INTERP, PREC, XC)
        acc = gemv_loop(acc, a_ptr, a_stride, T, w_ptr, w_stride, row0, N, k_start + BK, k_end, K, rstd, lnw_ptr,
                        NORM, BM, BN, BK, DT, INTERP, PREC, XC)
    return acc


@triton.jit
def gemv_rows(a_ptr, a_stride, T, w_ptr, w_stride, row0, N, K, rstd, lnw_ptr, NORM: tl.constexpr,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr, INTERP: tl.constexpr,
              PREC: tl.constexpr, XC: tl.constexpr, ROW1: tl.constexpr):
    """``gemv_tile`` over all of ``K`` with no chunk loaded before (the router)."""
    if ROW1:
        acc = gemv1_loop(tl.zeros([BN], tl.float32), a_ptr, w_ptr, w_stride, row0, N, 0, K, K, rstd, lnw_ptr,
                         NORM, BN, BK, DT, INTERP, XC)[None, :]
    else:
        acc = gemv_loop(tl.zeros([BM, BN], tl.float32), a_ptr, a_stride, T, w_ptr, w_stride, row0, N, 0, K, K,
                        rstd, lnw_ptr, NORM, BM, BN, BK, DT, INTERP, PREC, XC)
    return acc


@triton.jit
def gemv2_tile(wg0, wu0, a_ptr, a_stride, T, w_ptr, w_stride, g0, u0, N, K, rstd, lnw_ptr, NORM: tl.constexpr,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr, INTERP: tl.constexpr,
               PREC: tl.constexpr, XC: tl.constexpr, ROW1: tl.constexpr):
    """Gate and up tiles of one weight over all of ``K`` (``[RM, BN]`` each), with their first chunks ``wg0`` /
    ``wu0`` already loaded by ``w_chunk``."""
    if ROW1:
        x = x1_chunk(a_ptr, 0, K, rstd, lnw_ptr, NORM, BK, DT, INTERP, XC)
        acc_g, acc_u = gemv1_2_loop(fma1(tl.zeros([BN], tl.float32), wg0, x),
                                    fma1(tl.zeros([BN], tl.float32), wu0, x), a_ptr, w_ptr, w_stride, g0, u0, N,
                                    BK, K, K, rstd, lnw_ptr, NORM, BN, BK, DT, INTERP, XC)
        g = acc_g[None, :]
        u = acc_u[None, :]
    else:
        zero = tl.zeros([BM, BN], tl.float32)
        g = dot_chunk(zero, wg0, a_ptr, a_stride, T, 0, K, rstd, lnw_ptr, NORM, BM, BK, DT, INTERP, PREC, XC)
        u = dot_chunk(zero, wu0, a_ptr, a_stride, T, 0, K, rstd, lnw_ptr, NORM, BM, BK, DT, INTERP, PREC, XC)
        g, u = gemv2_loop(g, u, a_ptr, a_stride, T, w_ptr, w_stride, g0, u0, N, BK, K, K, rstd, lnw_ptr, NORM, BM,
                          BN, BK, DT, INTERP, PREC, XC)
    return g, u


@triton.jit
def gemv2_rows(a_ptr, a_stride, T, w_ptr, w_stride, g0, u0, N, K, rstd, lnw_ptr, NORM: tl.constexpr,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr, INTERP: tl.constexpr,
               PREC: tl.constexpr, XC: tl.constexpr, ROW1: tl.constexpr):
    """``gemv2_tile`` with no chunk loaded before (the routed experts' gate/up)."""
    if ROW1:
        z = tl.zeros([BN], tl.float32)
        acc_g, acc_u = gemv1_2_loop(z, z, a_ptr, w_ptr, w_stride, g0, u0, N, 0, K, K, rstd, lnw_ptr, NORM, BN, BK,
                                    DT, INTERP, XC)
        g = acc_g[None, :]
        u = acc_u[None, :]
    else:
        z = tl.zeros([BM, BN], tl.float32)
        g, u = gemv2_loop(z, z, a_ptr, a_stride, T, w_ptr, w_stride, g0, u0, N, 0, K, K, rstd, lnw_ptr, NORM, BM,
                          BN, BK, DT, INTERP, PREC, XC)
    return g, u
