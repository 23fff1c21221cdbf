"""K2 of a Qwen3-MoE layer at tp_size > 1 (kernels/k2_moe_tp.py) with W simulated ranks in one process
(``PeerBuffers.simulated``): each rank holds every expert's slice of the intermediate dim (w13 rows, w2 columns; the
router replicated), its expert down stage publishes its partial of the MoE output, and the down reduce stage sums the
ranks and adds the residual. Against the whole MoE at tp_size 1 and against torch with the general path's
roundings; every rank bit-identical. Run with TRITON_INTERPRET=1."""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("CPU kernel tests need TRITON_INTERPRET=1 (set before triton is imported)", allow_module_level=True)
pytest.importorskip("lowlat.plugin.peer", reason="amd_mono at TP needs lowlat plugin API 4")

import torch.nn.functional as F  # noqa: E402
from lowlat.layers.moe import route  # noqa: E402
from lowlat.layers.norm import rms_norm  # noqa: E402
from lowlat.runtime.peer_buffers import PeerWaitTimeout  # noqa: E402
from lowlat_amd_mono.kernels import plan as P  # noqa: E402
from tp_testutil import (  # noqa: E402
    check_persistent_k2,  # noqa: E402
    config,
    general_reduce,
    make_forward,
    make_ranks,
    rank_params,
    run_stages,  # noqa: E402
)

MOE = "tiny-qwen3-moe"
S_EXPERTS = (P.S_MLP1, P.S_MLP2, P.S_MLP3)  # router, expert gate/up, expert down


def _shard(whole: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    """A layer's MoE weights (``ln2``, ``router``, ``w13``, ``w2``, as ``bind_weights`` names them) of ``rank`` from
    the whole model's: the general model's sharding (``lowlat.layers.moe``), gate rows then up rows of the rank's
    slice of every expert, the w2 columns of that slice; norm and router replicated."""
    w13, w2 = whole["w13"], whole["w2"]
    i = w2.shape[2]
    il = i // world
    sl = slice(rank * il, (rank + 1) * il)
    return {"ln2": whole["ln2"], "router": whole["router"],
            "w13": torch.cat([w13[:, :i][:, sl], w13[:, i:][:, sl]], dim=1), "w2": w2[:, :, sl]}


def _torch_partial(x_mid: torch.Tensor, lw: dict[str, torch.Tensor], dm: P.Dims, dtype: torch.dtype) -> torch.Tensor:
    """One rank's partial of the MoE output in float32 (not rounded), with amd_mono's roundings: HF's norm, routing
    and SwiGLU, each activation row scaled by its routing weight and rounded, the experts summed in float32."""
    h = rms_norm(x_mid, lw["ln2"], dm.eps)
    weights, ids = route((h.float() @ lw["router"].float().T).to(dtype).float(), dm.topk, dm.norm_topk, dtype)
    out = torch.zeros(x_mid.shape, dtype=torch.float32)
    for t in range(x_mid.shape[0]):
        for k in range(dm.topk):
            e = int(ids[t, k])
            gu = (h[t].float() @ lw["w13"][e].float().T).to(dtype)
            act = (F.silu(gu[:dm.moe_inter].float()).to(dtype).float() * gu[dm.moe_inter:].float()).to(dtype)
            out[t] += (act.float() * weights[t, k].float()).to(dtype).float() @ lw["w2"][e].float().T
    return out


def _published(bufs, rows: int, tag: int) -> list[torch.Tensor]:
    """Every rank's published ``[rows, H]`` partial of call ``tag``, as rank 0's buffer holds them (float32)."""
    w, h = bufs[0].world, bufs[0].capacity // P.MAX_ROWS
    return [bufs[0].data[tag & 1, s, :rows * h].view(rows, h).float() for s in range(w)]


@pytest.mark.parametrize("world,rows,dtype,row1", [(2, 3, torch.bfloat16, False), (4, 1, torch.bfloat16, False),
                                                   (2, 8, torch.float32, False), (3, 2, torch.bfloat16, False),
                                                   (2, 1, torch.bfloat16, True)])
def test_moe_publishes_its_partial_and_the_ranks_sum_to_the_whole_moe(world, rows, dtype, row1) -> None:
    """Router, expert gate/up and expert down on every rank, then the down reduce: each rank's published partial is
    its slice's MoE (torch), the ranks' partials summed in rank order, rounded once and added to the residual are
    every rank's x bit for bit (the general path's ``x_mid + all_reduce(moe_experts(...))``), equal to the whole MoE
    at tp_size 1 plus the residual up to the partials' roundings, and bit-identical across ranks; the tag advanced
    to the MoE's call (2)."""
    cfg = config(world, MOE)
    whole = make_forward(cfg, rank_params(cfg, 1, dtype, world), dtype, None, row1_fma=row1)
    fwds, bufs = make_ranks(world, rows, dtype, seed=world, model=MOE, row1_fma=row1)
    assert whole.row1(rows) == row1 and fwds[0].row1(rows) == row1 and cfg.moe_intermediate_size % world == 0
    for r, f in enumerate(fwds):
        for name, v in _shard(whole.w["layers"][0], r, world).items():
            f.w["layers"][0][name].copy_(v)
    g = torch.Generator().manual_seed(rows)
    x_mid = torch.randn(rows, cfg.hidden_size, generator=g).to(dtype)
    for f in (whole, *fwds):
        f.x_mid[:rows] = x_mid
        f.x.zero_()
    run_stages([whole], S_EXPERTS, rows)
    run_stages(fwds, S_EXPERTS + (P.S_RED_D,), rows)
    for b in bufs:
        b.check()
    assert [b.last_tag for b in bufs] == [2] * world, "the MoE is the launch's second call"
    parts = _published(bufs, rows, 2)
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.03, "rtol": 0.03}
    for r, f in enumerate(fwds):
        lw = f.w["layers"][0]
        torch.testing.assert_close(parts[r], _torch_partial(x_mid, lw, f.dims, dtype).to(dtype).float(), **tol)
        assert torch.equal(f.x[:rows], fwds[0].x[:rows]), f"rank {r}'s x differs from rank 0's"
    assert torch.equal(fwds[0].x[:rows], general_reduce(x_mid, parts, dtype))
    torch.testing.assert_close(fwds[0].x[:rows], whole.x[:rows], **tol)
    assert torch.equal(fwds[0].x_mid[:rows], x_mid), "the MoE stages wrote x_mid"


