"""Epilogue publishing (kernels/tp_epilogue.py) and its consumer ``reduce_rows`` (kernels/tp_reduce.py) at
tp_size > 1, with W simulated ranks in one process (``PeerBuffers.simulated``): every rank's GEMM publishes first,
then every rank reduces (under the interpreter a launch runs to its end before the next starts). Against torch:
the general path's ``x + all_reduce(F.linear(...))`` with its roundings, then HF RMSNorm; every rank's x and h
bit-identical. Runs under TRITON_INTERPRET=1 on CPU and on one CUDA GPU (simulated ranks there too).
"""

from __future__ import annotations

import pytest
import torch
from lowlat.layers.norm import rms_norm
from lowlat_nvidia_mega.kernels import pdl

pytestmark = pytest.mark.gpu  # also run on a GPU: python bench/gpu_jobs.py gpu-tests

if not pdl.interpreting() and not torch.cuda.is_available():
    pytest.skip("Triton kernels need a CUDA GPU or TRITON_INTERPRET=1", allow_module_level=True)

lowlat_peer = pytest.importorskip("lowlat.plugin.peer", reason="epilogue publishing needs lowlat plugin API 4")

from lowlat.runtime.peer_buffers import PeerBuffers, PeerWaitTimeout  # noqa: E402
from lowlat_nvidia_mega.kernels.gemm_plans import GemvPlan, make_plan, splitk_workspace_numel  # noqa: E402
from lowlat_nvidia_mega.kernels.gemv import gemm, publish_tile_n  # noqa: E402
from lowlat_nvidia_mega.kernels.tp_epilogue import PeerTarget  # noqa: E402
from lowlat_nvidia_mega.kernels.tp_reduce import reduce_rows  # noqa: E402

DEV = torch.device("cpu" if pdl.interpreting() else "cuda")
EPS = 1e-6


def _bufs(world: int, rows: int, n: int, dtype: torch.dtype, *, deadline: int | None = None) -> list[PeerBuffers]:
    return PeerBuffers.simulated(world, rows * n, dtype, device=DEV, block=16, deadline=deadline)


def _plan(n: int, k: int, *, split_k: int, row1: bool | str):
    """``row1``: False (no one-row plan), True (the GEMV, a program per tile) or "stream" (its weight stream, one
    program per SM: 4 on CPU, each publishing several tiles)."""
    plan = make_plan(k, block_n=16, block_k=32, split_k=split_k, num_warps=4, num_stages=2, weight_rows=16)
    if row1:
        from dataclasses import replace

        plan = replace(plan, row1=GemvPlan(block_n=4, block_k=32, num_warps=4, num_stages=2,
                                           per_sm=1 if row1 == "stream" else 0))
    return plan


def _publish_all(xs, ws, x_res, bufs, plan, dtype, *, publish=(True,) * 8):
    n = ws[0].shape[0]
    targets = []
    for r, b in enumerate(bufs):
        target = PeerTarget(b, publish=publish[r])
        ws_ = torch.zeros(max(1, splitk_workspace_numel(plan, n, gated=False)), dtype=torch.float32, device=DEV)
        cnt = torch.zeros(plan.n_tiles(n), dtype=torch.int32, device=DEV)
        gemm(xs[r], ws[r], x_res[r], plan=plan, epilogue="publish", peer=target, workspace=ws_, counters=cnt)
        targets.append(target)
    return targets


@pytest.mark.parametrize("world,rows,split_k,row1,dtype", [
    (2, 3, 1, False, torch.float32), (2, 8, 2, False, torch.bfloat16), (4, 1, 1, True, torch.bfloat16),
    (3, 1, 2, False, torch.float32), (2, 5, 1, False, torch.float16), (2, 1, 1, "stream", torch.bfloat16)])
