"""One-row GEMV on the FMA units: ``out[1, N] = epilogue(prologue(x)[1, K] @ W[N, K]^T)``, and the launcher
that picks it or ``small_gemm`` per step.

``small_gemm`` pads the rows to 16 for ``tl.dot``: at one row it normalizes 16 rows of x per K chunk (15 of them
zeros) and, for a narrow output, needs split-K and its ticket round trip to fill the GPU. This kernel serves the
batch-1 decode step: each program owns ``BLOCK_N`` (2-16) whole weight rows, walks K in long chunks
(``BLOCK_K`` 512-2048 elements: 1-4 KB of each row per load, as cuBLAS's and FlashInfer's batch-1 GEMV kernels
read a row), multiplies on the CUDA cores in fp32 and reduces each chunk. x is one row held as a 1-D vector in
the weight tile's column layout, so no layout conversion runs per chunk (a [1, BLOCK_K] 2-D x made the loop
1.3-2x slower on the H200). At 2-16 rows per program even a 2048-wide output gives 128-1024 programs: no
split-K. When K fits one chunk the whole weight tile is loaded before ``gdc_wait``.

Two forms, chosen by ``GemvPlan.per_sm``:

- ``_gemv_kernel`` (``per_sm`` 0): one program per tile. Only the first resident wave loads weights before
  ``gdc_wait``; a later program requests its first chunk when it starts, and each program its next chunk only
  after it has read x, normalized it and multiplied the chunk before (Triton software-pipelines loads that feed
  ``tl.dot``, not these). Every program recomputes the row statistics of x from L2.
- ``_gemv_stream_kernel`` (``per_sm`` > 0): a persistent weight stream of ``per_sm x SMs`` programs (at most one
  per tile). Each requests its first chunk before ``gdc_wait``, computes ``rstd`` and the normalized first K chunk
  of x once (later chunks are re-read per tile), then walks its (tile, K chunk) items, tiles ``pid, pid + grid,
  ...``, loading item ``i + 1``'s weights into registers before it multiplies item ``i`` (a two-deep register ring).
  Measured: it pays where K is one chunk (llama-3.2-1b's gate_up on an H100), not at K 4096
  (vendors/nvidia_mega/docs/kernels.md, "The GEMV's weight stream").

Both reduce each chunk and add the chunks in K order, so at the same ``BLOCK_N`` / ``BLOCK_K`` they are
bit-identical.

Same prologue (RMSNorm in HF's order), epilogues (none, SwiGLU, residual) and PDL rules as ``small_gemm``, with
the same roundings: products of two bf16 values are exact in fp32, so only the fp32 summation order differs.
Chosen per shape by ``GemmPlan.row1`` (``tuned_plans``: measured by ``tune_plans.py --row1-only``, else a default).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowlat_nvidia_mega.kernels.gemm_plans import GemmPlan, GemvPlan, num_sms
from lowlat_nvidia_mega.kernels.pdl import gdc_launch_dependents, gdc_wait, launch_kwargs, pdl_enabled
from lowlat_nvidia_mega.kernels.rounding import rnd, to_act
from lowlat_nvidia_mega.kernels.small_gemm import (
    EPILOGUES,
    _gemm_epilogue,
    check_gemm_args,
    load_tile,
    prefetch_act_enabled,
    small_gemm,
)
from lowlat_nvidia_mega.kernels.tp_epilogue import PeerTarget, check_publish, peer_launch_args, publish_epilogue


@triton.jit
def one_row_x(x_ptr, ks, k_mask, rstd, nw_ptr, HAS_NORM: tl.constexpr):
    """x[ks] (1-D, input dtype), RMS-normalized and scaled by ``nw[ks]`` in HF's order when ``HAS_NORM``."""
    x = tl.load(x_ptr + ks, mask=k_mask, other=0.0)
    if HAS_NORM:
        h = rnd(x.to(tl.float32) * rstd, x.dtype)
        nw = tl.load(nw_ptr + ks, mask=k_mask, other=0.0)
        x = to_act(nw.to(tl.float32) * h, x.dtype)
    return x