@pytest.mark.parametrize("world,rows", [(2, 4), (4, 1)])
def test_moe_roundings_are_the_general_paths_bit_for_bit(world: int, rows: int) -> None:
    """bf16 with values whose products and sums are exact in fp32 whatever the order (integers, multiples of 1/8,
    routing weights 1/2 and 1/4), so only the roundings can differ: each rank's weighted activations rounded, the
    experts' sum rounded once (the partial the general path all-reduces), the fp32 rank-order sum rounded once, the
    residual added and rounded, each to nearest even. Bit for bit, on every rank."""
    dt = torch.bfloat16
    fwds, bufs = make_ranks(world, rows, dt, seed=11, model=MOE)
    dm = fwds[0].dims
    g = torch.Generator().manual_seed(world)
    x_mid = (torch.randint(-64, 65, (rows, dm.hidden), generator=g) / 16).to(dt)
    experts, wts = (3, 6), (0.5, 0.25)
    want_parts = []
    for f in fwds:
        lw = f.w["layers"][0]
        lw["w2"].copy_((torch.randint(-16, 17, lw["w2"].shape, generator=g) / 8).to(dt))
        f.router_logits.zero_()  # uniform routing: every row chooses topk experts, so topk slots are live
        f.slot_e[:dm.topk] = torch.tensor(experts, dtype=torch.int32)
        f.slot_w[:dm.topk] = torch.tensor(wts)[:, None]
        f.act_moe[:dm.topk, :rows] = torch.randint(-40, 41, (dm.topk, rows, dm.moe_inter), generator=g).to(dt)
        f.x_mid[:rows] = x_mid
        part = sum(((f.act_moe[u, :rows].float() * wts[u]).to(dt).float() @ lw["w2"][experts[u]].float().T)
                   for u in range(dm.topk))
        want_parts.append(part)
    run_stages(fwds, (P.S_MLP3, P.S_RED_D), rows)
    assert want_parts[0].to(dt).float().ne(want_parts[0]).any(), "the test needs partials that must round"
    assert all(torch.equal(p, q.to(dt).float()) for p, q in zip(_published(bufs, rows, 2), want_parts))
    want = general_reduce(x_mid, want_parts, dt)
    for r, f in enumerate(fwds):
        assert torch.equal(f.x[:rows], want), f"rank {r}: {(f.x[:rows].float() - want.float()).abs().max()}"


def test_a_moe_rank_that_never_publishes_stops_every_rank_naming_it() -> None:
    """Rank 1's expert down stores its tiles but never releases the flags: every rank's down reduce gives up (NaN in
    x), and the record names rank 1, the reduce stage and the MoE's call site ``2 * layer + 1`` (layer 1: 3)."""
    world, rows = 2, 2
    fwds, bufs = make_ranks(world, rows, torch.float32, deadline=30, silent=1, model=MOE)
    for f in fwds:
        f.x_mid[:rows] = 1.0
    run_stages(fwds, S_EXPERTS + (P.S_RED_D,), rows, layer=1)
    for r in range(world):
        assert torch.isnan(fwds[r].x[:rows]).all()
        with pytest.raises(PeerWaitTimeout, match=r"rank 1's push") as e:
            bufs[r].check()
        assert (e.value.rank, e.value.peer, e.value.site, e.value.stage) == (r, 1, 3, 1)


def test_the_persistent_moe_launch_matches_the_staged_one_and_waits_on_the_reduce() -> None:
    """Rank 0's whole MoE K2 as one persistent launch over one program (interpreter), its peer's tiles forged from a
    staged run of both ranks (rank 1's slots and flags copied, rank 0's own flags cleared): x_mid and x bit-identical
    to the staged run, the tag at the MoE's call. Then the o_proj reduce never publishes its amd_mono flags: the
    router's wait must time out naming the reduce stage (MonoStageTimeout), so routing reads the reduced rows."""
    check_persistent_k2(P.K2_MOE_TP_STAGES, "k2.router waited .* for k2.o_proj_reduce", model=MOE,
                        launch="k2_attn_out_moe_tp")


def test_the_expert_downs_tiles_must_fit_the_peer_buffers_flag_tiles() -> None:
    """``MonoTP.check_tiles`` counts the expert down's column tiles too (it publishes one flag tile each): 5 of them
    against 4 flag tiles (capacity 64 / block 16) is refused, 4 pass."""
    from types import SimpleNamespace

    from lowlat_amd_mono.tp import MonoTP

    tp = MonoTP(tp=None, bufs=SimpleNamespace(capacity=64, block=16), publish=True, vocab_size=1, vocab_start=0,
                vocab_rows=1)
    tiles = lambda n: SimpleNamespace(n_tiles=n)  # noqa: E731
    tp.check_tiles(SimpleNamespace(o=tiles(4), down=None, edown=tiles(4)))
    with pytest.raises(ValueError, match="publishes 5 column tiles per call; the peer buffers hold 4 flag tiles"):
        tp.check_tiles(SimpleNamespace(o=tiles(2), down=None, edown=tiles(5)))