def test_publish_then_reduce_is_the_general_paths_all_reduce_residual_and_norm(world, rows, split_k, row1, dtype):
    """x + sum over ranks of rnd(x_r @ W_r^T), then h = RMSNorm(x): equal to torch on every rank (bf16: the same
    roundings, the fp32 sum of W > 2 partials rounded once), and bit-identical across ranks. N = 72 is not a
    multiple of the 16-column tiles (a partial last tile); split-K, the one-row GEMV and its weight stream (18
    tiles of 4 columns over 4 programs) all publish."""
    n, k_per_rank = 72, 64
    g = torch.Generator().manual_seed(world * 10 + rows)
    xs = [torch.randn(rows, k_per_rank, generator=g).to(dtype=dtype, device=DEV) for _ in range(world)]
    ws = [(torch.randn(n, k_per_rank, generator=g) / 8).to(dtype=dtype, device=DEV) for _ in range(world)]
    x0 = torch.randn(rows, n, generator=g).to(dtype=dtype, device=DEV)
    nw = (torch.rand(n, generator=g) + 0.5).to(dtype=dtype, device=DEV)
    bufs = _bufs(world, 8, n, dtype)
    plan = _plan(n, k_per_rank, split_k=split_k, row1=row1)
    x_res = [x0.clone() for _ in range(world)]
    targets = _publish_all(xs, ws, x_res, bufs, plan, dtype)
    assert all(torch.equal(x, x0) for x in x_res), "a publish epilogue wrote its out"
    hs = [torch.full_like(x0, -3.0) for _ in range(world)]
    for r in range(world):
        reduce_rows(targets[r], x_res[r], tile_n=publish_tile_n(plan, rows), site=5, norm_weight=nw, h=hs[r], eps=EPS)
        bufs[r].check()
    partial = torch.stack([(xs[r].float() @ ws[r].float().T).to(dtype).float() for r in range(world)]).sum(0)
    want_x = (x0.float() + partial.to(dtype).float()).to(dtype)
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.02, "rtol": 0.02}
    torch.testing.assert_close(x_res[0], want_x, **tol)
    torch.testing.assert_close(hs[0], rms_norm(x_res[0], nw, EPS), **tol)
    for r in range(1, world):
        assert torch.equal(x_res[r], x_res[0]) and torch.equal(hs[r], hs[0]), f"rank {r} differs from rank 0"
    assert [b.last_tag for b in bufs] == [1] * world, "the reduce must advance the device tag once per call"


@pytest.mark.parametrize("world,rows,row1", [(2, 4, False), (3, 1, True), (2, 1, "stream")])
def test_roundings_are_the_general_paths_bit_for_bit(world: int, rows: int, row1: bool | str) -> None:
    """bf16 with values whose products and sums are exact in fp32 whatever the order (integers times multiples of
    1/8), so only the roundings can differ: each partial rounded to bf16 (as F.linear rounds), their fp32 sum
    rounded once (the all-reduce), the residual added and rounded, each to nearest even. Bit for bit."""
    n, k = 48, 64
    g = torch.Generator().manual_seed(world)
    xs = [torch.randint(-4, 5, (rows, k), generator=g).to(torch.bfloat16).to(DEV) for _ in range(world)]
    ws = [(torch.randint(-16, 17, (n, k), generator=g) / 8).to(torch.bfloat16).to(DEV) for _ in range(world)]
    x0 = (torch.randint(-64, 65, (rows, n), generator=g) / 16).to(torch.bfloat16).to(DEV)
    bufs = _bufs(world, 8, n, torch.bfloat16)
    plan = _plan(n, k, split_k=2, row1=row1)
    x_res = [x0.clone() for _ in range(world)]
    targets = _publish_all(xs, ws, x_res, bufs, plan, torch.bfloat16)
    for r in range(world):
        reduce_rows(targets[r], x_res[r], tile_n=publish_tile_n(plan, rows), site=0)
    parts = [(xs[r].float() @ ws[r].float().T).to(torch.bfloat16) for r in range(world)]
    want = (x0.float() + torch.stack(parts).float().sum(0).to(torch.bfloat16).float()).to(torch.bfloat16)
    assert parts[0].float().ne(xs[0].float() @ ws[0].float().T).any(), "the test needs partials that must round"
    for r in range(world):
        assert torch.equal(x_res[r], want), f"rank {r}: {(x_res[r].float() - want.float()).abs().max()}"


def test_ranks_are_summed_in_rank_order() -> None:
    """fp32 partials 1, 1e8, -1e8 (ranks 0, 1, 2): the rank-order sum (1 + 1e8) - 1e8 is 0 in fp32, any other order
    1 or 0 by chance; the sum must be the rank-order one (the same order on every rank is what keeps them equal)."""
    world, rows, n = 3, 1, 16
    bufs = _bufs(world, 8, n, torch.float32)
    plan = _plan(n, n, split_k=1, row1=False)
    vals = (1.0, 1e8, -1e8)
    xs = [torch.full((rows, n), v, device=DEV) for v in vals]
    ws = [torch.eye(n, device=DEV) for _ in range(world)]
    x_res = [torch.zeros(rows, n, device=DEV) for _ in range(world)]
    targets = _publish_all(xs, ws, x_res, bufs, plan, torch.float32)
    for r in range(world):
        reduce_rows(targets[r], x_res[r], tile_n=16, site=0)
    want = (torch.tensor(vals[0]) + torch.tensor(vals[1])) + torch.tensor(vals[2])
    assert float(want) == 0.0 and all(torch.equal(x, torch.zeros(rows, n, device=DEV)) for x in x_res), x_res


