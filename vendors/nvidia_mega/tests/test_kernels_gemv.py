"""nvidia_mega's one-row GEMV (``kernels/gemv.py``) against torch, and ``gemv.gemm``'s choice between it and the
small GEMM. Runs on CPU under ``TRITON_INTERPRET=1`` (tiny shapes) and, unchanged, on a CUDA GPU; outputs and
inputs are guarded by NaN beyond what a kernel may touch. (Split from test_kernels_dense.py.)
"""

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
from lowlat_nvidia_mega.kernels.small_gemm import small_gemm

pytestmark = pytest.mark.gpu  # also run on a GPU: python bench/gpu_jobs.py gpu-tests

if not pdl.interpreting() and not torch.cuda.is_available():
    pytest.skip("Triton kernels need a CUDA GPU or TRITON_INTERPRET=1", allow_module_level=True)

from test_kernels_dense import DEV, DTYPES, EPS, _gen, _randn, _tol  # noqa: E402

GEMV_CASES = [  # (epilogue, with norm, K, BLOCK_N, BLOCK_K): every epilogue; K in one chunk, several, a partial one
    ("none", True, 192, 4, 64),
    ("silu_mul", True, 192, 8, 256),
    ("residual", False, 200, 2, 64),
    ("silu_mul", True, 136, 4, 32),
    ("none", False, 256, 16, 256),
]


def _guarded(t: torch.Tensor, pad: int = 512) -> torch.Tensor:
    """``t`` at the front of a NaN-filled buffer: same shape and strides, followed in memory by ``pad`` NaNs, so a
    load past its end (a missing K mask, a norm over more than K) turns the result into NaN."""
    buf = torch.full((t.numel() + pad,), float("nan"), dtype=t.dtype, device=t.device)
    buf[:t.numel()] = t.reshape(-1)
    return buf[:t.numel()].view(t.shape)


def _run_gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, plan: GemmPlan,
              **kw: torch.Tensor | str | None) -> list[tuple[str, tuple[int, ...]]]:
    """``gemv.gemm(x, w, out, plan=plan, **kw)``; returns the (kernel, grid) pairs of the GEMV kernels it launched
    ("tile": ``_gemv_kernel``, "stream": ``_gemv_stream_kernel``)."""
    launched: list[tuple[str, tuple[int, ...]]] = []
    reals = {"tile": gemv_mod._gemv_kernel, "stream": gemv_mod._gemv_stream_kernel}

    class _Spy:
        def __init__(self, name: str) -> None:
            self.name = name

        def __getitem__(self, grid):  # type: ignore[no-untyped-def]
            launched.append((self.name, grid))
            return reals[self.name][grid]

    gemv_mod._gemv_kernel, gemv_mod._gemv_stream_kernel = _Spy("tile"), _Spy("stream")  # type: ignore[assignment]
    try:
        gemv_mod.gemm(x, w, out, plan=plan, eps=EPS, **kw)
    finally:
        gemv_mod._gemv_kernel, gemv_mod._gemv_stream_kernel = reals["tile"], reals["stream"]
    return launched


def _row1_plan(n: int, k: int, dtype: torch.dtype, gated: bool, block_n: int, block_k: int,
               per_sm: int = 0) -> GemmPlan:
    """A one-split ``small_gemm`` plan with the GEMV's ``row1`` (4 warps, 2 stages; ``per_sm`` > 0: the weight
    stream at that many programs per SM, 4 SMs on CPU)."""
    return dataclasses.replace(plan_gemm(n, k, dtype, 4, gated=gated, block_n=32, split_k=1),
                               row1=GemvPlan(block_n=block_n, block_k=block_k, num_warps=4, num_stages=2,
                                             per_sm=per_sm))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("epilogue,with_norm,k,block_n,block_k", GEMV_CASES)
