"""amd_mono's MoE routing (``kernels.moe.route``) alone under the Triton interpreter, against torch's softmax and
top-k: ties to the lower expert id, renormalization, the slot numbering, and a NaN row routed (NaN ranks first, as
in torch.topk) rather than dropped. Run with TRITON_INTERPRET=1."""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("CPU kernel tests need TRITON_INTERPRET=1 (set before triton is imported)", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from lowlat_amd_mono.kernels.moe import route  # noqa: E402

E, TOPK = 8, 2


@triton.jit
def _route_probe(rl_ptr, w_ptr, sel_ptr, rank_ptr, n_ptr, T, E: tl.constexpr, E_P2: tl.constexpr,
                 TOPK: tl.constexpr, NORM_TOPK: tl.constexpr):
    w, sel, rank, n = route(rl_ptr, T, E, E_P2, TOPK, NORM_TOPK, tl.float32, True, "")
    t = tl.arange(0, 16)
    e = tl.arange(0, E_P2)
    tl.store(w_ptr + t[:, None] * E_P2 + e[None, :], w)
    tl.store(sel_ptr + e, sel)
    tl.store(rank_ptr + e, rank)
    tl.store(n_ptr, n)


def _route(logits: torch.Tensor, norm_topk: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    t = logits.shape[0]
    rl = torch.zeros(8, E)
    rl[:t] = logits
    w, sel, rank, n = torch.empty(16, E), torch.empty(E, dtype=torch.int32), torch.empty(E, dtype=torch.int32), \
        torch.empty(1, dtype=torch.int32)
    _route_probe[(1,)](rl, w, sel, rank, n, t, E=E, E_P2=E, TOPK=TOPK, NORM_TOPK=norm_topk)
    return w[:t], sel, rank, int(n)


@pytest.mark.parametrize("norm_topk", [True, False])
def test_route_matches_torch_topk(norm_topk: bool) -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, E, generator=g)
    logits[2, 5] = logits[2, 1] = logits[2].max() + 1  # a tie for first place: expert 1 before expert 5
    w, sel, rank, n = _route(logits, norm_topk)
    p = torch.softmax(logits, dim=-1)
    vals, ids = torch.topk(p, TOPK, dim=-1)
    if norm_topk:
        vals = vals / vals.sum(-1, keepdim=True)
    want = torch.zeros(5, E).scatter(1, ids, vals)
    torch.testing.assert_close(w, want, atol=1e-6, rtol=1e-6)
    chosen = sorted(set(ids.flatten().tolist()))
    assert n == len(chosen) and sel.nonzero().flatten().tolist() == chosen
    assert [int(rank[e]) for e in chosen] == list(range(n))  # slots in ascending expert id
    assert set(ids[2].tolist()) == {1, 5}


@pytest.mark.parametrize("norm_topk", [True, False])
def test_nan_row_is_routed_not_dropped(norm_topk: bool) -> None:
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, E, generator=g)
    logits[0, 3] = float("nan")
    w, sel, _, n = _route(logits, norm_topk)
    assert int((w[0] != 0).sum()) == TOPK and bool(w[0][w[0] != 0].isnan().all())  # k experts, NaN weights
    p = torch.softmax(logits[1:], dim=-1)
    vals, ids = torch.topk(p, TOPK, dim=-1)
    if norm_topk:
        vals = vals / vals.sum(-1, keepdim=True)
    torch.testing.assert_close(w[1:], torch.zeros(1, E).scatter(1, ids, vals), atol=1e-6, rtol=1e-6)
    assert n == int(sel.sum()) >= TOPK