@pytest.mark.parametrize("row1", [False, True])
def test_every_tile_is_awaited(row1: bool) -> None:
    """Every rank published, then rank 1's flag of the last column tile is taken back on rank 0: rank 0's reduce
    must wait for it and give up (so it waits on every tile the GEMM published, at the GEMM's tile width: the
    one-row GEMV's 4 columns, or small_gemm's 16), while rank 1, whose flags are all there, completes."""
    world, rows, n, k = 2, 1, 48, 32
    bufs = _bufs(world, 8, n, torch.float32, deadline=30)
    plan = _plan(n, k, split_k=1, row1=row1)
    xs = [torch.ones(rows, k, device=DEV) for _ in range(world)]
    ws = [torch.ones(n, k, device=DEV) for _ in range(world)]
    x_res = [torch.zeros(rows, n, device=DEV) for _ in range(world)]
    targets = _publish_all(xs, ws, x_res, bufs, plan, torch.float32)
    tile_n = publish_tile_n(plan, rows)
    assert tile_n == (4 if row1 else 16)
    bufs[0].flags[1, n // tile_n - 1, 1] = 0  # tag 1: parity 1; rank 1's flag of the last tile
    for r in range(world):
        reduce_rows(targets[r], x_res[r], tile_n=tile_n, site=3)
    with pytest.raises(PeerWaitTimeout, match="rank 1"):
        bufs[0].check()
    bufs[1].check()
    assert torch.equal(x_res[1], torch.full((rows, n), 2.0 * k, device=DEV))


def test_consecutive_calls_take_consecutive_tags_and_the_other_parity() -> None:
    """Three calls on the same buffers (the o_proj and down of a layer, then the next): each uses the next tag,
    and stale flags of the previous call of the same parity are never taken for the new one."""
    world, rows, n, k = 2, 2, 32, 32
    bufs = _bufs(world, 8, n, torch.float32)
    plan = _plan(n, k, split_k=1, row1=False)
    for call in range(1, 4):
        xs = [torch.full((rows, k), float(call * (r + 1)), device=DEV) for r in range(world)]
        ws = [torch.eye(n, k, device=DEV) for _ in range(world)]
        x_res = [torch.zeros(rows, n, device=DEV) for _ in range(world)]
        targets = _publish_all(xs, ws, x_res, bufs, plan, torch.float32)
        for r in range(world):
            reduce_rows(targets[r], x_res[r], tile_n=16, site=call)
            bufs[r].check()
        assert torch.equal(x_res[0], torch.full((rows, n), 3.0 * call, device=DEV)), call
    assert [b.last_tag for b in bufs] == [3, 3]


def test_a_rank_that_never_publishes_stops_every_rank_within_the_deadline_naming_it() -> None:
    """Fault injection: rank 1's GEMM stores its tiles but never releases their flags. Every rank's reduce gives up
    after its deadline (polls under the interpreter), writes NaN, and the error record names rank 1 as the peer
    missing, the call site and the stage."""
    world, rows, n, k = 2, 1, 32, 32
    bufs = _bufs(world, 8, n, torch.float32, deadline=50)
    plan = _plan(n, k, split_k=1, row1=False)
    xs = [torch.ones(rows, k, device=DEV) for _ in range(world)]
    ws = [torch.ones(n, k, device=DEV) for _ in range(world)]
    x_res = [torch.zeros(rows, n, device=DEV) for _ in range(world)]
    targets = _publish_all(xs, ws, x_res, bufs, plan, torch.float32, publish=(True, False))
    for r in range(world):
        reduce_rows(targets[r], x_res[r], tile_n=16, site=7)
        assert torch.isnan(x_res[r]).all(), f"rank {r} used tiles that were never published"
        with pytest.raises(PeerWaitTimeout, match=r"rank 1") as e:
            bufs[r].check()
        assert (e.value.rank, e.value.peer, e.value.site) == (r, 1, 7)


def test_bad_arguments_are_refused_by_name() -> None:
    bufs = _bufs(2, 1, 32, torch.float32)
    plan = _plan(32, 32, split_k=1, row1=False)
    x, w, out = (torch.zeros(1, 32, device=DEV), torch.zeros(32, 32, device=DEV), torch.zeros(1, 32, device=DEV))
    with pytest.raises(ValueError, match="epilogue 'publish' takes peer"):
        gemm(x, w, out, plan=plan, epilogue="publish")
    with pytest.raises(ValueError, match="epilogue 'publish' takes peer"):
        gemm(x, w, out, plan=plan, peer=PeerTarget(bufs[0]))
    with pytest.raises(ValueError, match="needs peer buffers of that dtype"):  # float32 buffers, float16 GEMM
        gemm(x.half(), w.half(), out.half(), plan=plan, epilogue="publish", peer=PeerTarget(bufs[0]))
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):  # no kernel serves float64 at all
        gemm(x.double(), w.double(), out.double(), plan=plan, epilogue="publish", peer=PeerTarget(bufs[0]))
    with pytest.raises(ValueError, match="tile_n must be a power of two"):
        reduce_rows(PeerTarget(bufs[0]), out, tile_n=12, site=0)
    with pytest.raises(ValueError, match="norm_weight and h come together"):
        reduce_rows(PeerTarget(bufs[0]), out, tile_n=16, site=0, norm_weight=torch.ones(32, device=DEV))


