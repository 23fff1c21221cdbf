"""lowlat.kernels.pick (greedy argmax + "row is all finite", packed) against torch, under the interpreter on CPU.

The ids must be ``torch.argmax``'s (the first index of the maximum, also across the kernel's column blocks) and
the flags ``torch.isfinite(rows).all(-1)``'s; on a GPU the same file runs on CUDA (``gpu`` marker).
"""

from __future__ import annotations

import pytest
import torch
from lowlat.kernels.pick import _BLOCK, pack_ids, pick_packed
from lowlat.runtime.step_guard import packed_ids, packed_picks

pytestmark = pytest.mark.gpu  # also run on a GPU: python bench/gpu_jobs.py gpu-tests
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: the interpreter (conftest.py)


def want(rows: torch.Tensor, picked: torch.Tensor | None = None) -> torch.Tensor:
    ids = torch.argmax(rows.float(), dim=-1) if picked is None else picked
    return torch.cat([ids.to(torch.int64), torch.isfinite(rows).all(dim=-1).to(torch.int64)])


@pytest.mark.parametrize("shape", [(1, 7), (3, _BLOCK), (2, 2 * _BLOCK + 5), (5, 300)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ids_and_flags_equal_torch(shape, dtype):
    rows = torch.randn(shape, generator=torch.Generator().manual_seed(shape[1])).to(DEV, dtype)
    assert torch.equal(pick_packed(rows).cpu(), want(rows).cpu())


def test_ties_resolve_to_the_lowest_index_within_and_across_blocks():
    v = 2 * _BLOCK + 5
    rows = torch.zeros(4, v, device=DEV)
    rows[0, [3, 9]] = 5.0  # within the first block
    rows[1, [_BLOCK + 1, 2 * _BLOCK + 2]] = 5.0  # second and third block: the second wins
    rows[2, [_BLOCK - 1, _BLOCK]] = 5.0  # either side of a block boundary
    rows[3, :] = -1.0  # all equal: index 0
    got = pick_packed(rows).cpu()
    assert got[:4].tolist() == [3, _BLOCK + 1, _BLOCK - 1, 0]
    assert torch.equal(got, want(rows).cpu())


def test_non_finite_rows_are_flagged_and_their_ids_stay_in_the_vocabulary():
    v = _BLOCK + 3
    rows = torch.randn(5, v, generator=torch.Generator().manual_seed(0)).to(DEV)
    rows[1, 7] = float("nan")
    rows[2, v - 1] = float("inf")  # +inf in the last, partial block
    rows[3, 0] = float("-inf")
    rows[4, :] = float("nan")
    got = pick_packed(rows).cpu()
    assert got[5:].tolist() == [1, 0, 0, 0, 0]
    assert got[0] == torch.argmax(rows[0]).item()
    assert all(0 <= i < v for i in got[:5].tolist())  # the overlapped loop feeds them to the next step


def test_given_picks_are_packed_with_the_flags():
    rows = torch.randn(3, 50, device=DEV)
    rows[2, 4] = float("nan")
    picked = torch.tensor([7, 0, 49], device=DEV)
    assert pick_packed(rows, picked).cpu().tolist() == [7, 0, 49, 1, 1, 0]


def test_no_rows():
    assert pick_packed(torch.empty(0, 10, device=DEV)).numel() == 0


@pytest.mark.parametrize("bad, match", [
    (lambda: pick_packed(torch.zeros(10, device=DEV)), r"\[R, V\]"),
    (lambda: pick_packed(torch.zeros(10, 4, device=DEV).t()), "contiguous"),
    (lambda: pick_packed(torch.zeros(2, 4, device=DEV), torch.zeros(3, dtype=torch.int64, device=DEV)), "picked"),
])
def test_broken_inputs_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()


def test_packed_picks_is_the_same_with_and_without_the_kernel():
    """step_guard.packed_picks: the kernel on CUDA, torch elsewhere; greedy when picked is None."""
    rows = torch.randn(4, 1000, device=DEV)
    rows[3, 5] = float("inf")
    got, ref = packed_picks(rows).cpu(), want(rows).cpu()
    # a flagged row's id is not torch's (inf takes no part in the kernel's maximum) and is never served
    assert torch.equal(got[4:], ref[4:]) and got[4:].tolist() == [1, 1, 1, 0]
    assert torch.equal(got[:3], ref[:3]) and 0 <= got[3] < 1000
    picked = torch.tensor([1, 2, 3, 4], device=DEV)
    assert torch.equal(packed_picks(rows, picked).cpu(), want(rows, picked).cpu())


# -- pack_ids: a sampling plugin's ids (-1 flags a row) ---------------------------------------------------------------


def _torch_pack(ids: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    i = ids.reshape(-1).to(torch.int64)
    ok = (i >= 0) & (i < vocab)
    return torch.cat([i, ok.to(torch.int64)]), torch.where(ok, i, 0)


@pytest.mark.parametrize("n", [1, 5, 8, 1024, 1500])  # 1500: more rows than one 1024-wide block
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_pack_ids_equals_torch_and_flags_every_row_outside_the_vocabulary(n, dtype):
    vocab = 50
    ids = torch.randint(-3, vocab + 3, (n,), generator=torch.Generator().manual_seed(n)).to(DEV, dtype)
    ids[0] = -1  # the plugin's flag for non-finite logits
    if n > 1:
        ids[-1] = vocab  # one past the vocabulary
    packed, fed = pack_ids(ids, vocab)
    want_packed, want_fed = _torch_pack(ids.cpu(), vocab)
    assert packed.dtype == fed.dtype == torch.int64
    assert torch.equal(packed.cpu(), want_packed) and torch.equal(fed.cpu(), want_fed)
    assert packed[n].item() == 0 and fed[0].item() == 0  # flagged, and it feeds id 0
    if n > 1:  # one past the vocabulary: flagged, and it feeds 0 (the next step's embedding must index it)
        assert packed[2 * n - 1].item() == 0 and fed[-1].item() == 0
    assert int(fed.max()) < vocab and int(fed.min()) >= 0


def test_pack_ids_of_no_rows_and_of_a_strided_view():
    packed, fed = pack_ids(torch.empty(0, dtype=torch.int64, device=DEV), 10)
    assert packed.numel() == 0 and fed.numel() == 0
    view = torch.arange(-1, 11, device=DEV).view(3, 4).t()  # row order of the view, not of its storage
    packed, fed = pack_ids(view, 10)
    want_packed, want_fed = _torch_pack(view.cpu(), 10)
    assert torch.equal(packed.cpu(), want_packed) and torch.equal(fed.cpu(), want_fed)


def test_packed_ids_is_the_same_with_and_without_the_kernel():
    ids = torch.tensor([3, -1, 7, 9, 12], device=DEV)
    got = packed_ids(ids, 10)  # the kernel on CUDA, torch on a CPU
    want_packed, want_fed = _torch_pack(ids.cpu(), 10)
    assert torch.equal(got[0].cpu(), want_packed) and torch.equal(got[1].cpu(), want_fed)
    via_kernel = pack_ids(ids, 10)
    assert torch.equal(via_kernel[0].cpu(), want_packed) and torch.equal(via_kernel[1].cpu(), want_fed)
