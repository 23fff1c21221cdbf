"""Each dense nvidia_mega kernel against a torch reference built from the general path's layers (the paged decode
attention: test_kernels_attention.py).

Runs on CPU under ``TRITON_INTERPRET=1`` (tiny shapes) and, unchanged, on a CUDA GPU. Outputs are poisoned
(NaN) beyond the rows a kernel may write; KV writes are checked slot by slot against sentinel values.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from lowlat.layers.norm import rms_norm
from lowlat.layers.rotary import RotaryEmbedding, apply_rotary
from lowlat_nvidia_mega.kernels import pdl
from lowlat_nvidia_mega.kernels import qkv_rope as qkv_mod
from lowlat_nvidia_mega.kernels import small_gemm as small_gemm_mod
from lowlat_nvidia_mega.kernels.gemm_plans import GemvPlan, plan_gemm, splitk_workspace_numel
from lowlat_nvidia_mega.kernels.qkv_rope import plan_qkv, qkv_rope, qkv_workspace_numel, rope_cos_sin
from lowlat_nvidia_mega.kernels.small_gemm import prefetch_act_enabled, small_gemm

pytestmark = pytest.mark.gpu  # also run on a GPU: python bench/gpu_jobs.py gpu-tests

if not pdl.interpreting() and not torch.cuda.is_available():
    pytest.skip("Triton kernels need a CUDA GPU or TRITON_INTERPRET=1", allow_module_level=True)

DEV = torch.device("cpu" if pdl.interpreting() else "cuda")
DTYPES = [torch.float32, torch.bfloat16]
EPS = 1e-6


def _tol(dtype: torch.dtype) -> dict[str, float]:
    # bf16: values are O(1..4), where one ulp is up to 2**-6; allow a few ulps of different rounding order.
    return {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 2e-2}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=_gen(seed)) * scale).to(dtype=dtype, device=DEV)


# ---------------------------------------------------------------- small GEMM

GEMM_CASES = [  # (rows, epilogue, with norm, split_k, block_k): every row count, epilogue and reduction mode
    (1, "none", True, 1, None),
    (3, "silu_mul", True, 2, None),
    (8, "residual", False, 3, None),
    (8, "silu_mul", True, 1, 32),  # 4 K-blocks loaded before the wait, then the loop
    (1, "residual", False, 2, 16),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,epilogue,with_norm,split_k,block_k", GEMM_CASES)
def test_small_gemm_matches_torch(dtype: torch.dtype, rows: int, epilogue: str, with_norm: bool, split_k: int,
                                  block_k: int | None) -> None:
    k, n = 192, 80  # K not a multiple of BLOCK_K (bf16), N not a multiple of BLOCK_N: masks exercised
    gated = epilogue == "silu_mul"
    x = _randn(rows, k, dtype=dtype, seed=1)
    w = _randn(2 * n if gated else n, k, dtype=dtype, seed=2, scale=0.1)
    nw = (torch.rand(k, generator=_gen(3)) + 0.5).to(dtype=dtype, device=DEV) if with_norm else None
    plan = plan_gemm(n, k, dtype, 4, gated=gated, block_n=32, split_k=split_k, block_k=block_k)
    assert plan.split_k > 1 or split_k == 1
    ws = torch.zeros(max(1, splitk_workspace_numel(plan, n, gated=gated)), device=DEV)
    cnt = torch.zeros(plan.n_tiles(n), dtype=torch.int32, device=DEV)
    buf = torch.full((8, n), float("nan"), dtype=dtype, device=DEV)
    res_full = _randn(8, n, dtype=dtype, seed=4)
    if epilogue == "residual":
        buf.copy_(res_full)
    out = buf[:rows]

    h = rms_norm(x, nw, EPS) if nw is not None else x
    y = F.linear(h, w)
    if gated:
        ref = F.silu(y[:, :n]) * y[:, n:]
    elif epilogue == "residual":
        ref = res_full[:rows] + y
    else:
        ref = y
    small_gemm(x, w, out, plan=plan, epilogue=epilogue, norm_weight=nw, eps=EPS,
               residual=out if epilogue == "residual" else None, workspace=ws, counters=cnt)
    torch.testing.assert_close(out.float(), ref.float(), **_tol(dtype))
    if epilogue == "residual":
        assert torch.equal(buf[rows:], res_full[rows:]), "rows beyond T were written"
    else:
        assert torch.isnan(buf[rows:].float()).all(), "rows beyond T were written"
    assert not cnt.any(), "split-K counters must be re-armed to zero"


# (rows, epilogue, split_k, block_k, K): gated and not, one split and several, K a multiple of BLOCK_K or not (the
# last chunk of the loop, and of the prefetch one ahead of it, is partial), the loop running 1 to 9 chunks after PRE_K
PREFETCH_GEMM_CASES = [
    (1, "none", 1, 16, 200),
    (3, "silu_mul", 2, 16, 200),
    (8, "silu_mul", 1, 32, 192),
    (8, "residual", 3, 16, 200),
    (2, "none", 4, 16, 392),
    (5, "silu_mul", 1, 16, 136),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,epilogue,split_k,block_k,k", PREFETCH_GEMM_CASES)
def test_small_gemm_prefetch_is_bit_identical(dtype: torch.dtype, rows: int, epilogue: str, split_k: int,
                                              block_k: int, k: int) -> None:
    """The activation prefetch (norm prologue only) changes when x is loaded, never what is computed."""
    n = 80
    gated = epilogue == "silu_mul"
    x = _randn(rows, k, dtype=dtype, seed=31)
    w = _randn(2 * n if gated else n, k, dtype=dtype, seed=32, scale=0.1)
    nw = (torch.rand(k, generator=_gen(33)) + 0.5).to(dtype=dtype, device=DEV)
    plan = plan_gemm(n, k, dtype, 4, gated=gated, block_n=32, split_k=split_k, block_k=block_k)
    assert plan.split_k == split_k and plan.pre_k < plan.k_per_split  # the K loop after the pre-wait tile runs
    ws = torch.zeros(max(1, splitk_workspace_numel(plan, n, gated=gated)), device=DEV)
    cnt = torch.zeros(plan.n_tiles(n), dtype=torch.int32, device=DEV)
    res = _randn(rows, n, dtype=dtype, seed=34)
    outs = []
    for prefetch in (False, True):
        out = res.clone() if epilogue == "residual" else torch.full((rows, n), float("nan"), dtype=dtype, device=DEV)
        small_gemm(x, w, out, plan=plan, epilogue=epilogue, norm_weight=nw, eps=EPS,
                   residual=out if epilogue == "residual" else None, workspace=ws, counters=cnt,
                   prefetch_act=prefetch)
        assert not cnt.any()
        outs.append(out)
    assert not torch.isnan(outs[0].float()).any()
    assert torch.equal(outs[0], outs[1]), "prefetch on and off must give bit-identical outputs"


class _CaptureLaunch:
    """Stands in for a Triton kernel: records the constexpr keyword arguments of ``kernel[grid](...)``."""

    def __init__(self) -> None:
        self.kwargs: list[dict] = []

    def __getitem__(self, grid):  # type: ignore[no-untyped-def]
        return lambda *args, **kwargs: self.kwargs.append(kwargs)


def test_prefetch_switch_reaches_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """``prefetch_act`` wins; without it ``LOWLAT_MEGA_PREFETCH_ACT`` decides, else the default (off); a GEMM
    without a norm never prefetches; anything but on/off in the variable is refused."""
    cap = _CaptureLaunch()
    monkeypatch.setattr(small_gemm_mod, "_small_gemm_kernel", cap)
    x, out, w = torch.zeros(2, 64, device=DEV), torch.zeros(2, 64, device=DEV), torch.zeros(64, 64, device=DEV)
    nw = torch.ones(64, device=DEV)
    plan = plan_gemm(64, 64, torch.float32, 4, split_k=1)

    def launch(norm: bool = True, **kw) -> bool:  # type: ignore[no-untyped-def]
        small_gemm(x, w, out, plan=plan, norm_weight=nw if norm else None, **kw)
        return cap.kwargs[-1]["PREFETCH_ACT"]

    monkeypatch.delenv("LOWLAT_MEGA_PREFETCH_ACT", raising=False)
    assert prefetch_act_enabled() is small_gemm_mod.PREFETCH_ACT_DEFAULT is False
    assert launch() is False and launch(prefetch_act=True) is True
    assert launch(norm=False, prefetch_act=True) is False
    monkeypatch.setenv("LOWLAT_MEGA_PREFETCH_ACT", "1")
    assert launch() is True and launch(prefetch_act=False) is False
    monkeypatch.setenv("LOWLAT_MEGA_PREFETCH_ACT", "off")
    assert launch() is False
    monkeypatch.setenv("LOWLAT_MEGA_PREFETCH_ACT", "maybe")
    with pytest.raises(ValueError, match="LOWLAT_MEGA_PREFETCH_ACT"):
        launch()


def test_small_gemm_split_k_is_deterministic() -> None:
    k, n = 256, 64
    x = _randn(8, k, dtype=torch.float32, seed=5)
    w = _randn(n, k, dtype=torch.float32, seed=6)
    plan = plan_gemm(n, k, torch.float32, 4, block_n=32, split_k=4)
    ws = torch.zeros(splitk_workspace_numel(plan, n, gated=False), device=DEV)
    cnt = torch.zeros(plan.n_tiles(n), dtype=torch.int32, device=DEV)
    a, b = (torch.empty(8, n, device=DEV) for _ in range(2))
    small_gemm(x, w, a, plan=plan, workspace=ws, counters=cnt)
    small_gemm(x, w, b, plan=plan, workspace=ws, counters=cnt)
    assert torch.equal(a, b)


def test_small_gemm_rejects_bad_input() -> None:
    x = torch.zeros(9, 64, device=DEV)
    w = torch.zeros(32, 64, device=DEV)
    plan = plan_gemm(32, 64, torch.float32, 4)
    with pytest.raises(ValueError, match="1..8 rows"):
        small_gemm(x, w, torch.zeros(9, 32, device=DEV), plan=plan)
    with pytest.raises(ValueError, match="w must be"):
        small_gemm(x[:2], w[:, :32], torch.zeros(2, 32, device=DEV), plan=plan)
    with pytest.raises(ValueError, match="residual"):
        small_gemm(x[:2], w, torch.zeros(2, 32, device=DEV), plan=plan, epilogue="residual")


# ---------------------------------------------------------------- fused QKV + RoPE + KV write

HQ, HKV, D, HID, SLOTS, MAX_POS = 4, 2, 32, 128, 48, 64
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}


def _qkv_reference(x, nw, w, qn, kn, positions, rotary, dtype):  # type: ignore[no-untyped-def]
    t = x.shape[0]
    q, k, v = F.linear(x if nw is None else rms_norm(x, nw, EPS), w).split([HQ * D, HKV * D, HKV * D], dim=-1)
    q, k, v = q.view(t, HQ, D), k.view(t, HKV, D), v.view(t, HKV, D)
    if qn is not None:
        q, k = rms_norm(q, qn, EPS), rms_norm(k, kn, EPS)
    cos, sin = rotary(positions, dtype)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v


QKV_CASES = [(1, False, 1, LLAMA3), (3, True, 2, None), (8, False, 2, LLAMA3), (8, True, 1, None)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,qk_norm,split_k,rope_scaling", QKV_CASES)
def test_qkv_rope_matches_torch_and_writes_only_out_cache_loc(dtype: torch.dtype, rows: int, qk_norm: bool,
                                                              split_k: int, rope_scaling: dict | None) -> None:
    _check_qkv_rope(dtype, rows, qk_norm, split_k, rope_scaling, None)


# (qk_norm, row1 split-K, row1 K chunk): one row through the FMA loop, one split and several; at split 1 and chunk
# 16 the loop runs 4 chunks after the 64 columns loaded before the wait, otherwise the pre-wait tile is the split
QKV_ROW1_CASES = [(False, 1, 16), (True, 1, 16), (True, 2, 16), (True, 1, 64), (False, 4, 16)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm,r1_split,r1_block_k", QKV_ROW1_CASES)
def test_qkv_rope_one_row_loop_matches_torch(dtype: torch.dtype, qk_norm: bool, r1_split: int,
                                             r1_block_k: int) -> None:
    """``plan.row1`` at one row: the FMA K loop (1-D x) at row1's own split and chunk, against the torch reference;
    the kernel must run with ROW1 (at two rows the same plan runs the tl.dot loop: the rows=3 case)."""
    row1 = GemvPlan(block_n=D, block_k=r1_block_k, num_warps=4, num_stages=1, split_k=r1_split)
    assert _check_qkv_rope(dtype, 1, qk_norm, 1, LLAMA3, row1) == {"ROW1": True, "SPLIT_K": r1_split,
                                                                  "PAIRS": D // 2, "grid": (HQ + 2 * HKV, r1_split)}
    if (qk_norm, r1_split, r1_block_k) in QKV_ROW1_CASES[:2]:  # the first case of each qk_norm: at 3 rows the
        # launch reads nothing of row1 (its split and chunk serve one row only; the workspace is sized by the 3-row
        # split), so the other cases would repeat this launch argument for argument
        assert _check_qkv_rope(dtype, 3, qk_norm, 2, None, row1)["ROW1"] is False


# the row-pair form (no q/k norm): (rows per program, K chunk); HID = 128, so chunk 128 is one chunk loaded before
# the wait and 32 a loop of 3 more; 2 rows is one pair, 16 half a head
QKV_PAIR_CASES = [(2, 32), (4, 128), (16, 32)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_n,r1_block_k", QKV_PAIR_CASES)
def test_qkv_rope_row_pair_form_matches_torch(dtype: torch.dtype, block_n: int, r1_block_k: int) -> None:
    """``row1.block_n`` below the head dim at one row: each program owns rows j and j + D/2 of one head for
    ``block_n / 2`` values of j (RoPE inside the program), all of K, no partials or ticket."""
    row1 = GemvPlan(block_n=block_n, block_k=r1_block_k, num_warps=4, num_stages=1)
    seen = _check_qkv_rope(dtype, 1, False, 1, LLAMA3, row1)
    assert seen == {"ROW1": True, "SPLIT_K": 1, "PAIRS": block_n // 2, "grid": (HQ + 2 * HKV, D // block_n)}
    # x already normalized (no prologue), as a TP rank's layers after the first run it
    assert _check_qkv_rope(dtype, 1, False, 1, None, row1, with_norm=False)["PAIRS"] == block_n // 2
    if (block_n, r1_block_k) == QKV_PAIR_CASES[0]:  # two rows: the tl.dot loop, which reads nothing of row1, so
        # the other cases would repeat this launch argument for argument
        assert _check_qkv_rope(dtype, 2, False, 2, None, row1)["PAIRS"] == D // 2


@pytest.mark.parametrize("row1,qk_norm,match", [
    (GemvPlan(block_n=8, block_k=32, num_warps=4, num_stages=1), True, "q/k norm"),
    (GemvPlan(block_n=8, block_k=32, num_warps=4, num_stages=1, split_k=2), False, "split_k must be 1"),
    (GemvPlan(block_n=2 * D, block_k=32, num_warps=4, num_stages=1), False, "block_n 64"),
    (GemvPlan(block_n=1, block_k=32, num_warps=4, num_stages=1), False, "block_n 1"),
    (GemvPlan(block_n=8, block_k=32, num_warps=4, num_stages=1, per_sm=2), False, "no weight-stream form"),
])
def test_qkv_rope_refuses_a_row_pair_plan_it_cannot_run(row1: GemvPlan, qk_norm: bool, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _check_qkv_rope(torch.float32, 1, qk_norm, 1, None, row1)


def _check_qkv_rope(dtype: torch.dtype, rows: int, qk_norm: bool, split_k: int, rope_scaling: dict | None,
                    row1: GemvPlan | None, with_norm: bool = True) -> dict:
    """Runs qkv_rope against the torch reference; returns the launch's ROW1, SPLIT_K and PAIRS constexprs and
    its grid."""
    x = _randn(rows, HID, dtype=dtype, seed=10)
    nw = (torch.rand(HID, generator=_gen(11)) + 0.5).to(dtype=dtype, device=DEV) if with_norm else None
    w = _randn((HQ + 2 * HKV) * D, HID, dtype=dtype, seed=12, scale=0.2)
    qn = (torch.rand(D, generator=_gen(13)) + 0.5).to(dtype=dtype, device=DEV) if qk_norm else None
    kn = (torch.rand(D, generator=_gen(14)) + 0.5).to(dtype=dtype, device=DEV) if qk_norm else None
    positions = torch.randint(0, MAX_POS, (rows,), generator=_gen(15)).to(DEV)
    loc = (torch.randperm(SLOTS - 1, generator=_gen(16))[:rows] + 1).to(DEV)
    cos, sin = rope_cos_sin(D, 10000.0, MAX_POS, rope_scaling, DEV)
    plan = dataclasses.replace(plan_qkv(HQ, HKV, D, HID, dtype, 4, split_k=split_k, block_k=16), row1=row1)
    assert split_k > 1 or plan.pre_k < plan.k_per_split  # the K loop after the pre-wait tile runs
    assert plan.split_k == split_k
    ws = torch.zeros(max(1, qkv_workspace_numel(plan, HQ, HKV, D)), device=DEV)  # as the build sizes it
    cnt = torch.zeros(HQ + 2 * HKV, dtype=torch.int32, device=DEV)
    sentinel = 7.0
    kb = torch.full((SLOTS, HKV, D), sentinel, dtype=dtype, device=DEV)
    vb = torch.full((SLOTS, HKV, D), sentinel, dtype=dtype, device=DEV)
    qbuf = torch.full((8, HQ * D), float("nan"), dtype=dtype, device=DEV)

    seen: dict = {}
    real = qkv_mod._qkv_rope_kernel

    class _Spy:
        def __getitem__(self, grid):  # type: ignore[no-untyped-def]
            def launch(*args, **kwargs):  # type: ignore[no-untyped-def]
                seen.update(ROW1=kwargs["ROW1"], SPLIT_K=kwargs["SPLIT_K"], PAIRS=kwargs["PAIRS"], grid=grid)
                return real[grid](*args, **kwargs)
            return launch

    qkv_mod._qkv_rope_kernel = _Spy()  # type: ignore[assignment]
    try:
        qkv_rope(x, nw, w, num_heads=HQ, num_kv_heads=HKV, q_norm=qn, k_norm=kn, cos=cos, sin=sin,
                 positions=positions, out_cache_loc=loc, q_out=qbuf[:rows], k_buffer=kb, v_buffer=vb, eps=EPS,
                 plan=plan, workspace=ws, counters=cnt)
    finally:
        qkv_mod._qkv_rope_kernel = real
    rotary = RotaryEmbedding(D, 10000.0, rope_scaling, MAX_POS, device=DEV)
    q_ref, k_ref, v_ref = _qkv_reference(x, nw, w, qn, kn, positions, rotary, dtype)
    tol = _tol(dtype)
    torch.testing.assert_close(qbuf[:rows].view(rows, HQ, D).float(), q_ref.float(), **tol)
    torch.testing.assert_close(kb[loc].float(), k_ref.float(), **tol)
    torch.testing.assert_close(vb[loc].float(), v_ref.float(), **tol)
    untouched = torch.ones(SLOTS, dtype=torch.bool, device=DEV)
    untouched[loc] = False
    assert (kb[untouched] == sentinel).all() and (vb[untouched] == sentinel).all(), \
        "a slot outside out_cache_loc changed"
    assert torch.isnan(qbuf[rows:].float()).all(), "q rows beyond T were written"
    assert not cnt.any()
    return seen


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,qk_norm,split_k,hidden", [(1, False, 1, HID), (3, True, 2, 256), (8, True, 1, 120),
                                                        (2, False, 2, 120)])
def test_qkv_rope_prefetch_is_bit_identical(dtype: torch.dtype, rows: int, qk_norm: bool, split_k: int,
                                            hidden: int) -> None:
    """q, K and V with the activation prefetch equal those without, bit for bit (hidden 120: a partial last chunk)."""
    x = _randn(rows, hidden, dtype=dtype, seed=40)
    nw = (torch.rand(hidden, generator=_gen(41)) + 0.5).to(dtype=dtype, device=DEV)
    w = _randn((HQ + 2 * HKV) * D, hidden, dtype=dtype, seed=42, scale=0.2)
    qn = (torch.rand(D, generator=_gen(43)) + 0.5).to(dtype=dtype, device=DEV) if qk_norm else None
    kn = (torch.rand(D, generator=_gen(44)) + 0.5).to(dtype=dtype, device=DEV) if qk_norm else None
    positions = torch.randint(0, MAX_POS, (rows,), generator=_gen(45)).to(DEV)
    loc = (torch.randperm(SLOTS - 1, generator=_gen(46))[:rows] + 1).to(DEV)
    cos, sin = rope_cos_sin(D, 10000.0, MAX_POS, None, DEV)
    plan = plan_qkv(HQ, HKV, D, hidden, dtype, 4, split_k=split_k, block_k=16)
    assert plan.split_k == split_k and plan.pre_k < plan.k_per_split
    ws = torch.zeros(max(1, qkv_workspace_numel(plan, HQ, HKV, D)), device=DEV)
    cnt = torch.zeros(HQ + 2 * HKV, dtype=torch.int32, device=DEV)
    outs = []
    for prefetch in (False, True):
        kb = torch.zeros(SLOTS, HKV, D, dtype=dtype, device=DEV)
        vb = torch.zeros(SLOTS, HKV, D, dtype=dtype, device=DEV)
        q = torch.full((rows, HQ * D), float("nan"), dtype=dtype, device=DEV)
        qkv_rope(x, nw, w, num_heads=HQ, num_kv_heads=HKV, q_norm=qn, k_norm=kn, cos=cos, sin=sin,
                 positions=positions, out_cache_loc=loc, q_out=q, k_buffer=kb, v_buffer=vb, eps=EPS, plan=plan,
                 workspace=ws, counters=cnt, prefetch_act=prefetch)
        assert not cnt.any()
        outs.append((q, kb, vb))
    assert not torch.isnan(outs[0][0].float()).any()
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b), "prefetch on and off must give bit-identical outputs"


def test_rope_tables_are_the_general_paths() -> None:
    rs = {**LLAMA3, "original_max_position_embeddings": 8192, "factor": 32.0}
    cos, sin = rope_cos_sin(64, 500000.0, 100, rs, DEV)
    general = RotaryEmbedding(64, 500000.0, rs, 100, device=DEV)
    assert torch.equal(cos, general.cos_cache[:, :32]) and torch.equal(sin, general.sin_cache[:, :32])


# ---------------------------------------------------------------- PDL switches

def test_pdl_is_off_under_the_interpreter_and_by_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOWLAT_MEGA_PDL", "0")
    assert not pdl.pdl_enabled(DEV)
    assert pdl.launch_kwargs(False) == {}
    assert pdl.launch_kwargs(True) == {"launch_pdl": True}
    if pdl.interpreting():
        monkeypatch.setenv("LOWLAT_MEGA_PDL", "1")
        assert not pdl.pdl_enabled(DEV)
