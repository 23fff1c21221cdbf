"""The fused core kernels (rms_norm, rope_kv, silu_mul) against the plain torch ops, under the interpreter on CPU.

float32: bit for bit where the order of operations is the torch one; within 4 ulp where a sum's order differs
(the RMSNorm mean square) or exp differs (silu). float16 checks every intermediate rounding (the interpreter rounds
to nearest even as torch does). bf16: within the dtype's tolerance: Triton 3.9's interpreter casts float32 to bf16
by truncation where the GPU rounds to nearest even; on a GPU (the same file, DEV = cuda) bf16 bits are checked.
Mutation pass: bench/scripts/mutate_fused_kernels.py.
"""

from __future__ import annotations

import pytest
import torch
from lowlat.kernels.rms_norm import fused_add_rms_norm, rms_norm
from lowlat.kernels.rope_kv import qk_norm_rope_kv_write
from lowlat.kernels.silu_mul import silu_and_mul
from lowlat.layers.rotary import RotaryEmbedding
from lowlat.models.general_impl import torch_add_rms_norm, torch_rope_kv, torch_silu_mul

pytestmark = pytest.mark.gpu  # also run on a GPU: python bench/gpu_jobs.py gpu-tests (or general-tests)

NORM_ULPS = 4  # the mean square's summation order differs (1 ulp in the scale), then two roundings follow
EXP_ULPS = 4  # silu: the interpreter's (numpy's) or the GPU's exp against torch's
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: the interpreter (conftest.py)


def assert_ulp(got: torch.Tensor, want: torch.Tensor, ulps: int = NORM_ULPS) -> None:
    """float32 (and bf16 on a GPU): at most ``ulps`` units in the last place apart (0 = bit for bit).

    float16: the interpreter rounds float32 -> float16 to nearest even, as torch does, so each intermediate
    rounding is checked: at most 1 ulp apart, on at most 1% of the elements (0 when ``ulps`` is 0). A 1-ulp
    difference in a float32 intermediate rarely moves a float16 rounding; a missing or extra rounding moves many.
    bf16 under the interpreter: its float32 -> bf16 casts truncate, so each of a chain of roundings may be an
    ulp off; there the bound is the dtype tolerance widened to 2 bf16 ulps of the largest magnitude."""
    assert got.shape == want.shape and got.dtype == want.dtype
    if got.dtype == torch.bfloat16 and got.device.type == "cpu":
        atol = max(1e-2, 2 * 2 ** -8 * float(want.abs().max()))
        torch.testing.assert_close(got, want, rtol=1.6e-2, atol=atol)
        return
    view = torch.int32 if got.dtype == torch.float32 else torch.int16
    diff = (got.view(view).long() - want.view(view).long()).abs()
    if got.dtype == torch.float16:
        frac = float((diff > 0).float().mean())
        assert int(diff.max()) <= min(ulps, 1) and frac <= (0.01 if ulps else 0.0), (int(diff.max()), frac)
        return
    assert int(diff.max()) <= ulps, f"{int(diff.max())} ulps apart (at most {ulps} allowed)"


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, dtype: torch.dtype, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(*shape, generator=_gen(seed))).to(DEV, dtype)