@pytest.mark.parametrize("per_sm", [0, 3])
def test_one_row_gemv_matches_torch(dtype: torch.dtype, epilogue: str, with_norm: bool, k: int, block_n: int,
                                    block_k: int, per_sm: int) -> None:
    """``gemv.gemm`` at one row with ``plan.row1`` runs the GEMV kernel (``per_sm`` 0: a program per tile; 3: the
    weight stream, 12 programs on CPU's 4 SMs, so some walk two tiles and, at 16 columns, the grid is the 6 tiles;
    on a GPU one program per tile),
    against the same torch reference as ``small_gemm``. N = 83 is a multiple of no BLOCK_N, so the last tile's
    column mask is exercised; x, w and the norm weight are followed in memory by NaNs, so nothing past K (or past
    the weight) may be read. The residual epilogue runs in place (``residual=out``, as ``MegaForward`` calls it)
    and into a separate output."""
    n = 83
    gated = epilogue == "silu_mul"
    x = _guarded(_randn(1, k, dtype=dtype, seed=51))
    w = _guarded(_randn(2 * n if gated else n, k, dtype=dtype, seed=52, scale=0.1))
    nw = _guarded((torch.rand(k, generator=_gen(53)) + 0.5).to(dtype=dtype, device=DEV)) if with_norm else None
    plan = _row1_plan(n, k, dtype, gated, block_n, block_k, per_sm)
    res = _guarded(_randn(1, n, dtype=dtype, seed=54))
    h = rms_norm(x, nw, EPS) if nw is not None else x
    y = F.linear(h, w)
    ref = F.silu(y[:, :n]) * y[:, n:] if gated else (res + y if epilogue == "residual" else y)
    tiles = triton.cdiv(n, block_n)
    grid = [("stream", (min(per_sm * num_sms(DEV), tiles),))] if per_sm else [("tile", (tiles,))]
    for in_place in ([True, False] if epilogue == "residual" else [False]):
        buf = torch.full((2, n), float("nan"), dtype=dtype, device=DEV)
        if in_place:
            buf[:1] = res
        out = buf[:1]
        residual = (out if in_place else res) if epilogue == "residual" else None
        launched = _run_gemv(x, w, out, plan, epilogue=epilogue, norm_weight=nw, residual=residual)
        torch.testing.assert_close(out.float(), ref.float(), **_tol(dtype))
        assert torch.isnan(buf[1:].float()).all(), "rows beyond T (or columns beyond N) were written"
        assert launched == grid, "one row with plan.row1 must run the GEMV kernel"


@pytest.mark.parametrize("epilogue", ["none", "residual"])
def test_one_row_gemv_rounds_as_torch(epilogue: str) -> None:
    """bf16, with every sum exact in fp32 whatever its order (x on a grid of 2**-12, W of four +-1 per row), so the
    GEMV equals torch's ``rms_norm`` -> ``F.linear`` (-> + residual) bit for bit: the prologue rounds x * rstd to
    bf16, then its product with the norm weight (HF's order). x ~ 5e-3 (mean(x^2) ~ 2e-5), so eps moves rstd by
    ~2%. K = 200 in chunks of 64: the loop's chunks and a partial last one. On a GPU the kernel's 1 / sqrt may
    differ from torch's rsqrt in fp32's last bit and flip a rounding: a few outputs may differ by that there."""
    n, k, dt = 83, 200, torch.bfloat16
    g = _gen(70)
    x = (torch.randint(-32, 33, (1, k), generator=g) * 2.0 ** -12).to(dtype=dt, device=DEV)
    nw = (torch.rand(k, generator=g) + 0.5).to(dtype=dt, device=DEV)
    w = torch.zeros(n, k)
    for row in w:
        row[torch.randperm(k, generator=g)[:4]] = torch.randint(0, 2, (4,), generator=g).float() * 2 - 1
    w = w.to(dtype=dt, device=DEV)
    res = _randn(1, n, dtype=dt, seed=71)
    y = F.linear(rms_norm(x, nw, EPS), w)
    ref = res + y if epilogue == "residual" else y
    out = torch.full((1, n), float("nan"), dtype=dt, device=DEV)
    launched = _run_gemv(x, w, out, _row1_plan(n, k, dt, False, 8, 64), epilogue=epilogue, norm_weight=nw,
                         residual=res if epilogue == "residual" else None)
    differ = int((out != ref).sum())
    assert differ <= (0 if pdl.interpreting() else 2), f"{differ} of {n} outputs differ from torch's in bf16"
    torch.testing.assert_close(out.float(), ref.float(), **_tol(dt))
    assert launched == [("tile", (triton.cdiv(n, 8),))], "one row with plan.row1 must run the GEMV kernel"


