"""The peer all-reduce's device tag (``PeerBuffers.tag_state``): calls without a host tag advance it on the device.

Simulated ranks in one process, as test_peer_allreduce.py (helpers in _peer_util.py): on CPU the two-launch
mode under the Triton interpreter, with 3 tiles, so 3 programs must agree on one tag and one of them bumps it;
on a GPU (``python bench/gpu_jobs.py gpu-tests``) CUDA graphs of the one-launch mode replayed on concurrent
streams. Mutation pass: bench/scripts/mutate_peer_allreduce.py.
"""

from __future__ import annotations

import pytest
import torch
from _peer_util import CAP, DEV, N, guard, inputs, make, rank_order_sum, record
from lowlat.kernels.peer_allreduce import TAG_CYCLE, peer_all_reduce, peer_push, peer_reduce
from lowlat.runtime.peer_buffers import PeerBuffers

pytestmark = pytest.mark.gpu  # also run on a GPU: python bench/gpu_jobs.py gpu-tests

TILES = 3  # N = 40 elements in tiles of 16


def step(bufs: list[PeerBuffers], xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """One call on every rank in the two-launch mode, no host tag."""
    for b, x in zip(bufs, xs, strict=True):
        peer_push(x, b)
    return [peer_reduce(b, None, x.numel()) for b, x in zip(bufs, xs, strict=True)]


def assert_published(bufs: list[PeerBuffers], tag: int) -> None:
    """Every rank's flags of ``tag``'s parity hold ``tag`` from every rank in the tiles used; the ticket is 0."""
    for b in bufs:
        assert b.last_tag == tag and int(b.tag_state[1]) == 0, (b.rank, b.tag_state.tolist())
        assert torch.all(b.flags[tag & 1, :TILES] == tag), (b.rank, tag, b.flags.tolist())


def test_calls_without_a_host_tag_use_consecutive_tags_with_alternating_parity() -> None:
    bufs = make(2)
    assert [b.last_tag for b in bufs] == [0, 0]
    for tag in range(1, 5):
        xs = inputs(2, torch.float32, seed=tag)
        outs = step(bufs, xs)
        for b, out in zip(bufs, outs, strict=True):
            b.check()
            assert torch.equal(out, rank_order_sum(xs)), (tag, b.rank)
        assert_published(bufs, tag)
        if tag > 1:
            assert all(torch.all(b.flags[(tag - 1) & 1, :TILES] == tag - 1) for b in bufs)  # the other parity


def test_a_push_alone_does_not_advance_the_tag() -> None:
    bufs = make(2)
    xs = inputs(2, torch.float32, seed=1)
    peer_push(xs[0], bufs[0])
    peer_push(xs[1], bufs[1])
    assert [b.last_tag for b in bufs] == [0, 0]
    outs = [peer_reduce(b, None, N, check=True) for b in bufs]
    assert all(torch.equal(out, rank_order_sum(xs)) for out in outs)
    assert_published(bufs, 1)


def test_the_device_tag_wraps_after_tag_cycle() -> None:
    bufs = make(2)
    for b in bufs:
        b.tag_state[0] = TAG_CYCLE - 1
    for tag in (TAG_CYCLE, 1, 2):  # even, odd, even
        xs = inputs(2, torch.float32, seed=tag % 7)
        outs = step(bufs, xs)
        for b, out in zip(bufs, outs, strict=True):
            b.check()
            assert torch.equal(out, rank_order_sum(xs))
        assert_published(bufs, tag)


def test_a_host_tag_overrides_and_the_device_tag_continues_from_it() -> None:
    bufs = make(2)
    xs = inputs(2, torch.float32, seed=2)
    for b, x in zip(bufs, xs, strict=True):
        peer_push(x, b, 7)
    for b in bufs:
        peer_reduce(b, 7, N, check=True)
    assert_published(bufs, 7)
    outs = step(bufs, xs)
    assert all(torch.equal(out, rank_order_sum(xs)) for out in outs)
    assert_published(bufs, 8)


def test_one_launch_mode_advances_the_device_tag() -> None:
    """Rank 1 pushes, rank 0 runs the one-launch kernel (3 programs) with the device tag, rank 1 reduces; twice."""
    bufs = make(2, torch.bfloat16)
    for tag in (1, 2):
        xs = inputs(2, torch.bfloat16, seed=tag)
        peer_push(xs[1], bufs[1])
        out0 = peer_all_reduce(xs[0], bufs[0], check=True)
        out1 = peer_reduce(bufs[1], None, N, check=True)
        assert torch.equal(out0, rank_order_sum(xs)) and torch.equal(out1, rank_order_sum(xs))
        assert_published(bufs, tag)


def test_a_timed_out_call_records_the_device_tag_and_reset_restarts_at_1() -> None:
    bufs = make(2)
    step(bufs, inputs(2, torch.float32, seed=3))
    peer_push(inputs(2, torch.float32, seed=4)[0], bufs[0])  # rank 1 never pushes tag 2
    with guard(bufs):
        peer_reduce(bufs[0], None, N)
    rec = record(bufs[0])
    assert (rec["abort"], rec["tag"], rec["peer"]) == (2, 2, 1), rec
    assert bufs[0].last_tag == 2  # a call that gave up still used its tag
    for b in bufs:
        b.reset()
        assert b.tag_state.tolist() == [0, 0]
    xs = inputs(2, torch.float32, seed=5)
    assert all(torch.equal(out, rank_order_sum(xs)) for out in step(bufs, xs))
    assert_published(bufs, 1)


def test_warm_compiles_alone_and_leaves_the_buffers_untouched() -> None:
    bufs = make(2)
    before = [t.clone() for t in (bufs[0].data, bufs[0].flags, bufs[0].ctl, bufs[0].tag_state)]
    bufs[0].warm()  # simulated peers of its own: no wait on bufs[1]
    after = (bufs[0].data, bufs[0].flags, bufs[0].ctl, bufs[0].tag_state)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_closed_buffers_are_refused() -> None:
    bufs = make(2)
    bufs[0].close()
    bufs[0].close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        peer_push(torch.zeros(8, device=DEV), bufs[0])
    with PeerBuffers.simulated(2, CAP, torch.float32, device=DEV)[1] as b:
        assert not b.closed
    assert b.closed


@pytest.mark.skipif(DEV.type != "cuda", reason="needs CUDA: CUDA graphs of the one-launch mode")
@pytest.mark.parametrize("world", [2, 4])
def test_cuda_graph_replays_advance_the_device_tag(world: int) -> None:
    """Each simulated rank's one-launch call is captured in a CUDA graph once (after an eager warm-up call, tag 1)
    and replayed 8 times on its own stream, concurrently with the other ranks' graphs, with fresh inputs each
    time: every replay's sum is right and the device tag advances once per replay."""
    bufs = make(world, torch.bfloat16, deadline=2_000_000_000)
    xs = [torch.zeros(CAP, dtype=torch.bfloat16, device=DEV) for _ in range(world)]
    outs = [torch.empty_like(x) for x in xs]
    streams = [torch.cuda.Stream() for _ in range(world)]
    torch.cuda.synchronize()
    for b, x, out, s in zip(bufs, xs, outs, streams, strict=True):
        with torch.cuda.stream(s):
            peer_all_reduce(x, b, out=out)  # compiles; tag 1
    torch.cuda.synchronize()
    graphs = []
    for b, x, out, s in zip(bufs, xs, outs, streams, strict=True):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            peer_all_reduce(x, b, out=out)
        graphs.append(g)
    torch.cuda.synchronize()
    assert [b.last_tag for b in bufs] == [1] * world  # capture launched nothing
    for k in range(8):
        new = inputs(world, torch.bfloat16, seed=10 + k, n=CAP)
        for x, v in zip(xs, new, strict=True):
            x.copy_(v)
        torch.cuda.synchronize()
        for g, s in zip(graphs, streams, strict=True):
            with torch.cuda.stream(s):
                g.replay()
        torch.cuda.synchronize()
        for b, out in zip(bufs, outs, strict=True):
            b.check()
            assert torch.equal(out, rank_order_sum(new)), (k, b.rank)
            assert b.last_tag == k + 2 and int(b.tag_state[1]) == 0, (k, b.rank, b.tag_state.tolist())
