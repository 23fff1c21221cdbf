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
def _gemv_kernel(
    x_ptr, w_ptr, stride_wn, nw_ptr, res_ptr, out_ptr, N, K, eps,
    data_ptrs, flag_ptrs, tag_ptr, rank, cap, cap_tiles, publish,
    NORM_K: tl.constexpr, RSTD_BLOCK: tl.constexpr, HAS_NORM: tl.constexpr, EPILOGUE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, USE_PDL: tl.constexpr, WORLD: tl.constexpr,
):
    GATED: tl.constexpr = EPILOGUE == 1
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    ks = tl.arange(0, BLOCK_K)
    k_mask = ks < K
    w_rows = w_ptr + offs_n[:, None] * stride_wn
    w0 = load_tile(w_rows + ks[None, :], n_mask, k_mask, EVEN_K)  # weights never depend on the previous kernel
    if GATED:
        w0u = load_tile(w_rows + N * stride_wn + ks[None, :], n_mask, k_mask, EVEN_K)
    gdc_launch_dependents(USE_PDL)
    gdc_wait(USE_PDL)

    rstd = 1.0
    if HAS_NORM:
        rstd = one_row_rstd(x_ptr, NORM_K, eps, RSTD_BLOCK)
    xk = one_row_x(x_ptr, ks, k_mask, rstd, nw_ptr, HAS_NORM).to(tl.float32)[None, :]
    acc = tl.sum(w0.to(tl.float32) * xk, 1)
    acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
    if GATED:
        acc_u = tl.sum(w0u.to(tl.float32) * xk, 1)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        kl = k0 + tl.arange(0, BLOCK_K)
        kl_mask = kl < K
        w = load_tile(w_rows + kl[None, :], n_mask, kl_mask, EVEN_K)
        if GATED:
            wu = load_tile(w_rows + N * stride_wn + kl[None, :], n_mask, kl_mask, EVEN_K)
        xl = one_row_x(x_ptr, kl, kl_mask, rstd, nw_ptr, HAS_NORM).to(tl.float32)[None, :]
        acc += tl.sum(w.to(tl.float32) * xl, 1)
        if GATED:
            acc_u += tl.sum(wu.to(tl.float32) * xl, 1)
    offs_m = tl.arange(0, 1)
    o_mask = n_mask[None, :]
    if EPILOGUE == 3:
        publish_epilogue(acc[None, :], offs_m, offs_n, o_mask, N, out_ptr.dtype.element_ty, data_ptrs, flag_ptrs,
                         tag_ptr, rank, cap, cap_tiles, pid, publish, WORLD)
    else:
        _gemm_epilogue(acc[None, :], acc_u[None, :], offs_m, offs_n, o_mask, out_ptr, 0, res_ptr, 0, EPILOGUE)


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
    x_ptr, w_ptr, stride_wn, nw_ptr, res_ptr, out_ptr, N, K, eps,
    data_ptrs, flag_ptrs, tag_ptr, rank, cap, cap_tiles, publish,
    NORM_K: tl.constexpr, RSTD_BLOCK: tl.constexpr, HAS_NORM: tl.constexpr, EPILOGUE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNKS: tl.constexpr, EVEN_K: tl.constexpr,
    USE_PDL: tl.constexpr, WORLD: tl.constexpr,
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
        rstd = one_row_rstd(x_ptr, NORM_K, eps, RSTD_BLOCK)
    x_once = one_row_x(x_ptr, ks, ks < K, rstd, nw_ptr, HAS_NORM).to(tl.float32)[None, :]
    for t in range(0, my_tiles):
        tile = pid + t * grid
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
        for c in tl.static_range(CHUNKS):
            w = w_nx
            wu = wu_nx
            if c + 1 < CHUNKS:  # the ring: request the next item before this one is multiplied
                w_nx, wu_nx = _stream_load(w_ptr, stride_wn, tile, c + 1, N, K, GATED, BLOCK_N, BLOCK_K, EVEN_K)
            else:
                w_nx, wu_nx = _stream_load(w_ptr, stride_wn, tile + grid, 0, N, K, GATED, BLOCK_N, BLOCK_K, EVEN_K)
            xk = x_once
            if c > 0:
                kl = c * BLOCK_K + ks
                xk = one_row_x(x_ptr, kl, kl < K, rstd, nw_ptr, HAS_NORM).to(tl.float32)[None, :]
            acc += tl.sum(w.to(tl.float32) * xk, 1)
            if GATED:
                acc_u += tl.sum(wu.to(tl.float32) * xk, 1)
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, 1)
        o_mask = (offs_n < N)[None, :]
        if EPILOGUE == 3:
            publish_epilogue(acc[None, :], offs_m, offs_n, o_mask, N, out_ptr.dtype.element_ty, data_ptrs,
                             flag_ptrs, tag_ptr, rank, cap, cap_tiles, tile, publish, WORLD)
        else:
            _gemm_epilogue(acc[None, :], acc_u[None, :], offs_m, offs_n, o_mask, out_ptr, 0, res_ptr, 0, EPILOGUE)


