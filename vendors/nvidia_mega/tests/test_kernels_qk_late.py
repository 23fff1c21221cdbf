"""Late q/k (kernels/qk_late.py): qkv_rope's row-pair form stores Qwen3's q and k raw, and the attention's split kernel
applies the q/k RMSNorm and RoPE, writing each new K row back finished. Against torch references: the attention on
raw q/k equals the attention on q/k finished by core's ``rms_norm`` and ``apply_rotary``, the KV pool afterwards
holds the finished row at the new slot and nothing else changed; qkv_rope with ``qk_late`` stores exactly the
projection; the refusals.

Runs on CPU under ``TRITON_INTERPRET=1`` (tiny shapes) and, unchanged, on a CUDA GPU.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from lowlat.layers.attention import decode_attention_torch
from lowlat.layers.norm import rms_norm
from lowlat.layers.rotary import RotaryEmbedding, apply_rotary
from lowlat_nvidia_mega.kernels import pdl
from lowlat_nvidia_mega.kernels.attention import AttnPlan, paged_decode_attention, partial_numel
from lowlat_nvidia_mega.kernels.gemm_plans import GemvPlan
from lowlat_nvidia_mega.kernels.qk_late import LateQK, check_row1_rows, late_qk
from lowlat_nvidia_mega.kernels.qkv_rope import plan_qkv, qkv_rope, rope_cos_sin

pytestmark = pytest.mark.gpu  # also run on a GPU: python bench/gpu_jobs.py gpu-tests

if not pdl.interpreting() and not torch.cuda.is_available():
    pytest.skip("Triton kernels need a CUDA GPU or TRITON_INTERPRET=1", allow_module_level=True)

DEV = torch.device("cpu" if pdl.interpreting() else "cuda")
HQ, HKV, D, HID = 4, 2, 32, 64
MAX_LEN, SLOTS, MAX_POS, EPS = 96, 512, 128, 1e-6


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _finish(raw: torch.Tensor, w: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The general path's q/k norm then RoPE of raw [T, H, D] rows (lowlat.layers)."""
    rotary = RotaryEmbedding(D, 10000.0, None, MAX_POS, device=DEV)
    cos, sin = rotary(positions, raw.dtype)
    return apply_rotary(rms_norm(raw, w, EPS), cos, sin)


