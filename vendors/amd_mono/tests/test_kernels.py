"""amd_mono kernels in the stage-per-launch mode on CPU (run with TRITON_INTERPRET=1), against the general path.

The general lowlat forward is the oracle: logits, and every KV buffer (slots outside out_cache_loc hold random
sentinels that must survive). The tag protocol's waits are exercised directly on CPU with poll-count deadlines.
"""

from __future__ import annotations

import os

import pytest
import torch
from lowlat.forward_batch import ForwardMode
from lowlat.plugin import PluginBuildError

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("CPU kernel tests need TRITON_INTERPRET=1 (set before triton is imported)", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from lowlat_amd_mono.build import build  # noqa: E402
from lowlat_amd_mono.forward import MonoForward, MonoStageTimeout  # noqa: E402
from lowlat_amd_mono.kernels import plan as P  # noqa: E402
from lowlat_amd_mono.kernels.launch import MonoOptions  # noqa: E402
from lowlat_amd_mono.kernels.residency import Occupancy, ResidencyError, _metadata_occupancy, check_grid  # noqa: E402
from lowlat_amd_mono.kernels.sync import CTL_SIZE, publish, wait_count, wait_flags  # noqa: E402
from mono_testutil import (  # noqa: E402
    bf16_logits_problem,
    clone_pool,
    make_pool,
    make_setup,
    new_requests,
    router_logits_of,
    router_near_ties,
    step_batch,
)

CASES = [  # (preset, requests' cached lengths, tokens per request)
    ("tiny-llama", [9], 1),
    ("tiny-llama", [3, 17, 40], 1),
    ("tiny-llama", [5, 1, 70, 33, 8, 12, 2, 64], 1),
    ("tiny-llama", [11, 36], 4),
    ("tiny-qwen3", [30], 1),
    ("tiny-qwen3", [4, 19, 66], 1),
    ("tiny-qwen3", [7, 2, 15, 31, 50, 1, 9, 80], 1),
    ("tiny-qwen3", [21], 3),
    ("tiny-qwen3-moe", [13], 1),
    ("tiny-qwen3-moe", [6, 45, 20], 1),
    ("tiny-qwen3-moe", [3, 9, 27, 81, 14, 5, 60, 2], 1),
    ("tiny-qwen3-moe", [10, 25], 2),
]


def _run_both(preset: str, prefix: list[int], tpr: int, dtype: torch.dtype, layers: int | None = None):
    s = make_setup(preset, dtype, "cpu", layers=layers)
    fwd = build(s.binding)
    pool_ref = make_pool(s)
    rows = new_requests(pool_ref, prefix)
    pool_mono = clone_pool(pool_ref)
    s.binding.attach_kv_pool(pool_mono)
    ids = torch.randint(0, s.cfg.vocab_size, (len(prefix) * tpr,), generator=torch.Generator().manual_seed(3))
    batch = step_batch(pool_ref, rows, tpr, ids)
    step_batch(pool_mono, rows, tpr, ids)  # same slots: both pools hand out pages identically
    before = [b.clone() for b in pool_ref.k_buffers]
    ref = s.model(batch, pool_ref)
    out = fwd.forward(batch)
    return s, fwd, batch, ref, out, pool_ref, pool_mono, before


@pytest.mark.parametrize("preset,prefix,tpr", CASES, ids=[f"{c[0]}-rows{len(c[1]) * c[2]}-tpr{c[2]}" for c in CASES])
def test_step_matches_general_path(preset: str, prefix: list[int], tpr: int) -> None:
    layers = 2 if len(prefix) * tpr == 8 or tpr > 1 else 1  # two layers where the step is largest, for speed
    s, fwd, batch, ref, out, pool_ref, pool_mono, before = _run_both(preset, prefix, tpr, torch.bfloat16, layers)
    assert batch.forward_mode is (ForwardMode.DECODE if tpr == 1 else ForwardMode.VERIFY)
    assert out.dtype == torch.float32 and out.shape == (len(prefix) * tpr, s.cfg.vocab_size)
    # bf16 logits of magnitude 8..16 have a 0.0625 ulp; the MoE down stage rounds once per product, not per expert
    torch.testing.assert_close(out, ref, atol=0.1, rtol=0.02)
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.2
    assert torch.equal(out.argmax(-1)[clear], ref.argmax(-1)[clear])
    loc = batch.out_cache_loc
    for layer in range(s.cfg.num_hidden_layers):
        for mono, gen in ((pool_mono.k_buffers[layer], pool_ref.k_buffers[layer]),
                          (pool_mono.v_buffers[layer], pool_ref.v_buffers[layer])):
            torch.testing.assert_close(mono[loc].float(), gen[loc].float(), atol=0.02, rtol=0.02)
            untouched = torch.ones(mono.shape[0], dtype=torch.bool)
            untouched[loc] = False
            assert torch.equal(mono[untouched], gen[untouched])  # sentinels survive
    assert not torch.equal(pool_mono.k_buffers[0][loc], before[0][loc])


def test_float32_is_tight() -> None:
    s, fwd, batch, ref, out, pool_ref, pool_mono, _ = _run_both("tiny-qwen3-moe", [5, 33, 12], 1, torch.float32)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    for layer in range(s.cfg.num_hidden_layers):
        torch.testing.assert_close(pool_mono.k_buffers[layer], pool_ref.k_buffers[layer], atol=1e-5, rtol=1e-5)


def test_router_near_tie_flip_is_the_only_excused_outlier() -> None:
    """tiny-qwen3-moe, 8 rows, the GPU test's prefixes. With these ids token 1 is at a near-tie of layer 1's router
    (the general path's 2nd and 3rd logits, experts 5 and 4, are 0.0078 apart; the bf16 noise between the paths'
    router logits reaches 0.016) and the plugin takes expert 4: that row moves by half the logit scale and the mean
    over all 8 rows exceeds 1e-2 x scale, as on the H200 (row 0 there). Not a kernel bug: in float32 the same step
    matches to 1e-4. The rule excuses such a row from the mean only because it is a router near-tie."""
    prefix = [3 + 29 * i % 200 for i in range(8)]
    ids = torch.tensor([265, 125, 484, 15, 320, 369, 123, 156])
    for dtype in (torch.float32, torch.bfloat16):
        s = make_setup("tiny-qwen3-moe", dtype, "cpu")
        fwd = build(s.binding)
        pool_ref = make_pool(s, num_pages=400)
        rows = new_requests(pool_ref, prefix)
        pool = clone_pool(pool_ref)
        s.binding.attach_kv_pool(pool)
        batch = step_batch(pool_ref, rows, 1, ids)
        step_batch(pool, rows, 1, ids)
        with router_logits_of(s.model) as router_logits:
            ref = s.model(batch, pool_ref)
        out = fwd.forward(batch)
        scale = max(1.0, float(ref.abs().max()))
        if dtype == torch.float32:
            torch.testing.assert_close(out, ref, atol=1e-4 * scale, rtol=0)
            continue
        err = (out - ref.float()).abs()
        assert float(err[1].max()) > 0.2 * scale and float(err.mean()) > 1e-2 * scale  # the flip
        ties = router_near_ties(router_logits, s.cfg.num_experts_per_tok)
        assert 1 in ties and sorted(router_logits) == [0, 1]
        assert bf16_logits_problem(out, ref, ties) == (None, [1])
        assert bf16_logits_problem(out, ref, {})[0] is not None  # not excused without the near-tie
        worse = out.clone()
        worse[5] += 0.1 * scale  # a second row over the bound: one in eight only
        assert bf16_logits_problem(worse, ref, ties)[0] is not None


def test_verify_row_sees_only_earlier_new_tokens() -> None:
    """Changing the last of 4 new tokens leaves the logits of the first three unchanged (causal mask)."""
    s = make_setup("tiny-llama", torch.float32, "cpu", layers=1)
    fwd = build(s.binding)
    outs = []
    for last in (7, 300):
        pool = make_pool(s)
        rows = new_requests(pool, [20])
        fwd.attach_kv_pool(pool)
        ids = torch.tensor([1, 2, 3, last])
        outs.append(fwd.forward(step_batch(pool, rows, 4, ids)))
    torch.testing.assert_close(outs[0][:3], outs[1][:3], atol=0, rtol=0)
    assert not torch.equal(outs[0][3], outs[1][3])
    # Two steps, two tags; flags are never reset, each published item holds the latest step's tag.
    n = fwd.plan.qkv.items
    assert fwd.step.item() == 2
    assert torch.all(fwd.flags[:, P.S_QKV, :n] == 2) and torch.all(fwd.flags[:, P.S_QKV, n:] == 0)


def test_stage_counters_count_one_step_and_are_zeroed_by_the_next() -> None:
    """With ``stage_counters``, each counted stage's counter holds exactly this step's published items (the
    embedding launch zeroes them; a second step does not add to the first), and the logits do not change."""
    s = make_setup("tiny-qwen3-moe", torch.float32, "cpu", layers=2)
    plain = build(s.binding)
    counted = MonoForward(model_config=s.cfg, params=s.binding.params, dtype=s.dtype, device=s.device,
                          alloc_workspace=s.binding.alloc_workspace, max_context_len=plain.max_context_len,
                          options=MonoOptions.resolve(s.device, {"amd_mono_stage_counters": True}, interpret=True))
    assert counted.options.stage_counters and not plain.options.stage_counters
    outs = []
    for fwd in (plain, counted):
        pool = make_pool(s)
        rows = new_requests(pool, [9, 30])
        fwd.attach_kv_pool(pool)
        for ids in ([4, 5], [6, 7]):
            out = fwd.forward(step_batch(pool, rows, 1, torch.tensor(ids)))
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)
    assert torch.all(plain.counters == 0)
    c = counted.counters[:, 0].view(-1)
    dm, pl = counted.dims, counted.plan
    for layer in range(dm.layers):
        at = layer * P.NUM_STAGES
        assert c[at + P.S_COMB].item() == 2 * dm.kv_heads  # (request, kv head) combine items
        assert c[at + P.S_OPROJ].item() == pl.o.n_tiles
        assert c[at + P.S_MLP1].item() == pl.router.n_tiles
        assert 1 <= c[at + P.S_MLP2].item() / pl.eup.n_tiles <= 2 * dm.topk  # published = distinct experts x tiles
        assert c[at + P.S_ATTN].item() == 0 and c[at + P.S_QKV].item() == 0  # waited per item: not counted