# -- rms_norm --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("hidden", [64, 96])  # 96: BLOCK padded past the row
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rms_norm_matches_torch(hidden, dtype):
    x = _randn(5, hidden, dtype=dtype, scale=3.0)
    w = _randn(hidden, dtype=dtype, seed=1)
    want, _ = torch_add_rms_norm(x, None, w, 1e-6)
    got = rms_norm(x, w, 1e-6)
    assert_ulp(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fused_add_rms_norm_matches_torch_and_the_residual_is_the_rounded_sum(dtype):
    x = _randn(7, 80, dtype=dtype, scale=2.0)
    r = _randn(7, 80, dtype=dtype, seed=2, scale=4.0)
    w = _randn(80, dtype=dtype, seed=3)
    want, want_res = torch_add_rms_norm(x, r, w, 1e-5)
    got, got_res = fused_add_rms_norm(x, r, w, 1e-5)
    if dtype != torch.bfloat16 or DEV.type == "cuda":
        assert torch.equal(got_res, want_res)  # the add's rounded result, bit for bit
    else:  # the interpreter's float32 -> bf16 cast truncates (the GPU's rounds to nearest even): within 1 ulp
        torch.testing.assert_close(got_res, want_res, rtol=2 ** -7, atol=0)
    assert_ulp(got, want)


def test_rms_norm_eps_counts():
    x = _randn(3, 64, dtype=torch.float32, scale=0.01)  # mean square 1e-4: eps = 1e-3 changes the scale 3x
    w = _randn(64, dtype=torch.float32, seed=1)
    assert_ulp(rms_norm(x, w, 1e-3), torch_add_rms_norm(x, None, w, 1e-3)[0])


def test_rms_norm_reads_strided_rows():
    base = _randn(4, 128, dtype=torch.float32)
    x = base[:, :64]  # row stride 128
    w = _randn(64, dtype=torch.float32, seed=1)
    assert_ulp(rms_norm(x, w, 1e-6), torch_add_rms_norm(x, None, w, 1e-6)[0])


def test_rms_norm_launcher_rejects_bad_inputs():
    x = torch.zeros(2, 8, device=DEV)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.zeros(4, device=DEV), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        fused_add_rms_norm(x, torch.zeros(2, 8, dtype=torch.bfloat16, device=DEV), torch.zeros(8, device=DEV), 1e-6)
    with pytest.raises(ValueError, match="contiguous"):
        rms_norm(torch.zeros(8, 2, device=DEV).t(), torch.zeros(8, device=DEV), 1e-6)


# -- rope_kv ---------------------------------------------------------------------------------------------------

def _rope_case(dtype: torch.dtype, hq: int = 4, hkv: int = 2, d: int = 16, t: int = 5, slots: int = 12):
    rot = RotaryEmbedding(d, 10000.0, None, 64, device=DEV)
    qkv = _randn(t, (hq + 2 * hkv) * d, dtype=dtype, scale=2.0)
    positions = torch.tensor([0, 3, 17, 63, 9][:t], dtype=torch.int64, device=DEV)
    loc = torch.tensor([5, 1, 11, 7, 2][:t], dtype=torch.int64, device=DEV)
    sentinel = _randn(slots, hkv, d, dtype=dtype, seed=9)
    return rot, qkv, positions, loc, sentinel


def _run_both(dtype, qk_norm: bool, **kw):
    rot, qkv, pos, loc, sentinel = _rope_case(dtype, **kw)
    hq, hkv, d = kw.get("hq", 4), kw.get("hkv", 2), kw.get("d", 16)
    qn = _randn(d, dtype=dtype, seed=4) if qk_norm else None
    kn = _randn(d, dtype=dtype, seed=5) if qk_norm else None
    out = []
    for fn in (torch_rope_kv, None):
        kb, vb = sentinel.clone(), sentinel.clone() + 1
        if fn is None:
            q = qk_norm_rope_kv_write(qkv, pos, rot.cos_cache, rot.sin_cache, loc, kb, vb, num_q_heads=hq,
                                      num_kv_heads=hkv, head_dim=d, q_norm_weight=qn, k_norm_weight=kn, eps=1e-6)
        else:
            q = fn(qkv, pos, rot.cos_cache, rot.sin_cache, loc, kb, vb, hq, hkv, d, qn, kn, 1e-6)
        out.append((q, kb, vb))
    return out, loc, sentinel


@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_kv_float32_is_bitwise_without_norm_and_within_2ulp_with_it(qk_norm):
    (want, got), loc, _ = _run_both(torch.float32, qk_norm)
    for w, g in zip(want, got):
        assert_ulp(g, w, ulps=NORM_ULPS if qk_norm else 0)


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rope_kv_16_bit(qk_norm, dtype):
    (want, got), _, _ = _run_both(dtype, qk_norm)
    for w, g in zip(want, got):
        assert_ulp(g, w, ulps=NORM_ULPS if qk_norm else 0)


def test_rope_kv_writes_only_the_slots_of_out_cache_loc():
    (_, (q, kb, vb)), loc, sentinel = _run_both(torch.float32, True)
    untouched = torch.ones(sentinel.shape[0], dtype=torch.bool, device=DEV)
    untouched[loc] = False
    assert torch.equal(kb[untouched], sentinel[untouched])
    assert torch.equal(vb[untouched], sentinel[untouched] + 1)
    assert not torch.equal(kb[loc], sentinel[loc])


def test_rope_kv_head_dim_whose_half_is_not_a_power_of_two():
    (want, got), _, _ = _run_both(torch.float32, True, d=24, hq=2, hkv=1)
    for w, g in zip(want, got):
        assert_ulp(g, w)


def test_rope_kv_launcher_rejects_bad_inputs():
    rot, qkv, pos, loc, sentinel = _rope_case(torch.float32)
    kb = vb = sentinel.clone()
    args = (qkv, pos, rot.cos_cache, rot.sin_cache, loc, kb, vb)
    with pytest.raises(ValueError, match="columns"):
        qk_norm_rope_kv_write(*args, num_q_heads=3, num_kv_heads=2, head_dim=16)
    with pytest.raises(ValueError, match="both"):
        qk_norm_rope_kv_write(*args, num_q_heads=4, num_kv_heads=2, head_dim=16,
                              q_norm_weight=torch.ones(16, device=DEV))
    with pytest.raises(ValueError, match="out_cache_loc"):
        qk_norm_rope_kv_write(qkv, pos, rot.cos_cache, rot.sin_cache, loc[:2], kb, vb, num_q_heads=4,
                              num_kv_heads=2, head_dim=16)
    with pytest.raises(ValueError, match="cos_cache"):
        qk_norm_rope_kv_write(qkv, pos, rot.cos_cache.double(), rot.sin_cache, loc, kb, vb, num_q_heads=4,
                              num_kv_heads=2, head_dim=16)


# -- silu_mul --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_silu_mul_matches_torch(dtype):
    x = _randn(3, 2 * 1100, dtype=dtype, scale=4.0)  # 1100 columns: two column blocks, the second partial
    want = torch_silu_mul(x)
    got = silu_and_mul(x)
    assert_ulp(got, want, EXP_ULPS)


def test_silu_mul_launcher_rejects_an_odd_width():
    with pytest.raises(ValueError, match="even"):
        silu_and_mul(torch.zeros(2, 7, device=DEV))


# -- moe_gemv --------------------------------------------------------------------------------------------------

def _experts(dtype: torch.dtype, e: int = 6, hidden: int = 80, inter: int = 40):
    from lowlat.distributed import SINGLE
    from lowlat.layers.moe import FusedExperts

    ex = FusedExperts(e, hidden, inter, tp=SINGLE, dtype=dtype, device=DEV)
    ex.w13_weight.copy_(_randn(e, 2 * inter, hidden, dtype=dtype, seed=11, scale=0.2))
    ex.w2_weight.copy_(_randn(e, hidden, inter, dtype=dtype, seed=12, scale=0.2))
    return ex


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_moe_gemv_matches_fused_experts(dtype):
    from lowlat.kernels.moe_gemv import moe_experts_gemv

    ex = _experts(dtype)
    h = _randn(5, 80, dtype=dtype, seed=13)
    ids = torch.tensor([[0, 3], [3, 5], [1, 0], [5, 5], [2, 4]], dtype=torch.int64, device=DEV)
    weights = torch.rand(5, 2, generator=_gen(14)).to(DEV, dtype)
    want = ex(h, weights, ids)
    got = moe_experts_gemv(h, ex.w13_weight, ex.w2_weight, weights, ids)
    if dtype == torch.bfloat16:  # against float32 math: at most 3x the bf16 reference's own error (truncation here)
        exact = _experts(torch.float32)(h.float(), weights.float(), ids)
        err, ref_err = (got.float() - exact).abs().max().item(), (want.float() - exact).abs().max().item()
        assert err <= 3 * ref_err + 1e-2, (err, ref_err)
        return
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(got, want, **tol)


def test_fused_experts_dense_form_equals_the_selected_experts_loop():
    """``FusedExperts._forward_dense`` (every expert on every row, zero weights where not chosen: what a float32
    CUDA-graph capture runs) equals the loop over the chosen experts, a repeated expert in a row included."""
    ex = _experts(torch.float32)
    h = _randn(5, 80, dtype=torch.float32, seed=13)
    ids = torch.tensor([[0, 3], [3, 5], [1, 0], [5, 5], [2, 4]], dtype=torch.int64, device=DEV)
    weights = torch.rand(5, 2, generator=_gen(14)).to(DEV)
    torch.testing.assert_close(ex._forward_dense(h, weights, ids), ex._forward_loop(h, weights, ids), rtol=1e-5,
                               atol=1e-5)


def test_moe_gemv_launcher_rejects_bad_inputs():
    from lowlat.kernels.moe_gemv import moe_experts_gemv

    ex = _experts(torch.float32)
    h = _randn(2, 80, dtype=torch.float32)
    ids = torch.zeros(2, 2, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match="weights"):
        moe_experts_gemv(h, ex.w13_weight, ex.w2_weight, torch.ones(2, 3, device=DEV), ids)
    with pytest.raises(ValueError, match="w2"):
        moe_experts_gemv(h, ex.w13_weight, ex.w2_weight[:, :, :8], torch.ones(2, 2, device=DEV), ids)
