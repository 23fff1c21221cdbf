"""nvidia_mega's GEMV at 2-8 rows (``GemvPlan.max_rows``, ``gemv.rows_chunk``) against torch and against itself at
one row, and ``gemv.gemm``'s choice by ``max_rows``. Runs on CPU under ``TRITON_INTERPRET=1`` (tiny shapes) and,
unchanged, on a CUDA GPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
import triton
from lowlat.layers.norm import rms_norm
from lowlat_nvidia_mega.kernels import gemv as gemv_mod
from lowlat_nvidia_mega.kernels import pdl
from lowlat_nvidia_mega.kernels.gemm_plans import GemmPlan, GemvPlan, num_sms, plan_gemm

pytestmark = pytest.mark.gpu  # also run on a GPU: python bench/gpu_jobs.py gpu-tests

if not pdl.interpreting() and not torch.cuda.is_available():
    pytest.skip("Triton kernels need a CUDA GPU or TRITON_INTERPRET=1", allow_module_level=True)

from test_kernels_dense import DEV, EPS, _gen, _randn, _tol  # noqa: E402
from test_kernels_gemv import _run_gemv  # noqa: E402

BF = torch.bfloat16


def _rows_plan(n: int, k: int, gated: bool, block_n: int, block_k: int, per_sm: int, max_rows: int = 8) -> GemmPlan:
    """A one-split ``small_gemm`` plan whose GEMV (4 warps, 2 stages) serves up to ``max_rows`` rows."""
    return dataclasses.replace(plan_gemm(n, k, BF, 4, gated=gated, block_n=32, split_k=1),
                               row1=GemvPlan(block_n=block_n, block_k=block_k, num_warps=4, num_stages=2,
                                             per_sm=per_sm, max_rows=max_rows))


def _strided_rows(rows: int, k: int, seed: int) -> torch.Tensor:
    """[rows, k] bf16 whose rows are ``k + 8`` apart, NaNs in the 8 columns between them and after the last: a row
    stride taken as k, or a load past K, turns the result into NaN."""
    buf = torch.full((rows + 1, k + 8), float("nan"), dtype=BF, device=DEV)
    buf[:rows, :k] = _randn(rows, k, dtype=BF, seed=seed)
    return buf[:rows, :k]


@pytest.mark.parametrize("rows", [2, 5, 8])
@pytest.mark.parametrize("epilogue,with_norm,k,block_n,block_k", [
    ("silu_mul", True, 192, 4, 64), ("residual", False, 200, 2, 64), ("none", True, 136, 8, 32)])
@pytest.mark.parametrize("per_sm", [0, 3])
def test_gemv_at_2_to_8_rows_matches_torch(rows: int, epilogue: str, with_norm: bool, k: int, block_n: int,
                                           block_k: int, per_sm: int) -> None:
    """With ``max_rows`` 8, 2-8 rows run the GEMV (per tile, and the weight stream: 12 programs on CPU's 4 SMs) and
    match torch: x's rows are strided with NaN between them, N = 83 leaves a partial last tile, the output buffer's
    row past T stays NaN, and the residual epilogue runs in place on a strided residual, as ``MegaForward`` calls it."""
    n = 83
    gated = epilogue == "silu_mul"
    x = _strided_rows(rows, k, seed=100 + rows)
    w = _randn(2 * n if gated else n, k, dtype=BF, seed=101, scale=0.1)
    nw = (torch.rand(k, generator=_gen(102)) + 0.5).to(dtype=BF, device=DEV) if with_norm else None
    res = _randn(rows, n, dtype=BF, seed=103)
    y = F.linear(rms_norm(x, nw, EPS) if nw is not None else x, w)
    ref = F.silu(y[:, :n]) * y[:, n:] if gated else (res + y if epilogue == "residual" else y)
    buf = torch.full((rows + 1, n + 5), float("nan"), dtype=BF, device=DEV)
    out = buf[:rows, :n]
    if epilogue == "residual":
        out.copy_(res)
    launched = _run_gemv(x, w, out, _rows_plan(n, k, gated, block_n, block_k, per_sm), epilogue=epilogue,
                         norm_weight=nw, residual=out if epilogue == "residual" else None)
    tiles = triton.cdiv(n, block_n)
    assert launched == ([("stream", (min(per_sm * num_sms(DEV), tiles),))] if per_sm else [("tile", (tiles,))])
    torch.testing.assert_close(out.float(), ref.float(), **_tol(BF))
    assert buf[rows:].isnan().all() and buf[:, n:].isnan().all(), "rows beyond T or columns beyond N were written"


@pytest.mark.parametrize("per_sm", [0, 2])
@pytest.mark.parametrize("k,block_k", [(192, 64), (128, 128)])
def test_each_row_is_the_one_row_gemvs_bit_for_bit(per_sm: int, k: int, block_k: int) -> None:
    """Each row's products, norm statistics and chunk sums are the one-row kernel's, so row r of a 7-row launch
    equals the one-row launch of row r alone bit for bit (SwiGLU with the norm prologue, and residual): a row's
    output does not depend on the rows beside it. K in three chunks, and in one (where the one-row stream
    normalizes x once per program)."""
    n, rows = 50, 7
    x = _randn(rows, k, dtype=BF, seed=110)
    nw = (torch.rand(k, generator=_gen(111)) + 0.5).to(dtype=BF, device=DEV)
    res = _randn(rows, n, dtype=BF, seed=112)
    for epilogue, gated in (("silu_mul", True), ("residual", False)):
        w = _randn(2 * n if gated else n, k, dtype=BF, seed=113, scale=0.05)
        plan = _rows_plan(n, k, gated, 4, block_k, per_sm)
        kw = dict(norm_weight=nw) if gated else {}
        out = res.clone()
        _run_gemv(x, w, out, plan, epilogue=epilogue, **kw, **(dict(residual=out) if not gated else {}))
        for r in range(rows):
            one = res[r:r + 1].clone()
            _run_gemv(x[r:r + 1], w, one, plan, epilogue=epilogue, **kw, **(dict(residual=one) if not gated else {}))
            assert torch.equal(out[r:r + 1], one), f"{epilogue}: row {r} differs from its one-row launch"


def test_max_rows_chooses_the_gemv_or_small_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    """By shape alone: with ``max_rows`` 4, 1-4 rows run the GEMV and 5-8 ``small_gemm``; without ``max_rows`` only
    one row runs the GEMV; ``uses_gemv`` and ``publish_tile_n`` say the same."""
    calls: list[str] = []
    monkeypatch.setattr(gemv_mod, "small_gemm", lambda *a, **kw: calls.append("small_gemm"))
    n, k = 32, 64
    w = _randn(n, k, dtype=BF, seed=120)
    for max_rows, gemv_rows in ((4, range(1, 5)), (1, range(1, 2))):
        plan = _rows_plan(n, k, False, 4, 64, 0, max_rows=max_rows)
        for rows in range(1, 9):
            calls.clear()
            launched = _run_gemv(_randn(rows, k, dtype=BF, seed=121), w, torch.empty(rows, n, dtype=BF, device=DEV),
                                 plan)
            want_gemv = rows in gemv_rows
            assert (launched, calls) == (([("tile", (8,))], []) if want_gemv else ([], ["small_gemm"])), rows
            assert gemv_mod.uses_gemv(plan, rows) is want_gemv
            assert gemv_mod.publish_tile_n(plan, rows) == (4 if want_gemv else plan.block_n)


@pytest.mark.parametrize("field,value", [("max_rows", 0), ("max_rows", 9), ("max_rows", True)])
def test_gemv_plan_refuses_max_rows_out_of_range(field: str, value: object) -> None:
    with pytest.raises(ValueError, match="max_rows"):
        GemvPlan(block_n=4, block_k=64, num_warps=4, num_stages=1, **{field: value})
    with pytest.raises(ValueError, match="1 with split_k above 1"):
        GemvPlan(block_n=64, block_k=64, num_warps=4, num_stages=1, split_k=2, max_rows=2)


@pytest.mark.parametrize("rows,block_n,qk_norm,with_norm", [(3, 8, False, True), (8, 2, False, True),
                                                            (5, 32, True, True), (2, 16, False, False)])
def test_qkv_rope_at_2_to_8_rows_with_max_rows(rows: int, block_n: int, qk_norm: bool, with_norm: bool) -> None:
    """qkv_rope's one-row loop with ``max_rows`` 8 serves 2-8 rows too (row pairs: a few rotary pairs of a head per
    program; 32 = the head dim: a head per program, with q/k norm), against the torch reference: q, and K / V only
    at ``out_cache_loc``. With ``max_rows`` 1 the same rows run the tl.dot loop."""
    from test_kernels_dense import LLAMA3, D, _check_qkv_rope

    row1 = GemvPlan(block_n=block_n, block_k=32, num_warps=4, num_stages=1, max_rows=8)
    seen = _check_qkv_rope(BF, rows, qk_norm, 1, LLAMA3, row1, with_norm=with_norm)
    assert (seen["ROW1"], seen["PAIRS"]) == (True, block_n // 2)
    if rows == 3:
        one = dataclasses.replace(row1, max_rows=1)
        plain = _check_qkv_rope(BF, rows, qk_norm, 1, LLAMA3, one)
        assert (plain["ROW1"], plain["PAIRS"]) == (False, D // 2)