@triton.jit
def one_row_rstd(x_ptr, K: tl.constexpr, eps, BLOCK: tl.constexpr):
    """fp32 ``rsqrt(mean(x^2) + eps)`` of one row; unrolled so its loads are in flight together."""
    ss = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in tl.static_range(0, K, BLOCK):
        ks = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
        ss += x * x
    return 1.0 / tl.sqrt(tl.sum(ss, 0) / K + eps)


@triton.jit
def rows_rstd(x_ptr, stride_xm, K: tl.constexpr, eps, BLOCK: tl.constexpr, ROWS: tl.constexpr,
              ROWS_P: tl.constexpr):
    """``one_row_rstd`` of rows 0..ROWS-1: a scalar at ROWS == 1, else a [ROWS_P] fp32 vector (1.0 past ROWS)."""
    if ROWS == 1:
        rstd = one_row_rstd(x_ptr, K, eps, BLOCK)
    else:
        cols = tl.arange(0, ROWS_P)
        rstd = tl.full([ROWS_P], 1.0, dtype=tl.float32)
        for r in tl.static_range(ROWS):
            rstd = tl.where(cols == r, one_row_rstd(x_ptr + r * stride_xm, K, eps, BLOCK), rstd)
    return rstd


@triton.jit
def rows_chunk(w, wu, x_ptr, stride_xm, kl, kl_mask, rstd, nw_ptr, HAS_NORM: tl.constexpr, GATED: tl.constexpr,
               ROWS: tl.constexpr, ROWS_P: tl.constexpr):
    """One K chunk's fp32 products of the weight tiles ``w`` (and ``wu`` when ``GATED``) [BLOCK_N, BLOCK_K] with
    rows 0..ROWS-1 of x at columns ``kl`` (each row normalized by ``one_row_x``, ``rstd`` from ``rows_rstd``).

    ROWS == 1: two [BLOCK_N] vectors. Else two [BLOCK_N, ROWS_P] tiles, column r holding row r's sums (zeros past
    ROWS): each row is a 1-D vector in the weight tile's column layout, as at one row, so no layout conversion
    runs per chunk; each [BLOCK_N] result is placed in its column of the tile's own layout (``[:, None]``)."""
    w32 = w.to(tl.float32)
    wu32 = wu.to(tl.float32)
    if ROWS == 1:
        x = one_row_x(x_ptr, kl, kl_mask, rstd, nw_ptr, HAS_NORM).to(tl.float32)[None, :]
        part = tl.sum(w32 * x, 1)
        part_u = part
        if GATED:
            part_u = tl.sum(wu32 * x, 1)
    else:
        cols = tl.arange(0, ROWS_P)[None, :]
        part = tl.zeros([w.shape[0], ROWS_P], dtype=tl.float32)
        part_u = part
        for r in tl.static_range(ROWS):
            rr = 1.0
            if HAS_NORM:
                rr = tl.sum(tl.where(tl.arange(0, ROWS_P) == r, rstd, 0.0), 0)
            x = one_row_x(x_ptr + r * stride_xm, kl, kl_mask, rr, nw_ptr, HAS_NORM).to(tl.float32)[None, :]
            part = tl.where(cols == r, tl.sum(w32 * x, 1)[:, None], part)
            if GATED:
                part_u = tl.where(cols == r, tl.sum(wu32 * x, 1)[:, None], part_u)
    return part, part_u