def _late_case(batch: int, dtype: torch.dtype, seed: int, splits: int):  # type: ignore[no-untyped-def]
    g = _gen(seed)
    kb = torch.randn(SLOTS, HKV, D, generator=g).to(dtype=dtype, device=DEV)
    vb = torch.randn(SLOTS, HKV, D, generator=g).to(dtype=dtype, device=DEV)
    # every request's slots distinct from every other's (slot 0 unused), as the engine's KV pool keeps them
    rtt = (torch.randperm(SLOTS - 1, generator=g)[:(batch + 1) * MAX_LEN] + 1).view(batch + 1, MAX_LEN).to(torch.int32)
    rpi = torch.randperm(batch + 1, generator=g)[:batch]
    seq = torch.randint(MAX_LEN // 2, MAX_LEN, (batch,), generator=g).to(torch.int32)  # RoPE far from position 0
    if batch > 1:
        seq[0] = 1  # a request whose cache holds only this step's row (position 0: cos 1, sin 0)
    q = torch.randn(batch, HQ, D, generator=g).to(dtype=dtype, device=DEV)
    qn = (torch.rand(D, generator=g) + 0.5).to(dtype=dtype, device=DEV)
    kn = (torch.rand(D, generator=g) + 0.5).to(dtype=dtype, device=DEV)
    positions = (seq - 1).to(torch.int64).to(DEV)
    new_slots = rtt[rpi, seq.long() - 1].long().to(DEV)
    return q, kb, vb, rtt.to(DEV), rpi.to(DEV), seq.to(DEV), qn, kn, positions, new_slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,splits,block_kv", [(1, 1, 16), (1, 4, 16), (3, 2, 32)])
def test_late_attention_matches_attention_on_finished_qk(dtype: torch.dtype, batch: int, splits: int,
                                                        block_kv: int) -> None:
    q, kb, vb, rtt, rpi, seq, qn, kn, positions, new_slots = _late_case(batch, dtype, 7 + batch + splits, splits)
    plan = AttnPlan(num_splits=splits, block_kv=block_kv, split_warps=4, split_stages=1, merge_warps=1)
    cos, sin = rope_cos_sin(D, 10000.0, MAX_POS, None, DEV)
    # reference: finish q and the new K rows with torch, then the plain attention
    q_done = _finish(q, qn, positions)
    kb_done = kb.clone()
    kb_done[new_slots] = _finish(kb[new_slots], kn, positions)
    ref = decode_attention_torch(q_done, kb_done, vb, rtt, rpi, seq, 1, D ** -0.5)

    n_o, n_l = partial_numel(batch, HQ, HKV, D, 1, plan)
    out = torch.full((batch, HQ * D), float("nan"), dtype=dtype, device=DEV)
    vb0 = vb.clone()
    paged_decode_attention(q, kb, vb, rtt, rpi, seq, out, rows_per_req=1, sm_scale=D ** -0.5, plan=plan,
                           o_partial=torch.full((n_o,), float("nan"), device=DEV),
                           lse_partial=torch.full((n_l,), float("nan"), device=DEV),
                           late=LateQK(qn, kn, cos, sin, positions, EPS))
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 2e-2}
    torch.testing.assert_close(out.view(batch, HQ, D).float(), ref.float(), **tol)
    # the pool: the finished row at each new slot, nothing else changed. Bit for bit in bf16 under the interpreter
    # (the same roundings, in torch's float32 ops); on a GPU within a rounding step of the products, as for qkv_rope's
    # own K rows (test_kernels_dense): Triton's sqrt and division and torch's rsqrt are not correctly rounded, so the
    # float32 rstd may differ in its last bits and flip a bf16 rounding (an H100 flipped 15-27% of the elements,
    # by at most 2**-6, bench/results/2026-12-06-h100-mega-late-qk).
    bf16_tol = {"atol": 0, "rtol": 0} if DEV.type == "cpu" else {"atol": 2 ** -5, "rtol": 2 ** -6}
    torch.testing.assert_close(kb[new_slots].float(), kb_done[new_slots].float(),
                               **({"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else bf16_tol))
    others = torch.ones(SLOTS, dtype=torch.bool, device=DEV)
    others[new_slots] = False
    assert torch.equal(kb[others], kb_done[others]) and torch.equal(vb, vb0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qkv_rope_late_stores_the_raw_projection(dtype: torch.dtype) -> None:
    """The row-pair form with ``qk_late``: q and k as ``F.linear`` of the normalized input leaves them, v too."""
    g = _gen(3)
    x = torch.randn(1, HID, generator=g).to(dtype=dtype, device=DEV)
    nw = (torch.rand(HID, generator=g) + 0.5).to(dtype=dtype, device=DEV)
    w = (0.2 * torch.randn((HQ + 2 * HKV) * D, HID, generator=g)).to(dtype=dtype, device=DEV)
    qn = kn = torch.ones(D, dtype=dtype, device=DEV)
    cos, sin = rope_cos_sin(D, 10000.0, MAX_POS, None, DEV)
    plan = plan_qkv(HQ, HKV, D, HID, dtype, 4, split_k=1, block_k=16)
    plan = dataclasses.replace(plan, row1=GemvPlan(block_n=8, block_k=32, num_warps=4, num_stages=1))
    kb = torch.zeros(8, HKV, D, dtype=dtype, device=DEV)
    vb = torch.zeros(8, HKV, D, dtype=dtype, device=DEV)
    q = torch.zeros(1, HQ * D, dtype=dtype, device=DEV)
    loc = torch.tensor([5], device=DEV)
    qkv_rope(x, nw, w, num_heads=HQ, num_kv_heads=HKV, q_norm=qn, k_norm=kn, cos=cos, sin=sin,
             positions=torch.tensor([9], device=DEV), out_cache_loc=loc, q_out=q, k_buffer=kb, v_buffer=vb, eps=EPS,
             plan=plan, qk_late=True)
    ref = F.linear(rms_norm(x, nw, EPS), w)
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(q.float(), ref[:, :HQ * D].float(), **tol)
    torch.testing.assert_close(kb[5].reshape(1, -1).float(), ref[:, HQ * D:(HQ + HKV) * D].float(), **tol)
    torch.testing.assert_close(vb[5].reshape(1, -1).float(), ref[:, (HQ + HKV) * D:].float(), **tol)


def test_late_qk_says_when() -> None:
    head = plan_qkv(HQ, HKV, D, HID, torch.float32, 4)
    pairs = dataclasses.replace(head, row1=GemvPlan(block_n=8, block_k=32, num_warps=4, num_stages=1))
    per_head = dataclasses.replace(head, row1=GemvPlan(block_n=D, block_k=32, num_warps=4, num_stages=1, split_k=2))
    assert late_qk(1, pairs, True)
    assert not late_qk(2, pairs, True), "one row only"
    assert not late_qk(1, per_head, True), "a head per program finishes q/k itself"
    assert not late_qk(1, head, True) and not late_qk(1, pairs, False)


def test_refusals() -> None:
    pairs = GemvPlan(block_n=8, block_k=32, num_warps=4, num_stages=1)
    assert check_row1_rows(pairs, D, True, qk_late=True) == 4
    with pytest.raises(ValueError, match="qk_late=True"):
        check_row1_rows(pairs, D, True)
    with pytest.raises(ValueError, match="qk_late serves"):
        check_row1_rows(pairs, D, False, qk_late=True)
    with pytest.raises(ValueError, match="qk_late serves"):
        check_row1_rows(GemvPlan(block_n=D, block_k=32, num_warps=4, num_stages=1), D, True, qk_late=True)
    two = torch.zeros(2, HID, device=DEV)
    plan_q = plan_qkv(HQ, HKV, D, HID, torch.float32, 4, split_k=1, block_k=16)
    plan_q = dataclasses.replace(plan_q, row1=pairs)
    cos, sin = rope_cos_sin(D, 10000.0, MAX_POS, None, DEV)
    with pytest.raises(ValueError, match="qk_late serves the one-row loop"):
        qkv_rope(two, None, torch.zeros((HQ + 2 * HKV) * D, HID, device=DEV), num_heads=HQ, num_kv_heads=HKV,
                 q_norm=torch.ones(D, device=DEV), k_norm=torch.ones(D, device=DEV), cos=cos, sin=sin,
                 positions=torch.zeros(2, dtype=torch.int64, device=DEV),
                 out_cache_loc=torch.zeros(2, dtype=torch.int64, device=DEV), q_out=torch.zeros(2, HQ * D, device=DEV),
                 k_buffer=torch.zeros(4, HKV, D, device=DEV), v_buffer=torch.zeros(4, HKV, D, device=DEV), eps=EPS,
                 plan=plan_q, qk_late=True)
    q, kb, vb, rtt, rpi, seq, qn, kn, positions, _ = _late_case(1, torch.float32, 1, 1)
    plan = AttnPlan(num_splits=1, block_kv=16, split_warps=4, split_stages=1, merge_warps=1)
    n_o, n_l = partial_numel(1, HQ, HKV, D, 2, plan)
    ws = dict(o_partial=torch.zeros(n_o, device=DEV), lse_partial=torch.zeros(n_l, device=DEV))
    with pytest.raises(ValueError, match="one row per request"):
        paged_decode_attention(torch.cat([q, q]), kb, vb, rtt, rpi, seq + 1, torch.empty(2, HQ * D, device=DEV),
                               rows_per_req=2, sm_scale=1.0, plan=plan, late=LateQK(qn, kn, cos, sin, positions, EPS),
                               **ws)
    qn2 = torch.stack([qn, 0 * qn], 1).reshape(-1)[::2]  # the right values, every other element: strided
    for bad, match in ((LateQK(qn[:-1], kn, cos, sin, positions, EPS), "q_norm"),
                       (LateQK(qn2, kn, cos, sin, positions, EPS), "q_norm"),
                       (LateQK(qn, qn2, cos, sin, positions, EPS), "k_norm"),
                       (LateQK(None, kn, cos, sin, positions, EPS), "q_norm must be a torch.Tensor"),
                       (LateQK(qn, kn, cos[:, :-1], sin, positions, EPS), "cos"),
                       (LateQK(qn, kn, cos[:0], sin[:0], positions, EPS), "max_pos >= 1"),
                       (LateQK(qn, kn, cos, sin, positions.float(), EPS), "positions"),
                       (LateQK(qn, kn, cos, sin, positions, -1.0), "eps"),
                       (LateQK(qn, kn, cos, sin, positions, None), "eps")):
        with pytest.raises(ValueError, match=match):
            paged_decode_attention(q, kb, vb, rtt, rpi, seq, torch.empty(1, HQ * D, device=DEV), rows_per_req=1,
                                   sm_scale=1.0, plan=plan, late=bad, **ws)


def test_late_positions_must_be_dense() -> None:
    cos, sin = rope_cos_sin(D, 10000.0, MAX_POS, None, DEV)
    w = torch.ones(D, device=DEV)
    strided = torch.tensor([5, 0, 9, 0], device=DEV)[::2]
    with pytest.raises(ValueError, match="positions must be a contiguous"):
        LateQK(w, w, cos, sin, strided, EPS).check(2, D, torch.float32, DEV)
    LateQK(w, w, cos, sin, strided.contiguous(), EPS).check(2, D, torch.float32, DEV)


def test_check_row1_rows_needs_a_power_of_two_head() -> None:
    with pytest.raises(ValueError, match="power of two"):
        check_row1_rows(GemvPlan(block_n=16, block_k=16, num_warps=4, num_stages=1), 24, False)


def _qkv_args(dtype: torch.dtype = torch.float32) -> dict:
    cos, sin = rope_cos_sin(D, 10000.0, MAX_POS, None, DEV)
    return dict(x=torch.zeros(2, HID, dtype=dtype, device=DEV), norm_weight=None,
                w_qkv=torch.zeros((HQ + 2 * HKV) * D, HID, dtype=dtype, device=DEV), num_heads=HQ, num_kv_heads=HKV,
                q_norm=torch.ones(D, dtype=dtype, device=DEV), k_norm=torch.ones(D, dtype=dtype, device=DEV),
                cos=cos, sin=sin, positions=torch.zeros(2, dtype=torch.int64, device=DEV),
                out_cache_loc=torch.tensor([1, 2], device=DEV), q_out=torch.zeros(2, HQ * D, dtype=dtype, device=DEV),
                k_buffer=torch.zeros(4, HKV, D, dtype=dtype, device=DEV),
                v_buffer=torch.zeros(4, HKV, D, dtype=dtype, device=DEV), eps=EPS,
                plan=plan_qkv(HQ, HKV, D, HID, dtype, 4, split_k=1, block_k=16))


@pytest.mark.parametrize("field,bad,match", [
    ("sin", lambda a: a["sin"].half(), "cos and sin"),
    ("sin", lambda a: a["sin"].int(), "cos and sin"),
    ("cos", lambda a: a["cos"][:0], "max_pos >= 1"),
    ("sin", lambda a: a["sin"][:0], "max_pos >= 1"),
    ("positions", lambda a: torch.tensor([0, 9, 0, 9], device=DEV)[::2], "positions"),
    ("out_cache_loc", lambda a: torch.tensor([1, 0, 2, 0], device=DEV)[::2], "out_cache_loc"),
    ("q_norm", lambda a: torch.stack([a["q_norm"], a["q_norm"]], 1).reshape(-1)[::2], "q_norm"),
    ("k_norm", lambda a: a["k_norm"].double(), "k_norm"),
])
def test_qkv_rope_refuses_tables_and_indices_it_would_misread(field: str, bad, match: str) -> None:  # type: ignore[no-untyped-def]
    """Every tensor qkv_rope indexes densely must be contiguous and of the dtype it reads (a strided position or
    norm weight, an fp16 sin table, an empty table were accepted and misread)."""
    args = _qkv_args()
    args[field] = bad(args)
    with pytest.raises(ValueError, match=match):
        qkv_rope(**args)