def test_gathered_logits_drop_the_last_ranks_padding(monkeypatch: pytest.MonkeyPatch) -> None:
    """V = 5 over 2 ranks: 3 rows each, the last rank's third one padding; the gathered [T, 6] loses its last
    column, in rank order."""
    from lowlat_nvidia_mega.tp import MegaTP

    monkeypatch.setattr(lowlat_peer, "all_gather_last_dim", lambda x, tp: torch.cat([x, x + 10], dim=-1))
    local = torch.arange(6, dtype=torch.float32, device=DEV).reshape(2, 3)
    got = MegaTP(tp=None, target=None, vocab_size=5, vocab_start=0).gather_logits(local)  # type: ignore[arg-type]
    assert torch.equal(got, torch.cat([local, local + 10], dim=-1)[:, :5]) and got.is_contiguous()


@pytest.mark.parametrize("rows,row1", [(3, False), (1, True)])
def test_moe_publishes_its_partial_and_the_ranks_sum_to_the_whole_moe(rows: int, row1: bool) -> None:
    """Qwen3-MoE at TP 2 with simulated ranks: each rank's ``moe_forward(..., peer=...)`` runs its slice of every
    expert's intermediate dim (w13 rows, w2 columns; the router replicated) and publishes its top-k sum per tile;
    ``reduce_rows`` at the down tile width adds the ranks and the residual. Equal (fp32) to the whole MoE at TP 1
    plus the residual, bit-identical on both ranks, and ``out`` never written by the publishing launch."""
    from lowlat_nvidia_mega.kernels.moe import MoEKernelConfig, MoEWorkspace, moe_forward

    world, hidden, inter, experts, top_k = 2, 64, 32, 8, 2
    cfg = MoEKernelConfig(gate_up_block_n=16, gate_up_block_k=64, down_block_n=32, route_programs=2, row1=row1,
                          row1_block_n=8, row1_block_k=32)
    g = torch.Generator().manual_seed(rows)
    norm_w = (1 + 0.2 * torch.randn(hidden, generator=g)).to(DEV)
    gate_w = (torch.randn(experts, hidden, generator=g) * 0.3).to(DEV)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.15).to(DEV)
    w2 = (torch.randn(experts, hidden, inter, generator=g) * 0.15).to(DEV)
    x = torch.randn(rows, hidden, generator=g).to(DEV)
    whole = torch.empty_like(x)
    moe_forward(x, x, norm_w, EPS, gate_w, w13, w2, top_k, True, whole,
                MoEWorkspace.allocate(8, hidden, inter, experts, top_k, x.dtype, DEV), pdl=False, config=cfg)
    bufs = _bufs(world, 8, hidden, torch.float32)
    il = inter // world
    outs = []
    for r in range(world):
        gate, up = w13[:, r * il:(r + 1) * il], w13[:, inter + r * il:inter + (r + 1) * il]
        w13_r, w2_r = torch.cat([gate, up], dim=1).contiguous(), w2[:, :, r * il:(r + 1) * il].contiguous()
        out = x.clone()
        moe_forward(x, None, norm_w, EPS, gate_w, w13_r, w2_r, top_k, True, out,
                    MoEWorkspace.allocate(8, hidden, il, experts, top_k, x.dtype, DEV), pdl=False, config=cfg,
                    peer=PeerTarget(bufs[r]))
        assert torch.equal(out, x), f"rank {r}: the publishing MoE wrote its out"
        outs.append(out)
    for r in range(world):
        reduce_rows(PeerTarget(bufs[r]), outs[r], tile_n=cfg.down_block_n, site=1, eps=EPS)
        bufs[r].check()
    torch.testing.assert_close(outs[0], whole, atol=1e-4, rtol=1e-4)
    assert torch.equal(outs[0], outs[1])
    with pytest.raises(ValueError, match="a published MoE output takes no residual"):
        moe_forward(x, x, norm_w, EPS, gate_w, w13, w2, top_k, True, x.clone(),
                    MoEWorkspace.allocate(8, hidden, inter, experts, top_k, x.dtype, DEV), pdl=False, config=cfg,
                    peer=PeerTarget(bufs[0]))
