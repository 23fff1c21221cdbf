"""nvidia_mega's paged decode attention against core's torch reference, at the heuristic plan and at non-default
``AttnPlan`` s (KV blocks of 16-128, 1 to 64 splits, 1-3 stages, 1-8 warps), DECODE and VERIFY rows, ragged lengths;
``AttnPlan``'s refusals; the heuristic plan against the formula it replaced; the measured-table lookup.

Runs on CPU under ``TRITON_INTERPRET=1`` (tiny shapes; warps and stages only matter on a GPU) and, unchanged, on
a CUDA GPU. The partial workspaces and the output rows beyond T are poisoned with NaN.
"""

from __future__ import annotations

import pytest
import torch
import triton
from lowlat.layers.attention import decode_attention_torch
from lowlat_nvidia_mega.kernels import pdl, tuned_plans
from lowlat_nvidia_mega.kernels.attention import (
    MAX_SPLITS,
    AttnPlan,
    attention_block_m,
    default_attn_plan,
    paged_decode_attention,
    partial_numel,
    plan_splits,
)

pytestmark = pytest.mark.gpu  # also run on a GPU: python bench/gpu_jobs.py gpu-tests

if not pdl.interpreting() and not torch.cuda.is_available():
    pytest.skip("Triton kernels need a CUDA GPU or TRITON_INTERPRET=1", allow_module_level=True)

DEV = torch.device("cpu" if pdl.interpreting() else "cuda")
HQ, HKV, D = 4, 2, 32
MAX_LEN, SLOTS = 160, 1024


def _tol(dtype: torch.dtype) -> dict[str, float]:
    # bf16: values are O(1..4), where one ulp is up to 2**-6; allow a few ulps of different rounding order.
    return {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 2e-2}


def _attention_case(batch: int, rows: int, dtype: torch.dtype, seed: int, seq_lens: list[int] | None = None):  # type: ignore[no-untyped-def]
    """Random K/V pool and slot map; ``seq_lens`` (lengths after the step, each >= rows), else random ones with
    the first request holding only this step's rows."""
    g = torch.Generator().manual_seed(seed)
    kb = (torch.randn(SLOTS, HKV, D, generator=g)).to(dtype=dtype, device=DEV)
    vb = (torch.randn(SLOTS, HKV, D, generator=g)).to(dtype=dtype, device=DEV)
    rtt = torch.stack([torch.randperm(SLOTS - 1, generator=g)[:MAX_LEN] + 1 for _ in range(batch + 2)])
    rtt = rtt.to(torch.int32)
    rpi = torch.randperm(batch + 2, generator=g)[:batch]
    if seq_lens is None:
        seq = torch.randint(rows, MAX_LEN, (batch,), generator=g).to(torch.int32)
        seq[0] = rows  # a request whose cache holds only this step's rows
    else:
        seq = torch.tensor(seq_lens, dtype=torch.int32)
    q = torch.randn(batch * rows, HQ, D, generator=g).to(dtype=dtype, device=DEV)
    return q, kb, vb, rtt.to(DEV), rpi.to(DEV), seq.to(DEV)


def _check(plan: AttnPlan, batch: int, rows: int, dtype: torch.dtype, seed: int,
           seq_lens: list[int] | None = None) -> None:
    q, kb, vb, rtt, rpi, seq = _attention_case(batch, rows, dtype, seed, seq_lens)
    t = batch * rows
    n_o, n_l = partial_numel(batch, HQ, HKV, D, rows, plan)
    o_part = torch.full((n_o,), float("nan"), device=DEV)
    lse_part = torch.full((n_l,), float("nan"), device=DEV)
    buf = torch.full((8, HQ * D), float("nan"), dtype=dtype, device=DEV)
    kb0, vb0 = kb.clone(), vb.clone()
    paged_decode_attention(q, kb, vb, rtt, rpi, seq, buf[:t], rows_per_req=rows, sm_scale=D ** -0.5, plan=plan,
                           o_partial=o_part, lse_partial=lse_part)
    ref = decode_attention_torch(q, kb, vb, rtt, rpi, seq, rows, D ** -0.5)
    torch.testing.assert_close(buf[:t].view(t, HQ, D).float(), ref.float(), **_tol(dtype))
    assert torch.isnan(buf[t:].float()).all(), "rows beyond T were written"
    assert torch.equal(kb, kb0) and torch.equal(vb, vb0), "attention must not write the KV pool"


