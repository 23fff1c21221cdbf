"""Paged decode attention: against a torch reference, and the fused split merge against the two-kernel path.

Runs on CPU under ``TRITON_INTERPRET=1`` (tiny shapes) and, unchanged, on a CUDA GPU. Outputs are poisoned
(NaN) beyond the rows a kernel may write, and the split workspaces before each launch.

The interpreter runs a grid's programs one at a time in grid order, so the last split of each (request, KV
head) would always be the last to arrive, and a merge in arrival order would look like one in split order.
The ``arrival`` fixture therefore also runs the grid reversed and shuffled (it permutes the program ids the
interpreter hands out); on a GPU the order is the hardware's and the fixture does nothing.
"""

from __future__ import annotations

import random

import pytest
import torch
from lowlat.layers.attention import decode_attention_torch
from lowlat_nvidia_mega.kernels import attention, pdl
from lowlat_nvidia_mega.kernels.attention import merge_counters_numel, paged_decode_attention, partial_numel

pytestmark = pytest.mark.gpu  # also run on a GPU: python bench/gpu_jobs.py gpu-tests

if not pdl.interpreting() and not torch.cuda.is_available():
    pytest.skip("Triton kernels need a CUDA GPU or TRITON_INTERPRET=1", allow_module_level=True)

DEV = torch.device("cpu" if pdl.interpreting() else "cuda")
D, MAX_LEN, SLOTS = 32, 600, 2048


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 2e-2}


