"""``mem_overlap.overlaps``: exact for row-strided 2-D views, conservative otherwise (no GPU, no kernels)."""

from __future__ import annotations

import pytest
import torch
from lowlat_nvidia_mega.kernels.mem_overlap import overlaps


def test_row_interleaved_views_of_one_buffer() -> None:
    buf = torch.zeros(4, 10)
    left, right = buf[:, :6], buf[:, 6:]
    assert not overlaps(left, right) and not overlaps(right, left)  # spans intersect, rows do not
    assert overlaps(buf[:, :6], buf[:, 5:])  # column 5 of every row
    assert overlaps(buf[:, :6], buf[3:, 5:6])  # one element, last row
    assert overlaps(buf[3:, 5:6], buf[:, :6])  # the same, operands swapped
    assert not overlaps(buf[1:2, 6:], buf[:, :6])  # one row of the right half against every left row
    assert overlaps(buf[1:3], buf[2:4])  # whole rows
    assert not overlaps(buf[0:2], buf[2:4])  # adjacent, no byte shared


@pytest.mark.parametrize("dtype", [torch.float16, torch.uint8])  # uint8: a row's last byte can start another row
def test_every_pair_of_small_views_agrees_with_a_brute_force(dtype: torch.dtype) -> None:
    buf = torch.zeros(5, 7, dtype=dtype)
    marks = torch.arange(buf.numel()).view(5, 7)
    views = [(slice(r0, r1, rs), slice(c0, c1)) for r0 in range(3) for r1 in (3, 5) for rs in (1, 2)
             for c0 in range(4) for c1 in (4, 7) if c0 < c1]
    for va in views:
        for vb in views:
            a, b = buf[va], buf[vb]
            shared = bool(set(marks[va].flatten().tolist()) & set(marks[vb].flatten().tolist()))
            assert overlaps(a, b) is shared, (va, vb)


def test_conservative_where_not_row_strided_and_never_on_meta() -> None:
    line = torch.zeros(10)
    assert overlaps(line[::3], line[1:2])  # elements 0, 3, 6, 9 against 1: spans intersect, so refused
    assert not overlaps(line[::3], line[10:])
    buf = torch.zeros(6, 6)
    assert overlaps(buf.t()[:, 5:6], buf[5:, 5:])  # column stride 6: buf's last row, span checked
    assert not overlaps(buf[:1], buf[1:])
    meta = torch.empty(4, 4, device="meta")
    assert not overlaps(meta, meta)
    assert not overlaps(buf[:0], buf)
