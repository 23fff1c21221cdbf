"""Whether two tensors share memory: the aliasing test of the GEMM launchers' argument checks (``small_gemm``)."""

from __future__ import annotations

import torch


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` (same device) share a byte. Exact for 2-D tensors with unit column stride and positive
    row strides (their rows are byte intervals: two row-interleaved views of one buffer, e.g. its left and right
    columns, do not overlap); otherwise whether their first-to-last spans intersect (conservative). Meta tensors (the
    compile checks' stand-ins) have no memory, so never."""
    if a.device != b.device or a.device.type == "meta" or a.numel() == 0 or b.numel() == 0:
        return False

    def span(t: torch.Tensor) -> tuple[int, int]:
        size = t.element_size()
        last = sum((d - 1) * st for d, st in zip(t.shape, t.stride(), strict=True))
        return t.data_ptr(), t.data_ptr() + (last + 1) * size
    (a0, a1), (b0, b1) = span(a), span(b)
    if not (a0 < b1 and b0 < a1):
        return False
    ra, rb = _row_intervals(a), _row_intervals(b)
    if ra is None or rb is None:
        return True
    if ra[3] > rb[3]:
        ra, rb = rb, ra
    (pa, sa, la, ma), (pb, sb, lb, mb) = ra, rb
    if ma > 4096:  # two tall strided tensors: not worth the loop, stay conservative
        return True
    for i in range(ma):  # does row i of a meet some row j of b: pb + j*sb < hi and pb + j*sb + lb > lo
        lo = pa + i * sa
        hi = lo + la
        j_lo = max(0, -(-(lo - lb + 1 - pb) // sb))
        j_hi = min(mb - 1, (hi - 1 - pb) // sb)
        if j_lo <= j_hi:
            return True
    return False


def _row_intervals(t: torch.Tensor) -> tuple[int, int, int, int] | None:
    """(first byte, row stride, row length, rows) in bytes of a 2-D tensor with unit column stride and a positive row
    stride (any stride for a single row), else None."""
    if t.dim() != 2 or t.stride(1) != 1:
        return None
    rows, cols = t.shape
    size = t.element_size()
    stride = t.stride(0) * size if rows > 1 else 1
    return (t.data_ptr(), stride, cols * size, rows) if stride > 0 else None
