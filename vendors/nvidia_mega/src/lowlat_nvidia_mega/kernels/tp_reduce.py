"""The consumer of epilogue publishing: wait per tile, sum the ranks in order, add the residual, normalize.

``reduce_rows`` runs right after a "publish" GEMM (``tp_epilogue``) at tp_size > 1, one program per row::

    o[t, :]  = rnd(sum over ranks s = 0 .. W-1 of partial_s[t, :])   (fp32, rank order, rounded once)
    x[t, :]  = rnd(x[t, :] + o[t, :])                                (the residual stream, in place)
    h[t, :]  = nw * rnd(x[t, :] * rsqrt(mean(x[t, :]^2) + eps))      (HF RMSNorm; only with a norm weight)

The sum order and every rounding are those of the general path's ``all_reduce(F.linear(...))`` followed by its
residual add and norm (for two ranks the bf16 sum is rounded once either way), and every rank adds the same
values in the same order, so ``x`` and ``h`` are bit-identical on every rank. Each chunk of ``CHUNK`` columns is
read once every rank's flags of the GEMM's column tiles in that chunk hold the call's tag
(``lowlat.plugin.peer.wait_tiles``, ``CHUNK / TILE_N`` tiles polled together, bounded by the buffers' deadline). A
wait that gives up writes NaN into the chunk (the engine then raises ``PeerWaitTimeout`` from the error record,
naming the rank, the peer and ``site``). This launch ends the call: its last program advances the device tag.

PDL: it triggers its dependents at once (the next GEMM prefetches its weights) and waits for the publishing GEMM
before it polls; the next kernel's ``gdc_wait`` then waits for this one to finish.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowlat_nvidia_mega.kernels.pdl import gdc_launch_dependents, gdc_wait, launch_kwargs, pdl_enabled
from lowlat_nvidia_mega.kernels.rounding import rnd, to_act
from lowlat_nvidia_mega.kernels.tp_epilogue import PeerTarget

try:
    from lowlat.plugin.peer import device_tag, finish_call, wait_tiles
except ImportError:  # a core before plugin API 4: tp_size stays 1 (specs.py), so this kernel never launches
    device_tag = finish_call = wait_tiles = None  # type: ignore[assignment]


@triton.jit(do_not_specialize=["rank", "deadline", "site"])
def _reduce_rows_kernel(
    x_ptr, stride_x, nw_ptr, h_ptr, stride_h, data_ptrs, flag_ptrs, ctl_ptr, tag_ptr,
    N, cap, cap_tiles, rank, deadline, site, eps,
    WORLD: tl.constexpr, WPAD: tl.constexpr, TILE_N: tl.constexpr, CHUNK: tl.constexpr, HAS_NORM: tl.constexpr,
    TIMER: tl.constexpr, USE_PDL: tl.constexpr,
):
    row = tl.program_id(0)
    gdc_launch_dependents(USE_PDL)
    gdc_wait(USE_PDL)
    tag = device_tag(tag_ptr, 0)
    parity = tag & 1
    dt = x_ptr.dtype.element_ty
    own_data = tl.load(data_ptrs + rank).to(tl.pointer_type(dt))
    own_flags = tl.load(flag_ptrs + rank).to(tl.pointer_type(tl.int32))
    cols = tl.arange(0, CHUNK)
    ss = tl.zeros([CHUNK], tl.float32)
    for c0 in range(0, N, CHUNK):
        offs = c0 + cols
        mask = offs < N
        t0 = c0 // TILE_N
        ready = wait_tiles(own_flags + (parity * cap_tiles + t0) * WORLD, tag, ctl_ptr, deadline, rank, t0, site,
                           tl.cdiv(N, TILE_N) - t0, WORLD, WPAD, TIMER, CHUNK // TILE_N)
        acc = tl.zeros([CHUNK], tl.float32)
        for s in tl.static_range(WORLD):
            v = tl.load(own_data + (parity * WORLD + s).to(tl.int64) * cap + row * N + offs, mask=mask, other=0.0)
            acc += v.to(tl.float32)
        r = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
        y = rnd(rnd(acc, dt) + r.to(tl.float32), dt)
        y = tl.where(ready, y, float("nan"))
        tl.store(x_ptr + row * stride_x + offs, to_act(y, dt), mask=mask)
        ss += tl.where(mask, y * y, 0.0)
    if HAS_NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(ss, 0) / N + eps)
        for c0 in range(0, N, CHUNK):
            offs = c0 + cols
            mask = offs < N
            xv = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
            nw = tl.load(nw_ptr + offs, mask=mask, other=0.0)
            hv = rnd(xv.to(tl.float32) * rstd, dt)
            tl.store(h_ptr + row * stride_h + offs, to_act(nw.to(tl.float32) * hv, dt), mask=mask)
    finish_call(tag_ptr, tag, tl.num_programs(0))


def reduce_rows(peer: PeerTarget, x: torch.Tensor, *, tile_n: int, site: int, norm_weight: torch.Tensor | None = None,
                h: torch.Tensor | None = None, eps: float = 1e-6, use_pdl: bool | None = None) -> torch.Tensor:
    """Finish a published row-parallel GEMM: ``x += rank-order sum of the partials``, then ``h = RMSNorm(x)``.

    Args:
        peer: the PeerTarget the GEMM published to (its buffers' rank, world, deadline).
        x: [T, N] residual stream (model dtype, unit column stride), updated in place; T <= 8.
        tile_n: columns per tile the GEMM published (``gemv.publish_tile_n``): a power of two.
        site: this all-reduce's call site (``2 * layer + k``), copied into the error record.
        norm_weight: [N] RMSNorm weight of the next GEMM's input (writes ``h``), or None (``h`` untouched).
        h: [T, N] output of the norm (with ``norm_weight``).
        eps: RMSNorm epsilon. use_pdl: default ``pdl_enabled(x.device)``.
    Returns:
        ``h`` with a norm weight, else ``x``.
    Raises:
        ValueError: shapes, dtypes or a tile width the buffers cannot serve (named).
    """
    b = peer.bufs
    t, n = x.shape
    if x.stride(1) != 1 or x.dtype != b.dtype or x.numel() > b.capacity:
        raise ValueError(f"x must be [T, N] {b.dtype} with unit column stride and <= {b.capacity} elements, got "
                         f"{tuple(x.shape)} {x.dtype} strides {x.stride()}")
    if tile_n < 1 or tile_n & (tile_n - 1) or triton.cdiv(n, tile_n) > peer.cap_tiles:
        raise ValueError(f"tile_n must be a power of two with ceil({n} / tile_n) <= {peer.cap_tiles} flag tiles, "
                         f"got {tile_n}")
    if (norm_weight is None) != (h is None) or (h is not None and (h.shape != x.shape or h.stride(1) != 1)):
        raise ValueError("norm_weight and h come together; h must be shaped like x with unit column stride")
    use_pdl = pdl_enabled(x.device) if use_pdl is None else use_pdl
    chunk = max(tile_n, min(1024, triton.next_power_of_2(n)))
    _reduce_rows_kernel[(t,)](
        x, x.stride(0), norm_weight if norm_weight is not None else x, h if h is not None else x,
        h.stride(0) if h is not None else 0, b.data_ptrs, b.flag_ptrs, b.ctl, b.tag_state,
        n, b.capacity, peer.cap_tiles, b.rank, b.deadline, site, eps,
        WORLD=b.world, WPAD=triton.next_power_of_2(b.world), TILE_N=tile_n, CHUNK=chunk,
        HAS_NORM=norm_weight is not None, TIMER=b.timer, USE_PDL=use_pdl, num_warps=4, **launch_kwargs(use_pdl),
    )
    return h if h is not None else x
