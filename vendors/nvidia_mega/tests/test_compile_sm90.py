"""Compile the dense kernels for sm90 at production shapes, without a GPU (LOWLAT_MEGA_COMPILE_CHECK=1, which
``nox -s tests`` and the gpu-tests job set).

The Triton interpreter runs kernels as Python, so it misses what only the compiler rejects (a loop-carried
variable whose shape changes, a non-constexpr where one is needed). This compiles each kernel to a cubin for
``GPUTarget("cuda", 90, 32)`` through ``triton.compile`` (ptxas ships with Triton) at the launch plans of
llama-3.2-1b and qwen3-30b-a3b, with the 16-byte divisibility hints real launches get, and checks the PDL
instructions are present. The one-row GEMV is compiled at every plan it runs in production (each ``TUNED_ROW1``
entry, and ``default_row1`` at the sites above), with the constants its launcher passes. Run without
``TRITON_INTERPRET``:

    LOWLAT_MEGA_COMPILE_CHECK=1 PYTHONPATH=core/src:vendors/nvidia_mega/src \\
        python -m pytest vendors/nvidia_mega/tests/test_compile_sm90.py -q
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import triton
from lowlat_nvidia_mega.kernels import pdl

pytestmark = pytest.mark.gpu  # also run on a GPU: python bench/gpu_jobs.py gpu-tests

if pdl.interpreting() or os.environ.get("LOWLAT_MEGA_COMPILE_CHECK") != "1":
    pytest.skip("sm90 compile check: set LOWLAT_MEGA_COMPILE_CHECK=1, unset TRITON_INTERPRET",
                allow_module_level=True)

from lowlat_nvidia_mega.kernels import gemv, tuned_plans  # noqa: E402
from lowlat_nvidia_mega.kernels.attention import (  # noqa: E402
    AttnPlan,
    _attn_merge_kernel,
    _attn_split_kernel,
    attention_block_m,
)
from lowlat_nvidia_mega.kernels.gemm_plans import GemmPlan, GemvPlan, make_plan, splitk_workspace_numel  # noqa: E402
from lowlat_nvidia_mega.kernels.norm_rows import _norm_rows_kernel  # noqa: E402
from lowlat_nvidia_mega.kernels.qk_late import check_row1_rows  # noqa: E402
from lowlat_nvidia_mega.kernels.qkv_rope import _qkv_rope_kernel  # noqa: E402
from lowlat_nvidia_mega.kernels.small_gemm import BLOCK_M, _small_gemm_kernel  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

BF = "*bf16"
NOT_DIVISIBLE = {"T", "eps", "max_pos", "scale_log2", "rank", "cap", "cap_tiles", "publish"}  # others: x16 here
PEER_SIG = dict(data_ptrs="*i64", flag_ptrs="*i64", tag_ptr="*i32", rank="i32", cap="i32", cap_tiles="i32",
                publish="i32")  # the "publish" epilogue's arguments (tp_epilogue.peer_launch_args), WORLD = 1 here
GEMM_SIG = dict(x_ptr=BF, stride_xm="i32", w_ptr=BF, stride_wn="i32", nw_ptr=BF, res_ptr=BF, stride_rm="i32",
                out_ptr=BF, stride_om="i32", ws_ptr="*fp32", cnt_ptr="*i32", T="i32", N="i32", K="i32",
                K_PER_SPLIT="i32", eps="fp32", **PEER_SIG)
GEMV_SIG = dict(x_ptr=BF, w_ptr=BF, stride_wn="i32", nw_ptr=BF, res_ptr=BF, out_ptr=BF, N="i32", K="i32",
                eps="fp32")
QKV_SIG = dict(x_ptr=BF, stride_xm="i32", w_ptr=BF, stride_wn="i32", nw_ptr=BF, qn_ptr=BF, kn_ptr=BF,
               cos_ptr="*fp32", sin_ptr="*fp32", max_pos="i32", pos_ptr="*i64", loc_ptr="*i64", q_ptr=BF,
               stride_qt="i32", k_ptr=BF, v_ptr=BF, stride_ks="i32", ws_ptr="*fp32", cnt_ptr="*i32", T="i32",
               K="i32", K_PER_SPLIT="i32", eps="fp32")
ATTN_SIG = dict(q_ptr=BF, stride_qt="i32", k_ptr=BF, v_ptr=BF, stride_ks="i32", rtt_ptr="*i32", stride_rtt="i32",
                rpi_ptr="*i64", seqlen_ptr="*i32", op_ptr="*fp32", lse_ptr="*fp32", scale_log2="fp32", qn_ptr=BF,
                kn_ptr=BF, cos_ptr="*fp32", sin_ptr="*fp32", pos_ptr="*i64", max_pos="i32", eps="fp32")
MERGE_SIG = dict(op_ptr="*fp32", lse_ptr="*fp32", seqlen_ptr="*i32", out_ptr=BF, stride_ot="i32")
CUDA = torch.device("cuda")  # only its name is asked for, through the patched ``device_name``
MODELS = {"llama-3.2-1b": (2048, 32, 8, 64, 8192, False), "qwen3-30b-a3b": (2048, 32, 4, 128, 768, True)}


def _compile(fn, types: dict[str, str], consts: dict[str, object], warps: int = 4, stages: int = 3) -> str:
    sig = {n: "constexpr" if n in consts else types[n] for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n not in consts and n not in NOT_DIVISIBLE}
    kernel = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": warps, "num_stages": stages})
    return kernel.asm["ptx"]


def _assert_pdl(ptx: str) -> None:
    assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx


@pytest.fixture(params=[False, True], ids=["heuristic", "tuned"])
def plans(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """``tuned_plans`` as on a 132-SM GPU: an H200 (its measured table) or a GPU without table entries."""
    monkeypatch.setattr(tuned_plans, "num_sms", lambda dev: 132)
    monkeypatch.setattr(tuned_plans, "device_name", lambda dev: "NVIDIA H200" if request.param else "other GPU")
    monkeypatch.setattr(tuned_plans, "device_chip", lambda dev: ((9, 0), 132) if request.param else ((8, 0), 108))
    return tuned_plans


@pytest.mark.parametrize("prefetch", [False, True], ids=["plain", "prefetch"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_small_gemm_compiles_for_sm90(model: str, prefetch: bool, plans) -> None:  # type: ignore[no-untyped-def]
    """Every call site of ``MegaForward``; ``prefetch``: the activation prefetch where the GEMM has a norm."""
    hid, hq, _, d, inter, _ = MODELS[model]
    sites = [("o_proj", hid, hq * d, 2, False)] + ([("gate_up", inter, hid, 1, True), ("down", hid, inter, 2, False)]
                                                    if model == "llama-3.2-1b" else [])
    for _, n, k, epilogue, norm in sites:
        gated = epilogue == 1
        plan = plans.gemm_plan(n, k, torch.bfloat16, CUDA, gated=gated)
        ptx = _compile(_small_gemm_kernel, GEMM_SIG, dict(
            NORM_K=k if norm else 0, RSTD_BLOCK=min(triton.next_power_of_2(k), 512), PRE_K=plan.pre_k,
            HAS_NORM=norm, EPILOGUE=epilogue, NPART=2 if gated else 1, SPLIT_K=plan.split_k, EVEN_K=True,
            BLOCK_M=BLOCK_M, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, DOT_F32=False, USE_PDL=True,
            PREFETCH_ACT=prefetch and norm, WORLD=1), stages=plan.num_stages, warps=plan.num_warps)
        _assert_pdl(ptx)
        assert "ld.global.v4" in ptx, "weight loads must be 16-byte vectors"


@pytest.mark.parametrize("prefetch", [False, True], ids=["plain", "prefetch"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_qkv_rope_compiles_for_sm90(model: str, prefetch: bool, plans) -> None:  # type: ignore[no-untyped-def]
    hid, hq, hkv, d, _, qk_norm = MODELS[model]
    plan = plans.qkv_plan(hq, hkv, d, hid, torch.bfloat16, CUDA, qk_norm=qk_norm)
    _assert_pdl(_compile(_qkv_rope_kernel, QKV_SIG, dict(
        NORM_K=hid, RSTD_BLOCK=512, PRE_K=plan.pre_k, HQ=hq, HKV=hkv, HALF=d // 2, HAS_QK_NORM=qk_norm,
        SPLIT_K=plan.split_k, EVEN_K=True, BLOCK_M=BLOCK_M, BLOCK_K=plan.block_k, DOT_F32=False, USE_PDL=True,
        PREFETCH_ACT=prefetch, ROW1=False, HAS_NORM=True, PAIRS=d // 2, QK_LATE=False), stages=plan.num_stages,
        warps=plan.num_warps))


# qkv_rope's one-row FMA loop at the candidates tune_plans.py --row1-only sweeps: (K chunk, split-K, warps)
QKV_ROW1 = [(128, 4, 4), (256, 4, 8), (256, 8, 4), (512, 2, 8)]


@pytest.mark.parametrize("block_k,split_k,warps", QKV_ROW1)
@pytest.mark.parametrize("model", sorted(MODELS))
def test_qkv_rope_one_row_loop_compiles_for_sm90(model: str, block_k: int, split_k: int, warps: int) -> None:
    hid, hq, hkv, d, _, qk_norm = MODELS[model]
    plan = make_plan(hid, block_n=d, block_k=block_k, split_k=split_k, num_warps=warps, num_stages=1, weight_rows=d)
    ptx = _compile(_qkv_rope_kernel, QKV_SIG, dict(
        NORM_K=hid, RSTD_BLOCK=512, PRE_K=plan.pre_k, HQ=hq, HKV=hkv, HALF=d // 2, HAS_QK_NORM=qk_norm,
        SPLIT_K=plan.split_k, EVEN_K=True, BLOCK_M=1, BLOCK_K=plan.block_k, DOT_F32=False, USE_PDL=True,
        PREFETCH_ACT=False, ROW1=True, HAS_NORM=True, PAIRS=d // 2, QK_LATE=False), stages=plan.num_stages,
        warps=plan.num_warps)
    _assert_pdl(ptx)
    assert "ld.global.v4" in ptx and "mma" not in ptx, "16-byte weight loads, FMA only"


# the row-pair form's candidates in tune_plans.py --row1-only: (rows per program, K chunk, warps)
QKV_PAIRS = [(4, 2048, 4), (8, 2048, 8), (16, 1024, 4), (16, 2048, 8)]


@pytest.mark.parametrize("block_n,block_k,warps", QKV_PAIRS)
@pytest.mark.parametrize("model", sorted(MODELS))
def test_qkv_rope_row_pair_form_compiles_for_sm90(model: str, block_n: int, block_k: int, warps: int) -> None:
    """The row-pair form: PDL, 16-byte weight loads, no MMA, and no ticket (no atomics): a program reads all of K;
    at qwen3-30b-a3b's shape (q/k norm) with late q/k (kernels/qk_late.py)."""
    hid, hq, hkv, d, _, qk_norm = MODELS[model]
    plan = make_plan(hid, block_n=d, block_k=block_k, split_k=1, num_warps=warps, num_stages=1,
                     weight_rows=block_n)
    ptx = _compile(_qkv_rope_kernel, QKV_SIG, dict(
        NORM_K=hid, RSTD_BLOCK=512, PRE_K=plan.pre_k, HQ=hq, HKV=hkv, HALF=d // 2, HAS_QK_NORM=qk_norm,
        SPLIT_K=1, EVEN_K=True, BLOCK_M=1, BLOCK_K=plan.block_k, DOT_F32=False, USE_PDL=True,
        PREFETCH_ACT=False, ROW1=True, HAS_NORM=True, PAIRS=block_n // 2, QK_LATE=qk_norm), stages=1, warps=warps)
    _assert_pdl(ptx)
    assert "ld.global.v4" in ptx and "mma" not in ptx and "atom" not in ptx


NORM_SIG = dict(x_ptr=BF, stride_xm="i32", nw_ptr=BF, h_ptr=BF, stride_hm="i32", T="i32", eps="fp32")


@pytest.mark.parametrize("model", sorted(MODELS))
def test_prenorm_kernels_compile_for_sm90(model: str, plans) -> None:  # type: ignore[no-untyped-def]
    """A prenorm step (``LOWLAT_MEGA_PRENORM=1``, 2-8 rows): ``norm_rows`` (PDL), and qkv_rope without its norm
    prologue at the production plan: the same MMAs and weight copies, without the row statistics' loads (sm90
    PTX of Triton 3.9: 32 global loads instead of 65 at llama-3.2-1b, 2342 lines instead of 5992)."""
    hid, hq, hkv, d, _, qk_norm = MODELS[model]
    _assert_pdl(_compile(_norm_rows_kernel, NORM_SIG, dict(K=hid, RSTD_BLOCK=512, BLOCK_K=512, USE_PDL=True)))
    plan = plans.qkv_plan(hq, hkv, d, hid, torch.bfloat16, CUDA, qk_norm=qk_norm)
    fused, pre = (_compile(_qkv_rope_kernel, QKV_SIG, dict(
        NORM_K=hid, RSTD_BLOCK=512, PRE_K=plan.pre_k, HQ=hq, HKV=hkv, HALF=d // 2, HAS_QK_NORM=qk_norm,
        SPLIT_K=plan.split_k, EVEN_K=True, BLOCK_M=BLOCK_M, BLOCK_K=plan.block_k, DOT_F32=False, USE_PDL=True,
        PREFETCH_ACT=False, ROW1=False, HAS_NORM=norm, PAIRS=d // 2, QK_LATE=False), stages=plan.num_stages,
        warps=plan.num_warps) for norm in (True, False))
    _assert_pdl(pre)
    assert pre.count("mma") == fused.count("mma") > 0
    assert pre.count("ld.global") < fused.count("ld.global"), "without the prologue no row statistics are loaded"


@pytest.mark.parametrize("plans", [True], ids=["tuned"], indirect=True)
@pytest.mark.parametrize("model", sorted(MODELS))
def test_qkv_rope_tuned_row1_compiles_for_sm90(model: str, plans) -> None:  # type: ignore[no-untyped-def]
    """qkv_rope's one-row loop at the plan the H200 runs (``TUNED_ROW1``'s "qkv" entry through ``qkv_plan``), as
    ``qkv_rope`` launches it: the row1 plan's K chunk, split-K, warps and stages."""
    hid, hq, hkv, d, _, qk_norm = MODELS[model]
    r1 = plans.qkv_plan(hq, hkv, d, hid, torch.bfloat16, CUDA, qk_norm=qk_norm).row1
    assert r1 == GemvPlan(*plans.TUNED_ROW1[("NVIDIA H200", "qkv", (hq + 2 * hkv) * d, hid, "bfloat16")])
    pairs = check_row1_rows(r1, d, qk_norm)
    plan = make_plan(hid, block_n=d, block_k=r1.block_k, split_k=r1.split_k, num_warps=r1.num_warps,
                     num_stages=r1.num_stages, weight_rows=2 * pairs)
    ptx = _compile(_qkv_rope_kernel, QKV_SIG, dict(
        NORM_K=hid, RSTD_BLOCK=512, PRE_K=plan.pre_k, HQ=hq, HKV=hkv, HALF=d // 2, HAS_QK_NORM=qk_norm,
        SPLIT_K=plan.split_k, EVEN_K=True, BLOCK_M=1, BLOCK_K=plan.block_k, DOT_F32=False, USE_PDL=True,
        PREFETCH_ACT=False, ROW1=True, HAS_NORM=True, PAIRS=pairs, QK_LATE=False), stages=plan.num_stages,
        warps=plan.num_warps)
    _assert_pdl(ptx)
    assert "ld.global.v4" in ptx and "mma" not in ptx, "16-byte weight loads, FMA only"


def _compile_attention(model: str, rows: int, plan: AttnPlan, late: bool = False) -> str:
    _, hq, hkv, d, _, _ = MODELS[model]
    bm = attention_block_m(hq, hkv, rows)
    consts = dict(HKV=hkv, G=hq // hkv, R=rows, D=d, BLOCK_M=bm, BLOCK_KV=plan.block_kv, NUM_SPLITS=plan.num_splits,
                  USE_PDL=True)
    split = _compile(_attn_split_kernel, ATTN_SIG, dict(consts, DOT_F32=False, LATE=late), warps=plan.split_warps,
                     stages=plan.split_stages)
    _assert_pdl(split)
    _assert_pdl(_compile(_attn_merge_kernel, MERGE_SIG, dict(consts, HQ=hq), warps=plan.merge_warps))
    return split


@pytest.mark.parametrize("plans", [True], ids=["tuned"], indirect=True)
def test_late_qk_attention_compiles_for_sm90(plans) -> None:  # type: ignore[no-untyped-def]
    """qwen3-30b-a3b's batch-1 attention finishing raw q and the new K row (kernels/qk_late.py): PDL kept, and the
    finished row stored (a store to the K pool, which the plain split kernel never makes)."""
    _, hq, hkv, d, _, _ = MODELS["qwen3-30b-a3b"]
    plan = plans.attn_plan(1, 1, hq, hkv, d, 2048, 132, torch.bfloat16, device=CUDA)
    late, plain = (_compile_attention("qwen3-30b-a3b", 1, plan, late=flag) for flag in (True, False))
    assert late.count("st.global") > plain.count("st.global")


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("batch,rows", [(1, 1), (8, 1), (1, 8)])
def test_attention_compiles_for_sm90(model: str, batch: int, rows: int, plans) -> None:  # type: ignore[no-untyped-def]
    """The plan ``MegaForward`` runs at engine max_context_len 2048."""
    _, hq, hkv, d, _, _ = MODELS[model]
    _compile_attention(model, rows, plans.attn_plan(batch, rows, hq, hkv, d, 2048, 132, torch.bfloat16, device=CUDA))


# corners of tune_attention.py's candidates: (splits, BLOCK_KV, split warps, split stages, merge warps)
@pytest.mark.parametrize("plan", [AttnPlan(64, 32, 2, 1, 1), AttnPlan(16, 128, 8, 3, 4), AttnPlan(4, 128, 2, 3, 2)],
                         ids=str)
def test_attention_sweep_corners_compile_for_sm90(plan: AttnPlan) -> None:
    for model in MODELS:
        _compile_attention(model, 8, plan)


# ---------------------------------------------------------------- one-row GEMV

META = torch.device("meta")
GEMV_KERNEL = gemv._gemv_kernel
STREAM_KERNEL = gemv._gemv_stream_kernel


def _gemm_sites(model: str) -> list[tuple[str, int, int, str, bool]]:
    """``MegaForward``'s dense GEMMs of ``model``: (site, N, K, epilogue, with norm); an MoE model has only o_proj."""
    hid, hq, _, d, inter, _ = MODELS[model]
    return [("o_proj", hid, hq * d, "residual", False)] + (
        [("gate_up", inter, hid, "silu_mul", True), ("down", hid, inter, "residual", False)]
        if model == "llama-3.2-1b" else [])


class _CaptureGemv:
    """Stands in for ``_gemv_kernel`` / ``_gemv_stream_kernel``: records ``kernel[grid](*args, **kwargs)``."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[int, ...], tuple[object, ...], dict[str, object]]] = []

    def __getitem__(self, grid: tuple[int, ...]):  # type: ignore[no-untyped-def]
        return lambda *args, **kwargs: self.calls.append((grid, args, kwargs))


def _compile_gemv_site(monkeypatch: pytest.MonkeyPatch, n: int, k: int, epilogue: str, norm: bool,
                       plan: GemmPlan) -> str:
    """Launch ``gemv.gemm`` at one row as the call site does (meta tensors, PDL on), then compile the captured
    launch (GEMV_SIG's types, the launcher's constants and warps / stages) and check its PTX: PDL, the weight
    tile loaded before the wait as 16-byte vectors only, one per 8 weight elements a thread holds, and (the weight
    stream, ``per_sm`` > 0) no local memory. Returns the PTX."""
    gated = epilogue == "silu_mul"
    row1 = plan.row1
    assert row1 is not None
    stream = row1.per_sm > 0
    cap = _CaptureGemv()
    monkeypatch.setattr(gemv, "_gemv_stream_kernel" if stream else "_gemv_kernel", cap)
    bf = dict(dtype=torch.bfloat16, device=META)
    out = torch.empty(1, n, **bf)
    ws = torch.empty(max(1, splitk_workspace_numel(plan, n, gated=gated, rows=1)), device=META)
    gemv.gemm(torch.empty(1, k, **bf), torch.empty(2 * n if gated else n, k, **bf), out, plan=plan,
              epilogue=epilogue, norm_weight=torch.empty(k, **bf) if norm else None,
              residual=out if epilogue == "residual" else None, workspace=ws,
              counters=torch.empty(plan.n_tiles(n), dtype=torch.int32, device=META), use_pdl=True)
    (grid, _, kwargs), = cap.calls
    tiles = triton.cdiv(n, row1.block_n)
    assert grid == ((gemv.stream_grid(row1, n, META),) if stream else (tiles,))
    assert kwargs["EPILOGUE"] == (1 if gated else 2) and kwargs["HAS_NORM"] is norm and kwargs["USE_PDL"] is True
    fn = STREAM_KERNEL if stream else GEMV_KERNEL
    consts = {name: kwargs[name] for name in fn.arg_names if name in kwargs}
    ptx = _compile(fn, GEMV_SIG, consts, warps=kwargs["num_warps"], stages=kwargs["num_stages"])
    _assert_pdl(ptx)
    pre_wait = ptx[:ptx.index("griddepcontrol.launch_dependents")]
    loads = [ln.split()[1] for ln in pre_wait.splitlines() if "ld.global" in ln]
    per_vector = 16 // torch.bfloat16.itemsize
    tile = (2 if gated else 1) * row1.block_n * row1.block_k  # weight elements of the chunk(s) before the wait
    assert loads and all(op.startswith("ld.global.v4") for op in loads), \
        f"weight loads must be 16-byte vectors, got {sorted(set(loads))}"
    assert len(loads) == tile // (per_vector * 32 * row1.num_warps), "each weight element loaded once per thread"
    assert ptx.count("ld.global.v4") >= 2 * len(loads), "the K loop's weight loads must be 16-byte vectors too"
    if stream:
        assert "ld.local" not in ptx and "st.local" not in ptx, "the weight stream's register ring spilled"
    return ptx


@pytest.mark.parametrize("model", sorted(MODELS))
def test_gemv_compiles_for_sm90(model: str, plans, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """Every dense call site of ``MegaForward`` at one row: ``TUNED_ROW1``'s plan on the H200 where the table has
    the shape, else ``default_row1``."""
    for _, n, k, epilogue, norm in _gemm_sites(model):
        gated = epilogue == "silu_mul"
        plan = plans.gemm_plan(n, k, torch.bfloat16, CUDA, gated=gated)
        key = (plans.device_name(CUDA), "gated" if gated else "gemm", n, k, "bfloat16")
        assert plan.row1 == (GemvPlan(*plans.TUNED_ROW1[key]) if key in plans.TUNED_ROW1
                             else plans.default_row1(k, gated=gated))
        _compile_gemv_site(monkeypatch, n, k, epilogue, norm, plan)


STREAM_PLANS = [  # (N, K, gated, weight-stream plan): llama-3.2-1b's and qwen3-8b's GEMMs at K chunks of one and more
    (8192, 2048, True, GemvPlan(2, 2048, 4, 1, per_sm=4)), (2048, 8192, False, GemvPlan(2, 2048, 8, 1, per_sm=2)),
    (2048, 2048, False, GemvPlan(4, 1024, 4, 3, per_sm=4)), (12288, 4096, True, GemvPlan(2, 1024, 4, 1, per_sm=8)),
]


@pytest.mark.parametrize("n,k,gated,row1", STREAM_PLANS, ids=lambda v: str(v) if isinstance(v, int) else None)
def test_gemv_weight_stream_compiles_for_sm90(n: int, k: int, gated: bool, row1: GemvPlan,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The weight stream (``GemvPlan.per_sm``) at plans a ``tune_plans.py --stream`` sweep tries: PDL, the first
    chunk before the wait in 16-byte vectors, and a register ring that does not spill."""
    plan = dataclasses.replace(make_plan(k, block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=3,
                                         weight_rows=64), row1=row1)
    _compile_gemv_site(monkeypatch, n, k, "silu_mul" if gated else "residual", gated, plan)


@pytest.mark.parametrize("plans", [True], ids=["tuned"], indirect=True)
@pytest.mark.parametrize("key", sorted(k for k in tuned_plans.TUNED_ROW1 if k[1] in ("gemm", "gated")),
                         ids=lambda key: f"{key[1]}-{key[2]}x{key[3]}")
def test_gemv_tuned_row1_compiles_for_sm90(key: tuple[str, str, int, int, str], plans,  # type: ignore[no-untyped-def]
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Every GEMV entry of ``TUNED_ROW1`` (qwen3-8b's too; "qkv" entries are qkv_rope's), through ``gemm_plan`` on its
    GPU (the H200, or the H100's weight stream), with its call site's epilogue: gated = gate_up (SwiGLU, norm
    prologue), gemm = o_proj / down (residual, no norm)."""
    gpu, kind, n, k, dtype = key
    assert dtype == "bfloat16"
    gated = kind == "gated"
    monkeypatch.setattr(plans, "device_name", lambda dev: gpu)  # the entry's own GPU (an sm90 132-SM chip)
    plan = plans.gemm_plan(n, k, torch.bfloat16, CUDA, gated=gated)
    assert plan.row1 == GemvPlan(*plans.TUNED_ROW1[key])
    _compile_gemv_site(monkeypatch, n, k, "silu_mul" if gated else "residual", gated, plan)