def gemm(
    x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, *, plan: GemmPlan, epilogue: str = "none",
    norm_weight: torch.Tensor | None = None, eps: float = 1e-6, residual: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None, counters: torch.Tensor | None = None, use_pdl: bool | None = None,
    prefetch_act: bool | None = None, peer: PeerTarget | None = None,
) -> torch.Tensor:
    """``small_gemm`` (same arguments, checks and result), or the one-row GEMV when x has one row and
    ``plan.row1`` is set. The choice depends only on the shape, so each CUDA graph records one kernel.
    ``prefetch_act`` reaches ``small_gemm`` only (the GEMV's x chunk is one row). With epilogue "publish" the
    column tiles a ``tp_reduce.reduce_rows`` waits for are ``publish_tile_n(plan, rows)`` wide.

    Raises:
        ValueError: as ``small_gemm`` (every argument is checked there first, on both paths).
    """
    row1 = plan.row1
    if x.dim() != 2 or x.shape[0] != 1 or row1 is None:
        return small_gemm(x, w, out, plan=plan, epilogue=epilogue, norm_weight=norm_weight, eps=eps,
                          residual=residual, workspace=workspace, counters=counters, use_pdl=use_pdl,
                          prefetch_act=prefetch_act, peer=peer)
    if row1.split_k != 1:
        raise ValueError(f"the one-row GEMV never splits K; plan.row1.split_k is {row1.split_k}")
    if prefetch_act is None:
        prefetch_act_enabled()  # a bad LOWLAT_MEGA_PREFETCH_ACT is refused at every row count
    _, k, n, _ = check_gemm_args(x, w, out, plan=plan, epilogue=epilogue, norm_weight=norm_weight,
                                 residual=residual, workspace=workspace, counters=counters, split_k=False)
    n_tiles = triton.cdiv(n, row1.block_n)
    check_publish(peer, epilogue, out, n_tiles)
    use_pdl = pdl_enabled(x.device) if use_pdl is None else use_pdl
    args = (x, w, w.stride(0), norm_weight if norm_weight is not None else out,
            residual if residual is not None else out, out, n, k, eps)
    meta = dict(NORM_K=k if norm_weight is not None else 0, RSTD_BLOCK=min(triton.next_power_of_2(k), 1024),
                HAS_NORM=norm_weight is not None, EPILOGUE=EPILOGUES[epilogue], BLOCK_N=row1.block_n,
                BLOCK_K=row1.block_k, EVEN_K=k % row1.block_k == 0, USE_PDL=use_pdl, num_warps=row1.num_warps,
                num_stages=row1.num_stages, **peer_launch_args(peer, out), **launch_kwargs(use_pdl))
    if row1.per_sm:
        _gemv_stream_kernel[(stream_grid(row1, n, x.device),)](*args, CHUNKS=triton.cdiv(k, row1.block_k), **meta)
    else:
        _gemv_kernel[(n_tiles,)](*args, **meta)
    return out


def stream_grid(plan: GemvPlan, n: int, device: torch.device) -> int:
    """Programs of the streaming GEMV: ``plan.per_sm`` per SM of ``device`` (``gemm_plans.num_sms``: 4 on CPU),
    at most one per ``plan.block_n``-row tile of an ``n``-row output."""
    return min(plan.per_sm * num_sms(device), triton.cdiv(n, plan.block_n))


def publish_tile_n(plan: GemmPlan, rows: int) -> int:
    """Columns per published tile of ``gemm(..., epilogue="publish")`` at ``rows`` rows: the one-row GEMV's
    ``block_n`` where it runs, else ``small_gemm``'s."""
    return plan.row1.block_n if rows == 1 and plan.row1 is not None else plan.block_n
