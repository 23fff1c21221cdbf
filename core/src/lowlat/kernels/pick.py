"""The step's picks and the non-finite guard in one read: greedy argmax and "row is all finite" flags, packed.

    out[r]     = argmax_v rows[r, v]       (the first index of the maximum, as ``torch.argmax``), or ``picked[r]``
    out[R + r] = 1 if every rows[r, :] is finite else 0
    out: [2R] int64, the layout of ``lowlat.runtime.step_guard.packed_picks`` (one device-to-host copy reads both)

``packed_picks`` in torch is five kernels per step (argmax, isfinite, all, two casts and a cat; about 45 µs of
device time at one row of a 128256-word vocabulary on the H200, most of it in the two single-row reductions;
bench/results/2026-12-01-h200-spec-ngram-qwen-serve/overlap_diag2.txt). This is two: a split reduction over
``cdiv(V, BLOCK)`` column blocks per row (each block's maximum, its first index and its finiteness), then one
program per row combining them in block order (the first block holding the maximum wins, so ties resolve to
the lowest index as in torch). Non-finite values take no part in the maximum; a row with any of them is
flagged 0 and its id is meaningless (the engine raises NonFiniteLogits on it).

Grid: ``(R, cdiv(V, BLOCK))`` then ``(R,)``.

``pack_ids`` is the same layout for ids a sampling plugin returned (plugin API 3: -1 marks a row whose logits were
not all finite): ``out[r] = ids[r]``, ``out[R + r] = 1 if 0 <= ids[r] < V else 0``, and the ids the next step feeds
on (``ids[r]`` where flagged 1, else 0), in one launch of one program where torch took six kernels (a clamp, two
compares, an and, a cast and a cat: 21 µs of the overlapped step's device time at batch 1 on the H200 with the
copy out, against 12 µs for the general path's pick; bench/results/2026-12-01-h200-e2e-gptfast-drift).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowlat.kernels._launch import check_cpu_launch, check_row_major

__all__ = ["pack_ids", "pick_packed"]

_BLOCK = 4096


@triton.jit
def _pick_blocks_kernel(x_ptr, stride_x, n_cols, bmax_ptr, bidx_ptr, bfin_ptr, n_blocks, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    finite = tl.abs(x) < float("inf")  # False for NaN and +-inf
    bad = tl.sum((mask & ~finite).to(tl.int32), axis=0)
    xs = tl.where(mask & finite, x, float("-inf"))
    top = tl.max(xs, axis=0)
    first = tl.min(tl.where(mask & (xs == top), offs, n_cols), axis=0)
    out = row * n_blocks + blk
    tl.store(bmax_ptr + out, top)
    tl.store(bidx_ptr + out, first.to(tl.int64))
    tl.store(bfin_ptr + out, (bad == 0).to(tl.int32))


@triton.jit
def _pick_rows_kernel(bmax_ptr, bidx_ptr, bfin_ptr, picked_ptr, out_ptr, n_rows, n_cols, n_blocks,
                      HAS_PICKED: tl.constexpr, NB: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    o = tl.arange(0, NB)
    mask = o < n_blocks
    m = tl.load(bmax_ptr + row * n_blocks + o, mask=mask, other=float("-inf"))
    i = tl.load(bidx_ptr + row * n_blocks + o, mask=mask, other=n_cols)
    f = tl.load(bfin_ptr + row * n_blocks + o, mask=mask, other=1)
    top = tl.max(m, axis=0)
    first = tl.min(tl.where(mask & (m == top), i, n_cols), axis=0)
    if HAS_PICKED:
        first = tl.load(picked_ptr + row)
    tl.store(out_ptr + row, first.to(tl.int64))
    tl.store(out_ptr + n_rows + row, tl.min(f, axis=0).to(tl.int64))


@triton.jit
def _pack_ids_kernel(ids_ptr, out_ptr, fed_ptr, n_rows, vocab, BLOCK: tl.constexpr):
    for start in range(0, n_rows, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n_rows
        i = tl.load(ids_ptr + offs, mask=mask, other=0).to(tl.int64)
        tl.store(out_ptr + offs, i, mask=mask)
        ok = (i >= 0) & (i < vocab)
        tl.store(out_ptr + n_rows + offs, ok.to(tl.int64), mask=mask)
        tl.store(fed_ptr + offs, tl.where(ok, i, 0), mask=mask)


def pack_ids(ids: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A sampling plugin's ids packed for one host read, and the ids the next step feeds on.

    Args:
        ids: integer ``[R]`` (or any shape of R elements, in row order) sampled ids, -1 where the plugin flagged
            a row; on CUDA, or on CPU under TRITON_INTERPRET=1.
        vocab: the vocabulary size V (an id outside [0, V) is flagged 0).
    Returns:
        ``(packed, fed)``: int64 ``[2R]`` (the ids, then 1/0 per row for "id in [0, V)") and int64 ``[R]``: the id
        where it lies in [0, V), else 0 (a flagged row feeds id 0, which any embedding can index).
    Raises:
        ValueError: CPU tensors without the interpreter.
    """
    flat = ids.reshape(-1)  # a copy only for a non-contiguous view
    if flat.device.type == "cpu":
        check_cpu_launch("pack_ids", _pack_ids_kernel)
    n = flat.numel()
    out = torch.empty(2 * n, dtype=torch.int64, device=flat.device)
    fed = torch.empty(n, dtype=torch.int64, device=flat.device)
    if n:
        _pack_ids_kernel[(1,)](flat, out, fed, n, vocab, BLOCK=min(1024, triton.next_power_of_2(n)))
    return out, fed