# ----- the tag protocol, on CPU ----------------------------------------------------------------------------------
@triton.jit
def _probe(flags_ptr, ctl_ptr, out_ptr, lo, hi, tag, deadline, layer, debug_mask, pub_ptr, cnt_ptr,
           COUNT: tl.constexpr):
    if COUNT:  # wait for the counter at flags_ptr to reach hi
        ok = wait_count(flags_ptr, hi, tag, ctl_ptr, deadline, layer, 4, 3, 0)
    else:
        ok = wait_flags(flags_ptr, lo, hi, tag, ctl_ptr, deadline, layer, 4, 3, 8, 0)
    tl.store(out_ptr, ok)
    publish(pub_ptr, cnt_ptr, tag, debug_mask, 5, COUNT)


def _probe_run(flags: torch.Tensor, ctl: torch.Tensor, lo: int, hi: int, tag: int, debug_mask: int = 0,
               count: bool = False, cnt: torch.Tensor | None = None, deadline: int = 50):
    """Run one wait (flags ``[lo, hi)``, or with ``count`` the counter ``flags[0]`` up to ``hi``), then one publish
    (flag ``pub``, and with ``count`` counter ``cnt``); returns (wait result, published flag)."""
    out = torch.full((1,), -1, dtype=torch.int32)
    pub = torch.zeros(1, dtype=torch.int32)
    cnt = torch.zeros(1, dtype=torch.int32) if cnt is None else cnt
    _probe[(1,)](flags, ctl, out, lo, hi, tag, deadline, 7, debug_mask, pub, cnt, COUNT=count)
    return int(out.item()), int(pub.item())


