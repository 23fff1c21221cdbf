"""K2 at tp_size > 1 (kernels/k2_tp.py) with W simulated ranks in one process (``PeerBuffers.simulated``): o_proj /
down publish on every rank first, then every rank reduces (stage per launch under the interpreter). Against torch:
the general path's ``x + all_reduce(F.linear(...))`` with its roundings, then the next norm (the gate/up stage's
prologue); every rank's x_mid and x bit-identical. Run with TRITON_INTERPRET=1."""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("CPU kernel tests need TRITON_INTERPRET=1 (set before triton is imported)", allow_module_level=True)
pytest.importorskip("lowlat.plugin.peer", reason="amd_mono at TP needs lowlat plugin API 4")

import torch.nn.functional as F  # noqa: E402
from lowlat.layers.norm import rms_norm  # noqa: E402
from lowlat.runtime.peer_buffers import PeerWaitTimeout  # noqa: E402
from lowlat_amd_mono.kernels import plan as P  # noqa: E402
from tp_testutil import check_persistent_k2, make_ranks, run_stages  # noqa: E402
from tp_testutil import general_reduce as _general_reduce  # noqa: E402
from tp_testutil import set_inputs as _inputs  # noqa: E402

S_O = (P.S_OPROJ, P.S_RED_O)
S_MLP = (P.S_MLP1, P.S_MLP2, P.S_RED_D)


@pytest.mark.parametrize("world,rows,dtype", [(2, 3, torch.bfloat16), (4, 1, torch.bfloat16), (2, 8, torch.float32),
                                              (3, 2, torch.bfloat16)])
def test_publish_then_reduce_is_the_general_paths_all_reduce_residual_and_norm(world, rows, dtype) -> None:
    """x_mid = x + sum of rnd(ao_r @ Wo_r^T) after the o_proj reduce, act = the gate/up of rmsnorm(x_mid) (the
    next norm), x = x_mid + sum of rnd(act_r @ Wd_r^T) after the down reduce: equal to torch on every rank, and
    bit-identical across ranks; the device tag advanced by two (two calls per K2)."""
    fwds, bufs = make_ranks(world, rows, dtype, seed=world)
    x0, aos = _inputs(fwds, rows, dtype, seed=world + rows)
    run_stages(fwds, S_O, rows)
    for b in bufs:
        b.check()
    w = [f.w["layers"][0] for f in fwds]
    want_mid = _general_reduce(x0, [ao.float() @ wl["o"].float().T for ao, wl in zip(aos, w)], dtype)
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.02, "rtol": 0.02}
    for r, f in enumerate(fwds):
        assert torch.equal(f.x_mid[:rows], fwds[0].x_mid[:rows]), f"rank {r}'s x_mid differs from rank 0's"
    torch.testing.assert_close(fwds[0].x_mid[:rows], want_mid, **tol)
    assert torch.equal(fwds[0].x[:rows], x0), "the o_proj reduce wrote the residual stream"
    run_stages(fwds, S_MLP, rows)
    x_mid = fwds[0].x_mid[:rows]
    parts = []
    for f, wl in zip(fwds, w):
        inter = f.dims.inter
        hn = rms_norm(x_mid, wl["ln2"], f.dims.eps)
        gu = (hn.float() @ wl["gate_up"].float().T).to(dtype)
        act = (F.silu(gu[:, :inter].float()).to(dtype).float() * gu[:, inter:].float()).to(dtype)
        torch.testing.assert_close(f.act[:rows, :inter], act, **tol)
        parts.append(f.act[:rows, :inter].float() @ wl["down"].float().T)
    want_x = _general_reduce(x_mid, parts, dtype)
    for r, f in enumerate(fwds):
        assert torch.equal(f.x[:rows], fwds[0].x[:rows]), f"rank {r}'s x differs from rank 0's"
    torch.testing.assert_close(fwds[0].x[:rows], want_x, **tol)
    assert [b.last_tag for b in bufs] == [2] * world, "a K2 launch is two calls: the tag must advance by two"