def pick_packed(rows: torch.Tensor, picked: torch.Tensor | None = None) -> torch.Tensor:
    """Greedy picks (or the given ``picked``) and finiteness flags of ``rows``, packed for one host read.

    Args:
        rows: float logits ``[R, V]`` (float32, bfloat16 or float16), contiguous in V; on CUDA, or on CPU under
            TRITON_INTERPRET=1.
        picked: optional int64 ``[R]`` ids chosen elsewhere (a sampler); when given, out[:R] is a copy of it.
    Returns:
        int64 ``[2R]``: the ids (first index of the row maximum, as ``torch.argmax``, when ``picked`` is None),
        then 1/0 per row for "all finite".
    Raises:
        ValueError: rows not 2-D, not contiguous in V, picked of the wrong shape, or CPU tensors without the
            interpreter.
    """
    if rows.dim() != 2:
        raise ValueError(f"rows must be [R, V] logits, got shape {tuple(rows.shape)}")
    check_row_major("rows", rows)
    n_rows, n_cols = rows.shape
    if picked is not None and (picked.shape != (n_rows,) or picked.device != rows.device):
        raise ValueError(f"picked must be [{n_rows}] on {rows.device}, got {tuple(picked.shape)} on {picked.device}")
    if rows.device.type == "cpu":
        check_cpu_launch("pick_packed", _pick_blocks_kernel)
    n_blocks = triton.cdiv(max(n_cols, 1), _BLOCK)
    dev = rows.device
    bmax = torch.empty(n_rows * n_blocks, dtype=torch.float32, device=dev)
    bidx = torch.empty(n_rows * n_blocks, dtype=torch.int64, device=dev)
    bfin = torch.empty(n_rows * n_blocks, dtype=torch.int32, device=dev)
    out = torch.empty(2 * n_rows, dtype=torch.int64, device=dev)
    if n_rows == 0:
        return out
    _pick_blocks_kernel[(n_rows, n_blocks)](rows, rows.stride(0), n_cols, bmax, bidx, bfin, n_blocks,
                                           BLOCK=_BLOCK)
    p = picked.to(torch.int64).contiguous() if picked is not None else out
    _pick_rows_kernel[(n_rows,)](bmax, bidx, bfin, p, out, n_rows, n_cols, n_blocks, HAS_PICKED=picked is not None,
                                 NB=triton.next_power_of_2(n_blocks))
    return out