@triton.jit
def rows_epilogue(acc, acc_u, offs_n, n_mask, out_ptr, stride_om, res_ptr, stride_rm, N, data_ptrs, flag_ptrs,
                  tag_ptr, rank, cap, cap_tiles, tile, publish, EPILOGUE: tl.constexpr, WORLD: tl.constexpr,
                  ROWS: tl.constexpr, ROWS_P: tl.constexpr):
    """The small GEMM's epilogue (or the TP publish) of ``rows_chunk``'s sums: [BLOCK_N] at ROWS == 1, else
    [BLOCK_N, ROWS_P] (transposed here to [ROWS_P, BLOCK_N], rows past ROWS masked)."""
    if ROWS == 1:
        a = acc[None, :]
        au = acc_u[None, :]
        offs_m = tl.arange(0, 1)
        o_mask = n_mask[None, :]
    else:
        a = tl.trans(acc)
        au = tl.trans(acc_u)
        offs_m = tl.arange(0, ROWS_P)
        o_mask = (offs_m < ROWS)[:, None] & n_mask[None, :]
    if EPILOGUE == 3:
        publish_epilogue(a, offs_m, offs_n, o_mask, N, out_ptr.dtype.element_ty, data_ptrs, flag_ptrs, tag_ptr,
                         rank, cap, cap_tiles, tile, publish, WORLD)
    else:
        _gemm_epilogue(a, au, offs_m, offs_n, o_mask, out_ptr, stride_om, res_ptr, stride_rm, EPILOGUE)


@triton.jit
def _gemv_kernel(
    x_ptr, stride_xm, w_ptr, stride_wn, nw_ptr, res_ptr, stride_rm, out_ptr, stride_om, N, K, eps,
    data_ptrs, flag_ptrs, tag_ptr, rank, cap, cap_tiles, publish,
    NORM_K: tl.constexpr, RSTD_BLOCK: tl.constexpr, HAS_NORM: tl.constexpr, EPILOGUE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, USE_PDL: tl.constexpr, WORLD: tl.constexpr,
    ROWS: tl.constexpr, ROWS_P: tl.constexpr,
):
    GATED: tl.constexpr = EPILOGUE == 1
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    ks = tl.arange(0, BLOCK_K)
    k_mask = ks < K
    w_rows = w_ptr + offs_n[:, None] * stride_wn
    w0 = load_tile(w_rows + ks[None, :], n_mask, k_mask, EVEN_K)  # weights never depend on the previous kernel
    w0u = w0
    if GATED:
        w0u = load_tile(w_rows + N * stride_wn + ks[None, :], n_mask, k_mask, EVEN_K)
    gdc_launch_dependents(USE_PDL)
    gdc_wait(USE_PDL)

    rstd = 1.0
    if HAS_NORM:
        rstd = rows_rstd(x_ptr, stride_xm, NORM_K, eps, RSTD_BLOCK, ROWS, ROWS_P)
    acc, acc_u = rows_chunk(w0, w0u, x_ptr, stride_xm, ks, k_mask, rstd, nw_ptr, HAS_NORM, GATED, ROWS, ROWS_P)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        kl = k0 + tl.arange(0, BLOCK_K)
        kl_mask = kl < K
        w = load_tile(w_rows + kl[None, :], n_mask, kl_mask, EVEN_K)
        wu = w
        if GATED:
            wu = load_tile(w_rows + N * stride_wn + kl[None, :], n_mask, kl_mask, EVEN_K)
        part, part_u = rows_chunk(w, wu, x_ptr, stride_xm, kl, kl_mask, rstd, nw_ptr, HAS_NORM, GATED, ROWS, ROWS_P)
        acc += part
        if GATED:
            acc_u += part_u
    rows_epilogue(acc, acc_u, offs_n, n_mask, out_ptr, stride_om, res_ptr, stride_rm, N, data_ptrs, flag_ptrs,
                  tag_ptr, rank, cap, cap_tiles, pid, publish, EPILOGUE, WORLD, ROWS, ROWS_P)