# (requests, rows per request, KV splits): T = 1, 3, 3, 8, 8; DECODE and VERIFY; one and several splits
ATTN_CASES = [(1, 1, 4), (3, 1, 1), (1, 3, 4), (8, 1, 4), (2, 4, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,rows,splits", ATTN_CASES)
def test_paged_decode_attention_matches_torch(dtype: torch.dtype, batch: int, rows: int, splits: int) -> None:
    _check(AttnPlan(num_splits=splits), batch, rows, dtype, seed=20 + batch * 8 + rows)


# Non-default plans (num_splits, block_kv, split_warps, split_stages, merge_warps): KV blocks of 16, 32 and 128,
# one split and MAX_SPLITS (most of them empty at these lengths), 1 and 3 stages, 2 and 8 warps.
PLANS = [AttnPlan(1, 32, 2, 1, 1), AttnPlan(MAX_SPLITS, 16, 8, 3, 2), AttnPlan(4, 128, 8, 3, 4),
         AttnPlan(16, 32, 4, 1, 8), AttnPlan(2, 128, 2, 2, 1)]
# ragged lengths after the step: shorter than one block (rows only, and 20), not a multiple of any block (97,
# 150), exactly a multiple (128)
RAGGED = {(3, 1): [1, 97, 20], (1, 6): [150], (2, 3): [3, 128]}


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: f"s{p.num_splits}-kv{p.block_kv}-w{p.split_warps}-"
                         f"st{p.split_stages}-m{p.merge_warps}")
@pytest.mark.parametrize("batch,rows", sorted(RAGGED), ids=lambda v: str(v))
def test_attention_plans_match_torch(plan: AttnPlan, batch: int, rows: int) -> None:
    """Any plan computes the same attention: DECODE (3 x 1) and VERIFY (1 x 6, 2 x 3) rows over ragged lengths;
    the merge kernel must derive the split kernel's chunks from the same ``block_kv``."""
    _check(plan, batch, rows, torch.float32, seed=40 + batch * 8 + rows, seq_lens=RAGGED[(batch, rows)])


@pytest.mark.parametrize("plan", [PLANS[1], PLANS[2]], ids=["s64-kv16", "s4-kv128"])
def test_attention_plans_match_torch_bf16(plan: AttnPlan) -> None:
    _check(plan, 1, 6, torch.bfloat16, seed=5, seq_lens=[97])


def test_paged_decode_attention_rejects_mismatched_rows_and_plans() -> None:
    q, kb, vb, rtt, rpi, seq = _attention_case(2, 1, torch.float32, seed=3)
    plan = AttnPlan(num_splits=1)
    n_o, n_l = partial_numel(2, HQ, HKV, D, 2, plan)
    kw = dict(sm_scale=1.0, o_partial=torch.empty(n_o, device=DEV), lse_partial=torch.empty(n_l, device=DEV))
    out = torch.empty(2, HQ * D, device=DEV)
    with pytest.raises(ValueError, match="rows_per_req"):
        paged_decode_attention(q, kb, vb, rtt, rpi, seq, out, rows_per_req=2, plan=plan, **kw)
    with pytest.raises(ValueError, match="plan must be an AttnPlan"):
        paged_decode_attention(q, kb, vb, rtt, rpi, seq, out, rows_per_req=1, plan=4, **kw)  # type: ignore[arg-type]
    big = AttnPlan(num_splits=8)  # workspaces sized for 1 split are too small for 8
    with pytest.raises(ValueError, match="o_partial"):
        paged_decode_attention(q, kb, vb, rtt, rpi, seq, out, rows_per_req=1, plan=big, **kw)


@pytest.mark.parametrize("fields,field", [
    (dict(num_splits=4, block_kv=48), "block_kv"), (dict(num_splits=4, block_kv=8), "block_kv"),
    (dict(num_splits=2 * MAX_SPLITS), "num_splits"), (dict(num_splits=0), "num_splits"),
    (dict(num_splits=3), "num_splits"), (dict(num_splits=4, split_warps=3), "split_warps"),
    (dict(num_splits=4, merge_warps=6), "merge_warps"), (dict(num_splits=4, split_warps=64), "split_warps"),
    (dict(num_splits=4, split_stages=0), "split_stages"), (dict(num_splits=4, block_kv=64.0), "block_kv"),
    (dict(num_splits=True), "num_splits"),
])
def test_attn_plan_refuses_bad_fields(fields: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"AttnPlan\.{field}="):
        AttnPlan(**fields)


def _old_heuristic(b: int, r: int, hq: int, hkv: int, d: int, ctx: int, sms: int) -> tuple[int, ...]:
    """The launch values ``paged_decode_attention`` hard-coded before ``AttnPlan``: (splits, BLOCK_KV, split
    warps, split stages, merge warps)."""
    want = triton.cdiv(2 * sms, b * hkv)
    splits = max(1, min(triton.next_power_of_2(want), min(64, triton.next_power_of_2(triton.cdiv(ctx, 64)))))
    bm = max(16, triton.next_power_of_2((hq // hkv) * r))
    return splits, 64, 4 if bm * d <= 4096 else 8, 2, 4 if splits * d <= 4096 else 8


@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 64), (32, 8, 128), (32, 4, 128), (4, 2, 32), (64, 8, 128)])
def test_heuristic_plan_is_the_old_launch(hq: int, hkv: int, d: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """With no table entry the plan is exactly what the launcher hard-coded before (same kernels, bit-identical
    results), on a CPU and on a GPU the table does not name."""
    cpu = torch.device("cpu")
    for dev_name in ("cpu", "some GPU"):
        monkeypatch.setattr(tuned_plans, "device_name", lambda dev, n=dev_name: n)
        for b in range(1, 9):
            for r in range(1, 8 // b + 1):
                for ctx, sms in ((64, 4), (1024, 132), (2048, 132), (32768, 132), (2048, 78)):
                    want = _old_heuristic(b, r, hq, hkv, d, ctx, sms)
                    got = tuned_plans.attn_plan(b, r, hq, hkv, d, ctx, sms, torch.bfloat16, device=cpu)
                    assert got == default_attn_plan(b, r, hq, hkv, d, ctx, sms) == AttnPlan(*want)
                    assert got.num_splits == plan_splits(b, hkv, ctx, d, sms)
    # llama-3.2-1b on an H200 at max_context_len 2048: 32 splits at batch 1, 8 at batch 8
    assert tuned_plans.attn_plan(1, 1, 32, 8, 64, 2048, 132, torch.bfloat16, device=cpu) == AttnPlan(32, 64, 4, 2, 4)
    assert tuned_plans.attn_plan(8, 1, 32, 8, 64, 2048, 132, torch.bfloat16, device=cpu).num_splits == 8


def test_tuned_attention_entry_wins_on_its_gpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    key = ("Test GPU", "attn", 2, 1, 32, 8, 128, "bfloat16")
    monkeypatch.setitem(tuned_plans.TUNED_ATTN, key, (32, 32, 8, 3, 1))
    monkeypatch.setattr(tuned_plans, "device_name", lambda dev: "Test GPU")
    assert tuned_plans.attn_plan(2, 1, 32, 8, 128, 2048, 132, torch.bfloat16, device=cpu) == AttnPlan(32, 32, 8, 3, 1)
    # the entry's splits are capped at one block of max_context_len each: 256 / 32 = 8
    assert tuned_plans.attn_plan(2, 1, 32, 8, 128, 256, 132, torch.bfloat16, device=cpu) == AttnPlan(8, 32, 8, 3, 1)
    for other in ((1, 1, 32, 8, 128, 2048, 132, torch.bfloat16), (2, 1, 32, 8, 128, 2048, 132, torch.float16)):
        assert tuned_plans.attn_plan(*other, device=cpu) == default_attn_plan(*other[:-1])
    monkeypatch.setattr(tuned_plans, "device_name", lambda dev: "Other GPU")
    assert tuned_plans.attn_plan(2, 1, 32, 8, 128, 2048, 132, torch.bfloat16, device=cpu) == \
        default_attn_plan(2, 1, 32, 8, 128, 2048, 132)


def test_partial_numel_follows_the_plans_splits() -> None:
    for splits in (1, 8, MAX_SPLITS):
        n_o, n_l = partial_numel(3, 32, 8, 64, 2, AttnPlan(num_splits=splits, block_kv=128))
        assert n_l == 3 * 8 * splits * attention_block_m(32, 8, 2) and n_o == 64 * n_l
