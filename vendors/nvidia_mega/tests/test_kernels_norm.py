"""``norm_rows`` (kernels/norm_rows.py) and the GEMMs that read its output with their norm prologue off ("prenorm"),
under TRITON_INTERPRET=1 on CPU or on a CUDA GPU: against core's torch RMSNorm, and against the fused prologue."""

from __future__ import annotations

import pytest
import torch
from lowlat.layers.norm import rms_norm
from lowlat_nvidia_mega.kernels import pdl

pytestmark = pytest.mark.gpu  # also run on a GPU: python bench/gpu_jobs.py gpu-tests

if not pdl.interpreting() and not torch.cuda.is_available():
    pytest.skip("Triton kernels need a CUDA GPU or TRITON_INTERPRET=1", allow_module_level=True)

from lowlat_nvidia_mega.kernels.gemm_plans import make_plan, splitk_workspace_numel  # noqa: E402
from lowlat_nvidia_mega.kernels.gemv import gemm  # noqa: E402
from lowlat_nvidia_mega.kernels.norm_rows import norm_rows, prenorm_step, prenorm_switch  # noqa: E402
from lowlat_nvidia_mega.kernels.qkv_rope import plan_qkv, qkv_rope, qkv_workspace_numel, rope_cos_sin  # noqa: E402

DEV = torch.device("cpu" if pdl.interpreting() else "cuda")
EPS = 1e-6
HQ, HKV, D, SLOTS, MAX_POS = 4, 2, 32, 16, 64


def _data(rows: int, k: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, k, generator=g) * 2).to(dtype=dtype, device=DEV)
    w = (torch.rand(k, generator=g) + 0.5).to(dtype=dtype, device=DEV)
    return x, w


@pytest.mark.parametrize("dtype,rows,k,block_k", [(torch.float32, 3, 120, 32), (torch.bfloat16, 8, 256, 64),
                                                  (torch.bfloat16, 1, 64, 512), (torch.float16, 5, 200, 16)])
def test_norm_rows_matches_torch(dtype: torch.dtype, rows: int, k: int, block_k: int) -> None:
    """Every row and column written, as core's RMSNorm computes it (HF order and roundings; K 120 / 200: partial
    chunks), rows past T and the buffer past the row untouched (x and out as views with row strides past K, NaN
    after each row of x)."""
    x_full = torch.full((rows, k + 8), float("nan"), dtype=dtype, device=DEV)
    x, w = _data(rows, k, dtype, seed=1)
    x_full[:, :k] = x
    out = torch.full((8, k + 4), -7.0, dtype=dtype, device=DEV)  # a row stride unlike x's
    norm_rows(x_full[:, :k], w, EPS, out[:rows, :k], block_k=block_k)
    want = rms_norm(x, w, EPS)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.0, "rtol": 1e-2}  # 1 ulp
    torch.testing.assert_close(out[:rows, :k], want, **tol)
    assert (out[rows:] == -7.0).all() and (out[:, k:] == -7.0).all(), "wrote outside [T, K]"


def test_norm_rows_refuses_bad_arguments() -> None:
    x, w = _data(3, 64, torch.float32, seed=2)
    out = torch.empty_like(x)
    with pytest.raises(ValueError, match="1..8 rows"):
        norm_rows(torch.zeros(9, 64, device=DEV), w, EPS, torch.zeros(9, 64, device=DEV))
    with pytest.raises(ValueError, match="norm_weight must be a contiguous \\[64\\]"):
        norm_rows(x, w[:32], EPS, out)
    with pytest.raises(ValueError, match="out must be \\[3, 64\\]"):
        norm_rows(x, w, EPS, out[:2])
    with pytest.raises(ValueError, match="out is torch.bfloat16"):
        norm_rows(x, w, EPS, out.to(torch.bfloat16))
    with pytest.raises(ValueError, match="overlaps x"):
        norm_rows(x, w, EPS, x)
    with pytest.raises(ValueError, match="block_k"):
        norm_rows(x, w, EPS, out, block_k=24)
    with pytest.raises(ValueError, match="unit stride"):
        norm_rows(x.t(), w[:3].contiguous(), EPS, out.t())


def test_prenorm_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOWLAT_MEGA_PRENORM", raising=False)
    assert prenorm_switch() is None  # unset: the measured rule decides
    for v, want in (("1", True), ("on", True), ("0", False), ("no", False), ("", None), (" Default ", None)):
        monkeypatch.setenv("LOWLAT_MEGA_PRENORM", v)
        assert prenorm_switch() is want
    monkeypatch.setenv("LOWLAT_MEGA_PRENORM", "2")
    with pytest.raises(ValueError, match="LOWLAT_MEGA_PRENORM='2'"):
        prenorm_switch()
    monkeypatch.setenv("LOWLAT_MEGA_PRENORM", "auto")  # the third state has a name too: the message gives it
    with pytest.raises(ValueError, match=r"or 0, or unset it \(or 'default'\) for the measured rule"):
        prenorm_switch()