@triton.jit
def _stream_load(w_ptr, stride_wn, tile, chunk, N, K, GATED: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """Item (``tile``, ``chunk``)'s weight tiles ``[BLOCK_N, BLOCK_K]``: W rows (and, ``GATED``, the up rows N
    below them); rows past N (a tile past the last) are masked to zero."""
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    kl = chunk * BLOCK_K + tl.arange(0, BLOCK_K)
    rows = w_ptr + offs_n[:, None] * stride_wn + kl[None, :]
    w = load_tile(rows, offs_n < N, kl < K, EVEN_K)
    wu = w
    if GATED:
        wu = load_tile(rows + N * stride_wn, offs_n < N, kl < K, EVEN_K)
    return w, wu


@triton.jit
def _gemv_stream_kernel(
    x_ptr, stride_xm, w_ptr, stride_wn, nw_ptr, res_ptr, stride_rm, out_ptr, stride_om, N, K, eps,
    data_ptrs, flag_ptrs, tag_ptr, rank, cap, cap_tiles, publish,
    NORM_K: tl.constexpr, RSTD_BLOCK: tl.constexpr, HAS_NORM: tl.constexpr, EPILOGUE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNKS: tl.constexpr, EVEN_K: tl.constexpr,
    USE_PDL: tl.constexpr, WORLD: tl.constexpr, ROWS: tl.constexpr, ROWS_P: tl.constexpr,
):
    GATED: tl.constexpr = EPILOGUE == 1
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    my_tiles = tl.cdiv(tl.cdiv(N, BLOCK_N) - pid, grid)
    w_nx, wu_nx = _stream_load(w_ptr, stride_wn, pid, 0, N, K, GATED, BLOCK_N, BLOCK_K, EVEN_K)
    gdc_launch_dependents(USE_PDL)
    gdc_wait(USE_PDL)

    ks = tl.arange(0, BLOCK_K)
    rstd = 1.0
    if HAS_NORM:
        rstd = rows_rstd(x_ptr, stride_xm, NORM_K, eps, RSTD_BLOCK, ROWS, ROWS_P)
    x_once = 0.0
    if ROWS == 1:  # the first chunk of x, normalized once per program
        x_once = one_row_x(x_ptr, ks, ks < K, rstd, nw_ptr, HAS_NORM).to(tl.float32)[None, :]
    for t in range(0, my_tiles):
        tile = pid + t * grid
        for c in tl.static_range(CHUNKS):
            w = w_nx
            wu = wu_nx
            if c + 1 < CHUNKS:  # the ring: request the next item before this one is multiplied
                w_nx, wu_nx = _stream_load(w_ptr, stride_wn, tile, c + 1, N, K, GATED, BLOCK_N, BLOCK_K, EVEN_K)
            else:
                w_nx, wu_nx = _stream_load(w_ptr, stride_wn, tile + grid, 0, N, K, GATED, BLOCK_N, BLOCK_K, EVEN_K)
            if ROWS == 1 and c == 0:
                part = tl.sum(w.to(tl.float32) * x_once, 1)
                part_u = part
                if GATED:
                    part_u = tl.sum(wu.to(tl.float32) * x_once, 1)
            else:
                kl = c * BLOCK_K + ks
                part, part_u = rows_chunk(w, wu, x_ptr, stride_xm, kl, kl < K, rstd, nw_ptr, HAS_NORM, GATED,
                                          ROWS, ROWS_P)
            if c == 0:
                acc = part
                acc_u = part_u
            else:
                acc += part
                acc_u += part_u
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        rows_epilogue(acc, acc_u, offs_n, offs_n < N, out_ptr, stride_om, res_ptr, stride_rm, N, data_ptrs,
                      flag_ptrs, tag_ptr, rank, cap, cap_tiles, tile, publish, EPILOGUE, WORLD, ROWS, ROWS_P)


def gemm(
    x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, *, plan: GemmPlan, epilogue: str = "none",
    norm_weight: torch.Tensor | None = None, eps: float = 1e-6, residual: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None, counters: torch.Tensor | None = None, use_pdl: bool | None = None,
    prefetch_act: bool | None = None, peer: PeerTarget | None = None,
) -> torch.Tensor:
    """``small_gemm`` (same arguments, checks and result), or the GEMV when ``plan.row1`` is set and x has at most
    ``plan.row1.max_rows`` rows (``uses_gemv``). The choice depends only on the shape, so each CUDA graph records
    one kernel. ``prefetch_act`` reaches ``small_gemm`` only (the GEMV's x chunks are rows). With epilogue
    "publish" the column tiles a ``tp_reduce.reduce_rows`` waits for are ``publish_tile_n(plan, rows)`` wide.

    Raises:
        ValueError: as ``small_gemm`` (every argument is checked there first, on both paths).
    """
    row1 = plan.row1
    if x.dim() != 2 or row1 is None or not uses_gemv(plan, x.shape[0]):
        return small_gemm(x, w, out, plan=plan, epilogue=epilogue, norm_weight=norm_weight, eps=eps,
                          residual=residual, workspace=workspace, counters=counters, use_pdl=use_pdl,
                          prefetch_act=prefetch_act, peer=peer)
    if row1.split_k != 1:
        raise ValueError(f"the one-row GEMV never splits K; plan.row1.split_k is {row1.split_k}")
    if prefetch_act is None:
        prefetch_act_enabled()  # a bad LOWLAT_MEGA_PREFETCH_ACT is refused at every row count
    rows, k, n, _ = check_gemm_args(x, w, out, plan=plan, epilogue=epilogue, norm_weight=norm_weight,
                                 residual=residual, workspace=workspace, counters=counters, split_k=False)
    n_tiles = triton.cdiv(n, row1.block_n)
    check_publish(peer, epilogue, out, n_tiles)
    use_pdl = pdl_enabled(x.device) if use_pdl is None else use_pdl
    res = residual if residual is not None else out
    args = (x, x.stride(0), w, w.stride(0), norm_weight if norm_weight is not None else out, res, res.stride(0),
            out, out.stride(0), n, k, eps)
    meta = dict(NORM_K=k if norm_weight is not None else 0, RSTD_BLOCK=min(triton.next_power_of_2(k), 1024),
                HAS_NORM=norm_weight is not None, EPILOGUE=EPILOGUES[epilogue], BLOCK_N=row1.block_n,
                BLOCK_K=row1.block_k, EVEN_K=k % row1.block_k == 0, USE_PDL=use_pdl, num_warps=row1.num_warps,
                num_stages=row1.num_stages, ROWS=rows, ROWS_P=triton.next_power_of_2(rows),
                **peer_launch_args(peer, out), **launch_kwargs(use_pdl))
    if row1.per_sm:
        _gemv_stream_kernel[(stream_grid(row1, n, x.device),)](*args, CHUNKS=triton.cdiv(k, row1.block_k), **meta)
    else:
        _gemv_kernel[(n_tiles,)](*args, **meta)
    return out


def stream_grid(plan: GemvPlan, n: int, device: torch.device) -> int:
    """Programs of the streaming GEMV: ``plan.per_sm`` per SM of ``device`` (``gemm_plans.num_sms``: 4 on CPU),
    at most one per ``plan.block_n``-row tile of an ``n``-row output."""
    return min(plan.per_sm * num_sms(device), triton.cdiv(n, plan.block_n))


def uses_gemv(plan: GemmPlan, rows: int) -> bool:
    """Whether ``gemm`` runs the GEMV (not ``small_gemm``) for a step of ``rows`` rows under ``plan``: it has a
    ``row1`` and ``rows <= row1.max_rows``."""
    return plan.row1 is not None and rows <= plan.row1.max_rows


def publish_tile_n(plan: GemmPlan, rows: int) -> int:
    """Columns per published tile of ``gemm(..., epilogue="publish")`` at ``rows`` rows: the GEMV's ``block_n``
    where it runs (``uses_gemv``), else ``small_gemm``'s."""
    return plan.row1.block_n if plan.row1 is not None and uses_gemv(plan, rows) else plan.block_n