def test_wait_returns_when_every_flag_holds_the_tag() -> None:
    flags = torch.full((40,), 6, dtype=torch.int32)  # spans several MAXW=8 chunks
    ctl = torch.zeros(CTL_SIZE, dtype=torch.int32)
    assert _probe_run(flags, ctl, 3, 37, tag=6) == (1, 6)
    assert ctl.tolist() == [0] * CTL_SIZE


def test_stale_tag_times_out_and_records_layer_stage_item() -> None:
    flags = torch.full((40,), 6, dtype=torch.int32)
    flags[21] = 5  # published in the previous step, not this one
    ctl = torch.zeros(CTL_SIZE, dtype=torch.int32)
    assert _probe_run(flags, ctl, 3, 37, tag=6)[0] == 0
    assert ctl.tolist() == [6, 1, 6, 7, 4, 3, 21, 1]  # abort tag, count, tag, layer, stage, awaited, item, kind
    # Another workgroup then sees the abort word and leaves without recording a second error.
    assert _probe_run(flags, ctl, 0, 40, tag=6)[0] == 0
    assert ctl[1].item() == 1
    # The next step's tag is not aborted: a ready wait passes.
    flags.fill_(7)
    assert _probe_run(flags, ctl, 0, 40, tag=7)[0] == 1