@pytest.mark.parametrize("world,rows", [(2, 4), (4, 1)])
def test_roundings_are_the_general_paths_bit_for_bit(world: int, rows: int) -> None:
    """bf16 with values whose products and sums are exact in fp32 whatever the order (integers times multiples of
    1/8), so only the roundings can differ: each partial rounded to bf16 (as F.linear rounds), their fp32 sum
    rounded once, the residual added and rounded, each to nearest even. Bit for bit, o_proj and down."""
    dt = torch.bfloat16
    fwds, bufs = make_ranks(world, rows, dt, seed=7)
    g = torch.Generator().manual_seed(world)
    for f in fwds:
        wl = f.w["layers"][0]
        wl["o"].copy_((torch.randint(-16, 17, wl["o"].shape, generator=g) / 8).to(dt))
        wl["down"].copy_((torch.randint(-16, 17, wl["down"].shape, generator=g) / 8).to(dt))
    x0, aos = _inputs(fwds, rows, dt, seed=1, integer=True)
    run_stages(fwds, S_O, rows)
    parts = [(ao.float() @ f.w["layers"][0]["o"].float().T) for ao, f in zip(aos, fwds)]
    assert parts[0].to(dt).float().ne(parts[0]).any(), "the test needs partials that must round"
    want = _general_reduce(x0, parts, dt)
    for r, f in enumerate(fwds):
        assert torch.equal(f.x_mid[:rows], want), f"rank {r}: {(f.x_mid[:rows].float() - want.float()).abs().max()}"
    inter = fwds[0].dims.inter
    acts = [torch.randint(-4, 5, (rows, inter), generator=g).to(dt) for _ in fwds]
    for f, a in zip(fwds, acts):
        f.act[:rows, :inter] = a
    run_stages(fwds, (P.S_MLP2, P.S_RED_D), rows)
    want = _general_reduce(want, [a.float() @ f.w["layers"][0]["down"].float().T for a, f in zip(acts, fwds)], dt)
    for r, f in enumerate(fwds):
        assert torch.equal(f.x[:rows], want), f"rank {r}: {(f.x[:rows].float() - want.float()).abs().max()}"


@pytest.mark.parametrize("stages,out", [(S_O, "x_mid"), ((P.S_MLP2, P.S_RED_D), "x")])
def test_ranks_are_summed_in_rank_order(stages, out: str) -> None:
    """fp32 partials 1, 1e8, -1e8 (ranks 0, 1, 2) and a zero residual: the rank-order sum (1 + 1e8) - 1e8 is 0 in
    fp32, the reverse order 1. Every rank must get the rank-order sum, for o_proj's reduce and for down's."""
    world, rows = 3, 1
    fwds, _ = make_ranks(world, rows, torch.float32)
    src = "attn_out" if out == "x_mid" else "act"
    wname = "o" if out == "x_mid" else "down"
    for f, v in zip(fwds, (1.0, 1e8, -1e8)):
        wt = f.w["layers"][0][wname]
        wt.zero_()
        wt[:, 0] = 1.0
        getattr(f, src).zero_()
        getattr(f, src)[:rows, 0] = v
        f.x.zero_()
        f.x_mid.zero_()
    run_stages(fwds, stages, rows)
    assert float((torch.tensor(1.0) + torch.tensor(1e8)) - torch.tensor(1e8)) == 0.0
    for r, f in enumerate(fwds):
        got = getattr(f, out)[:rows]
        assert torch.equal(got, torch.zeros_like(got)), f"rank {r}: {got}"


@pytest.mark.parametrize("stages,reduce_stage", [(S_O, P.S_RED_O), ((P.S_MLP2, P.S_RED_D), P.S_RED_D)])
def test_every_tile_is_awaited(stages, reduce_stage) -> None:
    """Every rank published, then rank 1's flag of the last column tile is taken back on rank 0: rank 0's reduce
    must wait for it and give up (NaN in that tile only, the record naming rank 1 and the call site), while rank 1,
    whose flags are all there, completes."""
    world, rows = 2, 2
    fwds, bufs = make_ranks(world, rows, torch.float32, deadline=30)
    _inputs(fwds, rows, torch.float32, seed=3)
    run_stages(fwds, stages[:1], rows)
    pl = fwds[0].plan
    bn, n_tiles = (pl.o.bn, pl.o.n_tiles) if reduce_stage == P.S_RED_O else (pl.down.bn, pl.down.n_tiles)
    tag = 1 if reduce_stage == P.S_RED_O else 2
    assert int(bufs[0].flags[tag & 1, n_tiles - 1, 1]) == tag
    bufs[0].flags[tag & 1, n_tiles - 1, 1] = 0
    run_stages(fwds, stages[1:], rows)
    out = "x_mid" if reduce_stage == P.S_RED_O else "x"
    got0, got1 = getattr(fwds[0], out)[:rows], getattr(fwds[1], out)[:rows]
    last = slice((n_tiles - 1) * bn, n_tiles * bn)
    assert torch.isnan(got0[:, last]).all() and not torch.isnan(got0[:, :last.start]).any()
    assert not torch.isnan(got1).any()
    with pytest.raises(PeerWaitTimeout, match="rank 1") as e:
        bufs[0].check()
    assert (e.value.rank, e.value.peer, e.value.site) == (0, 1, 0 if reduce_stage == P.S_RED_O else 1)
    bufs[1].check()


def test_consecutive_layers_take_consecutive_tags_and_stale_flags_are_not_taken() -> None:
    """Two layers' K2 on the same buffers: each reduce uses the next tag (1, 2, then 3, 4), and the flags left by
    the previous call of the same parity never pass for the new one (rank 1 silent in the second layer's o_proj:
    its tag-1 flags stay, and rank 0 must still time out)."""
    world, rows = 2, 1
    fwds, bufs = make_ranks(world, rows, torch.float32, deadline=30)
    _inputs(fwds, rows, torch.float32, seed=4)
    run_stages(fwds, S_O + S_MLP, rows, layer=0)
    assert [b.last_tag for b in bufs] == [2, 2]
    fwds[1].tp.publish = False
    run_stages(fwds, S_O, rows, layer=1)
    with pytest.raises(PeerWaitTimeout, match="rank 1") as e:
        bufs[0].check()
    assert (e.value.tag, e.value.site) == (3, 2)
    assert torch.isnan(fwds[0].x_mid[:rows]).all()