@pytest.mark.parametrize("k,block_k,per_sm", [(2048, 512, 1), (512, 512, 2), (520, 256, 1)])
def test_weight_stream_is_the_per_tile_gemvs_bit_for_bit(k: int, block_k: int, per_sm: int) -> None:
    """The weight stream reduces each chunk and adds the chunks in K order as ``_gemv_kernel`` does, so at the same
    tiles the two agree bit for bit (bf16, SwiGLU with the norm prologue, and residual): K in four chunks, in one
    (x normalized once per program), and in a partial third; 48 tiles of 4 rows over 4 or 8 programs."""
    n, dt = 190, torch.bfloat16
    x = _randn(1, k, dtype=dt, seed=80)
    nw = (torch.rand(k, generator=_gen(81)) + 0.5).to(dtype=dt, device=DEV)
    res = _randn(1, n, dtype=dt, seed=82)
    for epilogue, gated in (("silu_mul", True), ("residual", False)):
        w = _randn(2 * n if gated else n, k, dtype=dt, seed=83, scale=0.05)
        outs = []
        for ps in (0, per_sm):
            out = torch.full((1, n), float("nan"), dtype=dt, device=DEV)
            kw = dict(norm_weight=nw) if gated else dict(residual=res)
            launched = _run_gemv(x, w, out, _row1_plan(n, k, dt, gated, 4, block_k, ps), epilogue=epilogue, **kw)
            assert launched[0][0] == ("stream" if ps else "tile")
            outs.append(out)
        assert not outs[1].isnan().any() and torch.equal(outs[0], outs[1]), epilogue


@pytest.mark.parametrize("per_sm", [0, 2, None], ids=["tile", "stream", "small_gemm"])
def test_inputs_no_kernel_can_take_are_refused_by_name(per_sm: int | None) -> None:
    """Refused before any launch, on all three paths alike (found by an attack on the stream's checks, 2026-12-07):
    an empty reduction (K = 0 crashed the interpreter), N = 0, integer tensors, ``out`` sharing memory with ``x``
    (the kernels read x while they write out), and a norm weight or residual on another device."""
    n, k = 32, 64
    plan = plan_gemm(n, k, torch.float32, 4, split_k=1)
    if per_sm is not None:
        plan = dataclasses.replace(plan, row1=GemvPlan(block_n=4, block_k=64, num_warps=4, num_stages=1,
                                                       per_sm=per_sm))
    w = _randn(n, k, dtype=torch.float32, seed=90)
    x = _randn(1, k, dtype=torch.float32, seed=91)
    with pytest.raises(ValueError, match="K >= 1 and N >= 1"):
        gemv_mod.gemm(x[:, :0], w[:, :0], torch.empty(1, n, device=DEV), plan=plan)
    with pytest.raises(ValueError, match="K >= 1 and N >= 1"):
        gemv_mod.gemm(x, w[:0], torch.empty(1, 0, device=DEV), plan=plan)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        gemv_mod.gemm(x.to(torch.int32), w.to(torch.int32), torch.empty(1, n, dtype=torch.int32, device=DEV),
                      plan=plan)
    buf = _randn(1, k, dtype=torch.float32, seed=92)  # N = K: out could alias x
    w_sq = _randn(k, k, dtype=torch.float32, seed=93)
    with pytest.raises(ValueError, match="shares memory with x"):
        gemv_mod.gemm(buf, w_sq, buf, plan=plan_gemm(k, k, torch.float32, 4, split_k=1) if per_sm is None else
                      dataclasses.replace(plan_gemm(k, k, torch.float32, 4, split_k=1), row1=plan.row1))
    sq_plan = plan_gemm(k, k, torch.float32, 4, split_k=1)
    if per_sm is not None:
        sq_plan = dataclasses.replace(sq_plan, row1=plan.row1)
    line = _randn(1, 2 * k, dtype=torch.float32, seed=94)
    gemv_mod.gemm(line[:, :k], w_sq, line[:, k:], plan=sq_plan)  # adjacent, not overlapping: runs
    torch.testing.assert_close(line[:, k:], F.linear(line[:, :k], w_sq), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="shares memory with x"):  # one element in common
        gemv_mod.gemm(line[:, :k], w_sq, line[:, k - 1:2 * k - 1], plan=sq_plan)
    two = _randn(2, 2 * k, dtype=torch.float32, seed=95)  # rows interleave: x = left half, out = right half
    sq_small = plan_gemm(k, k, torch.float32, 4, split_k=1)
    gemv_mod.gemm(two[:, :k], w_sq, two[:, k:], plan=sq_small)  # spans overlap, no element is shared: runs
    torch.testing.assert_close(two[:, k:], F.linear(two[:, :k], w_sq), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="shares memory with x"):  # the last column of x's rows in common
        gemv_mod.gemm(two[:, :k], w_sq, two[:, k - 1:2 * k - 1], plan=sq_small)
    meta = torch.device("meta")
    with pytest.raises(ValueError, match="norm_weight must be"):
        gemv_mod.gemm(x, w, torch.empty(1, n, device=DEV), plan=plan, norm_weight=torch.ones(k, device=meta))
    out = torch.empty(1, n, device=DEV)
    with pytest.raises(ValueError, match="residual"):
        gemv_mod.gemm(x, w, out, plan=plan, epilogue="residual", residual=torch.empty(1, n, device=meta))