@pytest.fixture(params=["grid", "reversed", "shuffled"])
def arrival(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The order the interpreter runs programs in: grid order, reversed, or a seeded shuffle (per grid shape)."""
    if request.param == "grid" or not pdl.interpreting():
        return request.param
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    set_idx = builder.set_grid_idx
    perms: dict[tuple[int, int, int], list[int]] = {}

    def permuted(x: int, y: int, z: int) -> None:
        nx, ny, nz = builder.grid_dim
        n = nx * ny * nz
        if (nx, ny, nz) not in perms:
            order = list(range(n))[::-1]
            if request.param == "shuffled":
                random.Random(n).shuffle(order)
            perms[(nx, ny, nz)] = order
        i = perms[(nx, ny, nz)][(x * ny + y) * nz + z]
        set_idx(i // (ny * nz), (i // nz) % ny, i % nz)

    monkeypatch.setattr(builder, "set_grid_idx", permuted)
    return request.param


def _case(batch: int, rows: int, hq: int, hkv: int, dtype: torch.dtype, seed: int):  # type: ignore[no-untyped-def]
    """q [B*R, Hq, D], K/V pools, slot map, request rows and lengths: request 0 holds only this step's rows,
    the others random lengths up to MAX_LEN (several 64-position blocks per split)."""
    g = torch.Generator().manual_seed(seed)
    kb = torch.randn(SLOTS, hkv, D, generator=g).to(dtype=dtype, device=DEV)
    vb = torch.randn(SLOTS, hkv, D, generator=g).to(dtype=dtype, device=DEV)
    rtt = torch.stack([torch.randperm(SLOTS - 1, generator=g)[:MAX_LEN] + 1 for _ in range(batch + 2)])
    rpi = torch.randperm(batch + 2, generator=g)[:batch]
    seq = torch.randint(rows, MAX_LEN, (batch,), generator=g).to(torch.int32)
    seq[0] = rows
    q = torch.randn(batch * rows, hq, D, generator=g).to(dtype=dtype, device=DEV)
    return q, kb, vb, rtt.to(torch.int32).to(DEV), rpi.to(DEV), seq.to(DEV)


def _run(case, rows: int, splits: int, fused: bool, counters: torch.Tensor | None = None,  # type: ignore[no-untyped-def]
         out: torch.Tensor | None = None) -> torch.Tensor:
    """One launch on NaN-poisoned workspaces; returns the [8, Hq * D] output buffer (rows >= T must stay NaN)."""
    q, kb, vb, rtt, rpi, seq = case
    b, hq, hkv = seq.shape[0], q.shape[1], kb.shape[1]
    n_o, n_l = partial_numel(b, hq, hkv, D, rows, splits)
    buf = torch.full((8, hq * D), float("nan"), dtype=q.dtype, device=DEV) if out is None else out
    if fused and counters is None:
        counters = torch.zeros(merge_counters_numel(b, hkv), dtype=torch.int32, device=DEV)
    paged_decode_attention(q, kb, vb, rtt, rpi, seq, buf[:b * rows], rows_per_req=rows, sm_scale=D ** -0.5,
                           num_splits=splits, o_partial=torch.full((n_o,), float("nan"), device=DEV),
                           lse_partial=torch.full((n_l,), float("nan"), device=DEV), counters=counters,
                           fused_merge=fused)
    return buf


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


# (requests, rows per request, KV splits): DECODE and VERIFY, one and several splits
TORCH_CASES = [(1, 1, 4), (3, 1, 1), (1, 3, 4), (8, 1, 4), (2, 4, 1)]


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "two-kernel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,rows,splits", TORCH_CASES)
def test_paged_decode_attention_matches_torch(dtype: torch.dtype, batch: int, rows: int, splits: int,
                                              fused: bool) -> None:
    case = _case(batch, rows, 4, 2, dtype, seed=20 + batch * 8 + rows)
    q, kb, vb, rtt, rpi, seq = case
    kb0, vb0 = kb.clone(), vb.clone()
    t = batch * rows
    buf = _run(case, rows, splits, fused)
    ref = decode_attention_torch(q, kb, vb, rtt, rpi, seq, rows, D ** -0.5)
    torch.testing.assert_close(buf[:t].view(t, 4, D).float(), ref.float(), **_tol(dtype))
    assert torch.isnan(buf[t:].float()).all(), "rows beyond T were written"
    assert torch.equal(kb, kb0) and torch.equal(vb, vb0), "attention must not write the KV pool"


# (requests, rows, query heads, KV heads, splits): DECODE at B = 1, 3, 8 and VERIFY at R = 2, 3, 8; GQA groups
# of 2 and 4 (G * R from 2 to 16); one split (direct write), several, and 16 (two chunks of the fused merge)
MERGE_CASES = [(1, 1, 4, 2, 4), (3, 1, 8, 2, 8), (8, 1, 4, 2, 2), (2, 2, 8, 2, 16), (1, 3, 4, 2, 8),
               (1, 8, 4, 2, 4), (2, 3, 8, 2, 1), (4, 2, 4, 1, 4)]
MERGE_CASES_F32 = [MERGE_CASES[1], MERGE_CASES[3], MERGE_CASES[6]]


@pytest.mark.parametrize("dtype,batch,rows,hq,hkv,splits", [(torch.bfloat16, *c) for c in MERGE_CASES]
                         + [(torch.float32, *c) for c in MERGE_CASES_F32])
def test_fused_merge_is_bit_identical_to_two_kernel_path(dtype: torch.dtype, batch: int, rows: int, hq: int,
                                                         hkv: int, splits: int, arrival: str) -> None:
    case = _case(batch, rows, hq, hkv, dtype, seed=40 + batch * 8 + rows + splits)
    t = batch * rows
    two = _run(case, rows, splits, fused=False)
    counters = torch.zeros(merge_counters_numel(batch, hkv), dtype=torch.int32, device=DEV)
    fused = _run(case, rows, splits, fused=True, counters=counters)
    assert not torch.isnan(two[:t].float()).any()
    assert torch.equal(_bits(fused[:t]), _bits(two[:t])), f"fused merge differs ({arrival} arrival)"
    assert torch.isnan(fused[t:].float()).all(), "rows beyond T were written"
    assert not counters.any(), "the fused merge must re-arm its counters to zero"


@pytest.mark.parametrize("splits", [1, 4])
def test_fused_merge_replays_with_the_same_counters(splits: int, arrival: str) -> None:
    """Launches that share counters and output buffer, as a CUDA graph's replays and the layers of a step do."""
    case = _case(3, 2, 4, 2, torch.bfloat16, seed=7)
    other = _case(2, 2, 4, 2, torch.bfloat16, seed=8)  # a different batch between the replays
    counters = torch.zeros(merge_counters_numel(3, 2), dtype=torch.int32, device=DEV)
    first = _run(case, 2, splits, fused=True, counters=counters).clone()
    for c in (other, case):
        out = torch.full((8, 4 * D), float("nan"), dtype=torch.bfloat16, device=DEV)
        got = _run(c, 2, splits, fused=True, counters=counters, out=out)
        assert torch.equal(_bits(got), _bits(_run(c, 2, splits, fused=False))), "a replay changed the output"
        assert not counters.any()
    assert torch.equal(_bits(got), _bits(first))


def test_fused_merge_needs_counters_and_the_switch_selects_the_path(monkeypatch: pytest.MonkeyPatch) -> None:
    case = _case(2, 1, 4, 2, torch.float32, seed=3)
    q, kb, vb, rtt, rpi, seq = case
    n_o, n_l = partial_numel(2, 4, 2, D, 1, 4)
    kw = dict(rows_per_req=1, sm_scale=1.0, num_splits=4, o_partial=torch.empty(n_o, device=DEV),
              lse_partial=torch.empty(n_l, device=DEV))
    out = torch.empty(2, 4 * D, device=DEV)
    monkeypatch.delenv(attention.FUSED_MERGE_SWITCH, raising=False)
    assert attention.fused_merge_enabled()
    with pytest.raises(ValueError, match="counters"):
        paged_decode_attention(q, kb, vb, rtt, rpi, seq, out, **kw)
    with pytest.raises(ValueError, match="counters"):
        paged_decode_attention(q, kb, vb, rtt, rpi, seq, out, counters=torch.zeros(1, dtype=torch.int32, device=DEV),
                               **kw)
    paged_decode_attention(q, kb, vb, rtt, rpi, seq, out, **{**kw, "num_splits": 1})  # one split: no counters
    monkeypatch.setenv(attention.FUSED_MERGE_SWITCH, "0")
    assert not attention.fused_merge_enabled()
    paged_decode_attention(q, kb, vb, rtt, rpi, seq, out, **kw)  # the two-kernel path needs none


def test_paged_decode_attention_rejects_mismatched_rows() -> None:
    q, kb, vb, rtt, rpi, seq = _case(2, 1, 4, 2, torch.float32, seed=3)
    n_o, n_l = partial_numel(2, 4, 2, D, 2, 1)
    with pytest.raises(ValueError, match="rows_per_req"):
        paged_decode_attention(q, kb, vb, rtt, rpi, seq, torch.empty(2, 4 * D, device=DEV), rows_per_req=2,
                               sm_scale=1.0, num_splits=1, o_partial=torch.empty(n_o, device=DEV),
                               lse_partial=torch.empty(n_l, device=DEV))