def test_prenorm_step_is_the_rule_forward_and_tune_plans_share(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset: 2..max_rows rows (max_rows 0: none); 1: every 2-8-row step; 0: none; one row never; a typo refused."""
    monkeypatch.delenv("LOWLAT_MEGA_PRENORM", raising=False)
    assert [prenorm_step(t, 6) for t in range(1, 9)] == [False] + [True] * 5 + [False] * 2
    assert not any(prenorm_step(t, 0) for t in range(1, 9))
    monkeypatch.setenv("LOWLAT_MEGA_PRENORM", "1")
    assert [prenorm_step(t, 0) for t in range(1, 9)] == [False] + [True] * 7
    monkeypatch.setenv("LOWLAT_MEGA_PRENORM", "0")
    assert not any(prenorm_step(t, 8) for t in range(1, 9))
    monkeypatch.setenv("LOWLAT_MEGA_PRENORM", "sometimes")
    with pytest.raises(ValueError, match="LOWLAT_MEGA_PRENORM"):
        prenorm_step(2, 6)


@pytest.mark.parametrize("dtype,rows,split_k", [(torch.float32, 3, 2), (torch.bfloat16, 8, 1), (torch.bfloat16, 2, 2)])
def test_gemms_read_prenormalized_rows(dtype: torch.dtype, rows: int, split_k: int) -> None:
    """qkv_rope with ``norm_weight=None`` on ``norm_rows``'s output, and the gated small GEMM likewise, against the
    same kernels with their fused norm prologue on the raw rows (qk-norm on, split-K 1 and 2)."""
    hid = 96
    x, nw = _data(rows, hid, dtype, seed=3)
    h = norm_rows(x, nw, EPS, torch.empty_like(x))
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    if pdl.interpreting():  # the same arithmetic as the fused prologue: bit-identical (a rounding-order slip shows)
        tol = {"atol": 0.0, "rtol": 0.0}
    g = torch.Generator().manual_seed(4)
    w = (torch.randn((HQ + 2 * HKV) * D, hid, generator=g) * 0.2).to(dtype=dtype, device=DEV)
    qn = (torch.rand(D, generator=g) + 0.5).to(dtype=dtype, device=DEV)
    kn = (torch.rand(D, generator=g) + 0.5).to(dtype=dtype, device=DEV)
    cos, sin = rope_cos_sin(D, 10000.0, MAX_POS, None, DEV)
    pos = torch.arange(rows, device=DEV) + 3
    loc = torch.arange(rows, device=DEV) + 1
    plan = plan_qkv(HQ, HKV, D, hid, dtype, 4, split_k=split_k, block_k=16)
    ws = torch.zeros(max(1, qkv_workspace_numel(plan, HQ, HKV, D)), device=DEV)
    cnt = torch.zeros(HQ + 2 * HKV, dtype=torch.int32, device=DEV)
    outs = []
    for inp, norm in ((x, nw), (h, None)):
        kb = torch.zeros(SLOTS, HKV, D, dtype=dtype, device=DEV)
        vb = torch.zeros(SLOTS, HKV, D, dtype=dtype, device=DEV)
        q = torch.full((rows, HQ * D), float("nan"), dtype=dtype, device=DEV)
        qkv_rope(inp, norm, w, num_heads=HQ, num_kv_heads=HKV, q_norm=qn, k_norm=kn, cos=cos, sin=sin,
                 positions=pos, out_cache_loc=loc, q_out=q, k_buffer=kb, v_buffer=vb, eps=EPS, plan=plan,
                 workspace=ws, counters=cnt)
        outs.append((q, kb[loc], vb[loc]))
    for fused, pre in zip(*outs, strict=True):
        assert torch.isfinite(pre.float()).all()
        torch.testing.assert_close(pre.float(), fused.float(), **tol)

    inter = 40
    wgu = (torch.randn(2 * inter, hid, generator=g) * 0.2).to(dtype=dtype, device=DEV)
    gplan = make_plan(hid, block_n=16, block_k=16, split_k=split_k, num_warps=4, num_stages=1, weight_rows=32)
    gws = torch.zeros(max(1, splitk_workspace_numel(gplan, inter, gated=True)), device=DEV)
    gcnt = torch.zeros(gplan.n_tiles(inter), dtype=torch.int32, device=DEV)
    acts = []
    for inp, norm in ((x, nw), (h, None)):
        act = torch.full((rows, inter), float("nan"), dtype=dtype, device=DEV)
        gemm(inp, wgu, act, plan=gplan, epilogue="silu_mul", norm_weight=norm, eps=EPS, workspace=gws,
             counters=gcnt)
        acts.append(act)
    assert torch.isfinite(acts[1].float()).all()
    torch.testing.assert_close(acts[1].float(), acts[0].float(), **tol)


def test_norm_rows_refuses_hidden_overlap_and_bad_dtypes() -> None:
    """The overlap check must cover the bytes a strided [T, K] view touches, not ``numel`` bytes from its start:
    x with a row stride of 128 spans elements 0..319 at T=3, K=64, and an ``out`` at elements 200..391 overlaps its
    last row (every program reads all of x, so a write there changes another program's statistics). An ``out``
    whose rows alias each other (row stride < K, e.g. an expanded row) gets every row's result in the same place.
    Dtypes outside bf16 / fp16 / fp32 are refused, as documented."""
    buf = torch.randn(1024, device=DEV)
    w = torch.ones(64, device=DEV)
    x = buf[:320].as_strided((3, 64), (128, 1))
    with pytest.raises(ValueError, match="overlaps x"):
        norm_rows(x, w, EPS, buf[200:392].view(3, 64), block_k=16)
    with pytest.raises(ValueError, match="overlaps x"):  # x contiguous at 600..791, out's last row at 656..719
        norm_rows(buf[600:792].view(3, 64), w, EPS, buf[400:720].as_strided((3, 64), (128, 1)), block_k=16)
    with pytest.raises(ValueError, match="rows of out overlap"):
        norm_rows(torch.randn(3, 64, device=DEV), w, EPS, torch.empty(1, 64, device=DEV).expand(3, 64))
    for dt in (torch.int32, torch.float64):
        xi = torch.ones(2, 16, dtype=dt, device=DEV)
        with pytest.raises(ValueError, match="bfloat16, float16 or float32"):
            norm_rows(xi, torch.ones(16, dtype=dt, device=DEV), EPS, torch.empty_like(xi))