def test_gemm_runs_small_gemm_unless_one_row_with_a_row1_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """The choice is by shape alone: 2+ rows, or no ``row1``, run ``small_gemm``; bad input is refused the same
    way on both paths, and a ``row1`` that splits K (qkv_rope's kind of plan) by the GEMV."""
    calls: list[str] = []
    monkeypatch.setattr(gemv_mod, "small_gemm", lambda *a, **kw: calls.append("small_gemm"))
    k, n = 64, 32
    plain = plan_gemm(n, k, torch.float32, 4, split_k=1)
    row1 = dataclasses.replace(plain, row1=GemvPlan(block_n=4, block_k=64, num_warps=4, num_stages=1))
    w = _randn(n, k, dtype=torch.float32, seed=60)
    gemv_mod.gemm(_randn(2, k, dtype=torch.float32, seed=61), w, torch.empty(2, n, device=DEV), plan=row1)
    gemv_mod.gemm(_randn(1, k, dtype=torch.float32, seed=62), w, torch.empty(1, n, device=DEV), plan=plain)
    assert calls == ["small_gemm", "small_gemm"]
    with pytest.raises(ValueError, match="w must be"):
        gemv_mod.gemm(_randn(1, k, dtype=torch.float32, seed=63), w[:, :32], torch.empty(1, n, device=DEV),
                      plan=row1)
    with pytest.raises(ValueError, match="residual"):
        gemv_mod.gemm(_randn(1, k, dtype=torch.float32, seed=64), w, torch.empty(1, n, device=DEV), plan=row1,
                      epilogue="residual")
    split = dataclasses.replace(plain, row1=dataclasses.replace(row1.row1, split_k=2))
    with pytest.raises(ValueError, match="never splits K"):
        gemv_mod.gemm(_randn(1, k, dtype=torch.float32, seed=65), w, torch.empty(1, n, device=DEV), plan=split)
    k2 = 256
    w2 = _randn(n, k2, dtype=torch.float32, seed=67)
    split_plan = dataclasses.replace(plan_gemm(n, k2, torch.float32, 4, split_k=2), row1=row1.row1)
    assert split_plan.split_k == 2
    with pytest.raises(ValueError, match="workspace"):  # two rows: small_gemm splits K and needs its workspace
        small_gemm(_randn(2, k2, dtype=torch.float32, seed=68), w2, torch.empty(2, n, device=DEV), plan=split_plan)
    out1 = torch.empty(1, n, device=DEV)  # one row: the GEMV splits nothing, so none is asked for
    x1 = _randn(1, k2, dtype=torch.float32, seed=69)
    gemv_mod.gemm(x1, w2, out1, plan=split_plan)
    torch.testing.assert_close(out1, F.linear(x1, w2), atol=1e-4, rtol=1e-4)
    monkeypatch.setenv("LOWLAT_MEGA_PREFETCH_ACT", "maybe")  # a typo is refused on the GEMV path too
    with pytest.raises(ValueError, match="LOWLAT_MEGA_PREFETCH_ACT"):
        gemv_mod.gemm(_randn(1, k, dtype=torch.float32, seed=66), w, torch.empty(1, n, device=DEV), plan=row1)