def test_fault_injection_bit_suppresses_publish() -> None:
    flags = torch.full((4,), 9, dtype=torch.int32)
    ctl = torch.zeros(CTL_SIZE, dtype=torch.int32)
    assert _probe_run(flags, ctl, 0, 4, tag=9, debug_mask=1 << (8 + 5)) == (1, 0)
    assert _probe_run(flags, ctl, 0, 4, tag=9, debug_mask=1 << (8 + 4)) == (1, 9)


def test_counter_wait_returns_at_the_count_and_publish_counts() -> None:
    ctl = torch.zeros(CTL_SIZE, dtype=torch.int32)
    counter, cnt = torch.tensor([12], dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    assert _probe_run(counter, ctl, 0, 12, tag=6, count=True, cnt=cnt) == (1, 6)
    assert cnt.item() == 4 and ctl.tolist() == [0] * CTL_SIZE  # the publish added one item to its stage counter
    assert _probe_run(torch.tensor([13], dtype=torch.int32), ctl, 0, 12, tag=6, count=True)[0] == 1


def test_counter_short_of_the_count_times_out_and_records_the_count() -> None:
    ctl = torch.zeros(CTL_SIZE, dtype=torch.int32)
    counter = torch.tensor([11], dtype=torch.int32)
    assert _probe_run(counter, ctl, 0, 12, tag=6, count=True)[0] == 0
    assert ctl.tolist() == [6, 1, 6, 7, 4, 3, 11, 2]  # ... item field = count seen, kind 2 (counter wait)
    assert _probe_run(counter, ctl, 0, 12, tag=6, count=True)[0] == 0  # the abort word: no second record
    assert ctl[1].item() == 1
    counter[0] = 12
    assert _probe_run(counter, ctl, 0, 12, tag=7, count=True)[0] == 1  # the next step is not aborted


@pytest.mark.parametrize("count", [False, True], ids=["flags", "counter"])
def test_a_raised_abort_word_ends_a_wait_before_its_deadline(count: bool) -> None:
    """Another workgroup timed out in this step: a blocked wait leaves at once (it does not spin to its own
    deadline, here 2**40 polls: a wait that ignored the abort word would hang) and records nothing."""
    ctl = torch.zeros(CTL_SIZE, dtype=torch.int32)
    ctl[0] = 6  # the abort word holds this step's tag
    flags = torch.tensor([3], dtype=torch.int32) if count else torch.full((8,), 5, dtype=torch.int32)
    assert _probe_run(flags, ctl, 0, 8, tag=6, count=count, deadline=1 << 40)[0] == 0
    assert ctl.tolist() == [6] + [0] * (CTL_SIZE - 1)


def test_fault_injection_bit_suppresses_the_counter_too() -> None:
    ctl, cnt = torch.zeros(CTL_SIZE, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    assert _probe_run(torch.tensor([1]).int(), ctl, 0, 1, tag=9, debug_mask=1 << (8 + 5), count=True, cnt=cnt) == (1, 0)
    assert cnt.item() == 0
    assert _probe_run(torch.tensor([1]).int(), ctl, 0, 1, tag=9, debug_mask=1 << (8 + 4), count=True, cnt=cnt) == (1, 9)
    assert cnt.item() == 1


def test_error_record_raises_naming_layer_and_stage() -> None:
    s = make_setup("tiny-qwen3-moe", torch.bfloat16, "cpu", layers=2)
    fwd = build(s.binding)
    fwd.check_errors()  # nothing recorded
    fwd.ctl.copy_(torch.tensor([4, 1, 4, 1, P.S_MLP3, P.S_MLP2, 17, 1], dtype=torch.int32))
    with pytest.raises(MonoStageTimeout, match=r"layer 1, stage k2.expert_down_combine_residual .* "
                                                r"k2.expert_gate_up \(item 17 unpublished\)") as e:
        fwd.check_errors()
    assert (e.value.layer, e.value.awaited) == (1, "k2.expert_gate_up")
    fwd.check_errors()  # reported once
    fwd.ctl.copy_(torch.tensor([5, 2, 5, 0, P.S_MLP2, P.S_MLP1, 3, 2], dtype=torch.int32))  # a counter wait
    with pytest.raises(MonoStageTimeout, match=r"layer 0, stage k2.expert_gate_up .* k2.router \(3 items published\)"):
        fwd.check_errors()


# ----- residency, plan, options, dispatch ------------------------------------------------------------------------
class _Props:
    max_threads_per_multi_processor = 2048
    regs_per_multiprocessor = 65536
    shared_memory_per_multiprocessor = 233472


def test_residency_rule() -> None:
    assert _metadata_occupancy(_Props(), n_regs=244, shared=77824, num_warps=4, is_hip=False) == 2
    assert _metadata_occupancy(_Props(), n_regs=64, shared=0, num_warps=4, is_hip=False) == 8
    occ = Occupancy(per_sm=1, sm_count=132, source="metadata", detail="x")
    check_grid("k2", 132, occ)
    with pytest.raises(ResidencyError, match="264 workgroups exceeds the 132"):
        check_grid("k2", 264, occ)


def test_plan_tiles_cover_and_flags_suffice() -> None:
    from lowlat.loader.presets import get_preset

    for name in ("llama-3.2-1b", "qwen3-30b-a3b", "qwen3-8b"):
        dm = P.Dims.from_config(get_preset(name))
        pl = P.MonoPlan.build(dm, 132)
        assert pl.qkv.n_tiles * pl.qkv.bn >= dm.qkv_rows and dm.hidden % pl.qkv.ksplit == 0
        assert pl.qkv.kchunk % pl.qkv.bk == 0
        for rows in range(1, 9):
            sh = pl.step_shape(rows, 1)
            assert sh.nsplit & (sh.nsplit - 1) == 0 and sh.m_att >= max(16, dm.group)
            stages = P.K1_STAGES + (P.K2_MOE_STAGES if dm.any_moe else P.K2_DENSE_STAGES)
            assert max(pl.items(st, sh, dm.any_moe) for st in stages) <= pl.max_items


def test_gemv_prefetch_is_process_wide_and_a_disagreeing_extra_is_refused() -> None:
    from lowlat_amd_mono.kernels.gemv import PREFETCH_ACT

    on = bool(PREFETCH_ACT.value)
    assert MonoOptions.resolve(torch.device("cpu"), interpret=True).gemv_prefetch is on
    with pytest.raises(ValueError, match="LOWLAT_MONO_GEMV_PREFETCH"):
        MonoOptions.resolve(torch.device("cpu"), {"amd_mono_gemv_prefetch": not on}, interpret=True)


def test_gemv_bk_max_default_is_per_model_and_bad_values_are_refused() -> None:
    from lowlat.loader.presets import get_preset

    dense = P.Dims.from_config(get_preset("llama-3.2-1b"))
    moe = P.Dims.from_config(get_preset("qwen3-30b-a3b"))
    assert (P.default_bk_max(dense), P.default_bk_max(moe)) == (512, 256)
    # llama's down (K 8192) takes 16 x 512 chunks by default, 16 x 256 when the option says 256
    assert P.MonoPlan.build(dense, 132).down.bk == 512
    assert P.MonoPlan.build(dense, 132, bk_max=256).down.bk == 256
    assert P.MonoPlan.build(moe, 264).o.bk == 256
    assert MonoOptions.resolve(torch.device("cpu"), interpret=True).gemv_bk_max == 0
    assert MonoOptions.resolve(torch.device("cpu"), {"amd_mono_gemv_bk_max": "512"}, interpret=True).gemv_bk_max == 512
    for bad in ("8", "-256"):
        with pytest.raises(ValueError, match="gemv_bk_max 0 \\(auto\\) or >= 16"):
            MonoOptions.resolve(torch.device("cpu"), {"amd_mono_gemv_bk_max": bad}, interpret=True)


def test_options_force_staged_under_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOWLAT_MONO_DEADLINE_MS", "25")
    o = MonoOptions.resolve(torch.device("cpu"), {"amd_mono_programs_per_sm": "2"}, interpret=True)
    assert o.staged and not o.pdl and not o.cooperative and o.deadline_ms == 25 and o.programs_per_sm == 2
    with pytest.raises(ValueError, match="unknown amd_mono option.*amd_mono_pld"):
        MonoOptions.resolve(torch.device("cpu"), {"amd_mono_pld": "0"}, interpret=True)
    with pytest.raises(ValueError, match="deadline_ms"):
        MonoOptions.resolve(torch.device("cpu"), {"amd_mono_deadline_ms": "soon"}, interpret=True)
    monkeypatch.setenv("LOWLAT_MONO_STAGD", "1")
    with pytest.raises(ValueError, match="LOWLAT_MONO_STAGD"):
        MonoOptions.resolve(torch.device("cpu"), interpret=True)


def test_supports_only_small_uniform_decode_and_verify() -> None:
    s = make_setup("tiny-llama", torch.bfloat16, "cpu", layers=1)
    fwd = build(s.binding)
    pool = make_pool(s)
    rows = new_requests(pool, [4] * 9)
    assert not fwd.supports(step_batch(pool, rows[:1], 1, torch.tensor([1])))  # no pool attached yet
    s.binding.attach_kv_pool(pool)
    assert fwd.supports(step_batch(pool, rows[:8], 1, torch.arange(8)))
    assert not fwd.supports(step_batch(pool, rows, 1, torch.arange(9)))  # 9 rows
    assert not fwd.supports(step_batch(pool, rows[:3], 3, torch.arange(9)))  # 9 rows of VERIFY
    from lowlat.forward_batch import ForwardBatch

    pre = ForwardBatch.build(ForwardMode.PREFILL, [1, 2], [0], [2], [rows[0]], torch.tensor([5, 6]), "cpu")
    assert not fwd.supports(pre)


def test_build_refuses_what_it_cannot_run() -> None:
    s = make_setup("tiny-llama", torch.bfloat16, "cpu", layers=1)
    s.binding.tp_size = 2  # dense at TP opens the group's peer buffers: only an engine's binding has a rendezvous
    with pytest.raises(PluginBuildError, match="peer buffers of a binding without a TP group's rendezvous"):
        build(s.binding)
    s.binding.tp_size = 1
    del s.binding.params["model.layers.0.mlp.down_proj.weight"]
    with pytest.raises(ValueError, match="model.layers.0.mlp.down_proj.weight"):
        build(s.binding)