def test_a_rank_that_never_publishes_stops_every_rank_naming_it() -> None:
    """Fault injection (``MonoTP.publish`` False, what LOWLAT_MONO_FAULT_NO_PUBLISH=1 sets on rank 1): rank 1 stores
    its tiles but never releases their flags. Every rank's reduce gives up after its deadline (polls under the
    interpreter), writes NaN, and the record names rank 1 as the missing peer, the stage and the call site; the
    down reduce after it leaves at once (the abort word) and the tag still advances."""
    world, rows = 2, 1
    fwds, bufs = make_ranks(world, rows, torch.float32, deadline=50, silent=1)
    _inputs(fwds, rows, torch.float32, seed=5)
    run_stages(fwds, S_O + S_MLP, rows)
    for r in range(world):
        assert torch.isnan(fwds[r].x_mid[:rows]).all() and torch.isnan(fwds[r].x[:rows]).all()
        with pytest.raises(PeerWaitTimeout, match=r"rank 1's push") as e:
            bufs[r].check()
        assert (e.value.rank, e.value.peer, e.value.site, e.value.stage) == (r, 1, 0, 1)
    assert [b.last_tag for b in bufs] == [2, 2]


def test_specs_build_and_options_at_tp(monkeypatch) -> None:
    """Every architecture (Qwen3-MoE too) at tp_size 1/2/4/8 (plugin API 4); a rank's sizes split the experts'
    intermediate dim, and one the TP size does not divide is refused; one_launch has no TP form; the fault switch is
    a known LOWLAT_MONO_ variable, a misspelling of it is not."""
    import dataclasses

    from lowlat.loader.presets import get_preset
    from lowlat_amd_mono.kernels.launch import MonoOptions
    from lowlat_amd_mono.specs import model_specs
    from lowlat_amd_mono.tp import FAULT_ENV

    tps = {s.architecture: s.requirements.tp_sizes for s in model_specs()}
    assert tps == {"LlamaForCausalLM": {1, 2, 4, 8}, "Qwen3ForCausalLM": {1, 2, 4, 8},
                   "Qwen3MoeForCausalLM": {1, 2, 4, 8}}
    moe = get_preset("tiny-qwen3-moe")
    dm = P.Dims.from_config(moe, 4)
    assert (dm.moe_inter, dm.experts, dm.topk, dm.inter) == (moe.moe_intermediate_size // 4, moe.num_experts,
                                                             moe.num_experts_per_tok, moe.intermediate_size // 4)
    with pytest.raises(ValueError, match="moe_intermediate_size=30"):
        P.Dims.from_config(dataclasses.replace(moe, moe_intermediate_size=30), 4)
    with pytest.raises(ValueError, match="one_launch has no TP form"):
        make_ranks(2, 1, torch.bfloat16, one_launch=True)
    monkeypatch.setenv(FAULT_ENV, "1")
    MonoOptions.resolve(torch.device("cpu"), interpret=True)
    monkeypatch.setenv(FAULT_ENV + "S", "1")
    with pytest.raises(ValueError, match=FAULT_ENV + "S"):
        MonoOptions.resolve(torch.device("cpu"), interpret=True)


def test_the_persistent_launch_matches_the_staged_one_and_waits_on_the_reduce() -> None:
    """Rank 0's K2 as one persistent launch over one program (interpreter), its peer's tiles forged from a staged
    run of both ranks (rank 1's slots and flags copied, rank 0's own flags cleared): x_mid and x bit-identical to the
    staged run. Then the o_proj reduce never publishes its amd_mono flags: the gate/up stage's wait must time out
    naming the reduce stage it waits for (MonoStageTimeout), so the MLP reads the reduced rows, not o_proj's."""
    check_persistent_k2((P.S_ATTN, P.S_COMB) + S_O + S_MLP, "k2.gate_up_silu waited .* for k2.o_proj_reduce")


def test_gathered_logits_drop_the_vocabulary_padding() -> None:
    """ceil(V / tp) rows per rank: the gathered logits keep the first V columns only (here one rank's [T, 6] of a
    vocabulary of 5, the all-gather of a group of one)."""
    from lowlat.plugin.peer import TPInfo
    from lowlat_amd_mono.tp import MonoTP

    tp = MonoTP(tp=TPInfo(rank=0, size=1, group=None), bufs=None, publish=True, vocab_size=5, vocab_start=0,
                vocab_rows=6)
    local = torch.arange(12, dtype=torch.float32).reshape(2, 6)
    assert torch.equal(tp.gather_logits(local), local[:, :5])
