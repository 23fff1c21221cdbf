"""The one-shot peer all-reduce (lowlat.kernels.peer_allreduce) with simulated ranks in one process.

On CPU the kernels run under the Triton interpreter, in the two-launch mode (every simulated rank pushes, then
every rank reduces: the interpreter runs one launch at a time) and the deadline counts polls. The interpreter runs
one program at a time, so two tests stand in for concurrency: a host thread plays a peer that publishes tile by
tile while a reduce polls, and a watcher checks every interpreted flag operation (data and a barrier before each
release; release/acquire at system scope); a third compiles the kernel for sm90 and reads its PTX.
On a GPU (the same file, DEV = cuda: ``python bench/gpu_jobs.py gpu-tests``) the simulated ranks share one device,
the deadline is %globaltimer nanoseconds, and one test runs the one-launch mode with 2 and 4 ranks on concurrent
streams. None of this is two GPUs: no NVLink, no symmetric memory, no second process.
Mutation pass: bench/scripts/mutate_peer_allreduce.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from _peer_util import BLOCK, CAP, CPU, DEV, DTYPES, N, guard, inputs, make, rank_order_sum, record
from lowlat.kernels.peer_allreduce import (
    CTL_FIELDS,
    TAG_CYCLE,
    next_tag,
    peer_all_reduce,
    peer_push,
    peer_reduce,
)
from lowlat.runtime.deadline import StepDeadlineExceeded
from lowlat.runtime.peer_buffers import PeerBuffers, PeerWaitTimeout

pytestmark = pytest.mark.gpu  # also run on a GPU: python bench/gpu_jobs.py gpu-tests


def two_launch_step(bufs: list[PeerBuffers], xs: list[torch.Tensor], tag: int, silent: tuple[int, ...] = ()
                    ) -> list[torch.Tensor]:
    """Every rank pushes (ranks in ``silent`` store but never publish), then every rank reduces."""
    for b, x in zip(bufs, xs, strict=True):
        peer_push(x, b, tag, publish=b.rank not in silent)
    return [peer_reduce(b, tag, x.numel()) for b, x in zip(bufs, xs, strict=True)]


def assert_timed_out(b: PeerBuffers, peer: int, tag: int) -> None:
    """The record of a wait that gave up: on CPU tile 0's (programs run in order; the later tiles then see the
    abort word), on a GPU any tile's (they wait at once; the first to give up writes it)."""
    rec = record(b)
    assert (rec["abort"], rec["tag"], rec["rank"], rec["peer"], rec["stage"]) == (tag, tag, b.rank, peer, 1), rec
    if CPU:
        assert rec["tile"] == 0 and rec["waited"] == b.deadline + 1, rec  # gave up at the first poll past it
    else:
        assert 0 <= rec["tile"] < 3 and b.deadline < rec["waited"] < b.deadline + 50_000_000, rec  # ns, 50 ms


# -- results -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("world", [2, 4])
def test_sum_is_the_float32_rank_order_sum_bit_identical_on_every_rank(world: int, dtype: torch.dtype) -> None:
    bufs = make(world, dtype)
    xs = inputs(world, dtype)
    outs = two_launch_step(bufs, xs, tag=1)
    want = rank_order_sum(xs)
    for b, out in zip(bufs, outs, strict=True):
        b.check()
        assert torch.equal(out, want), (b.rank, (out.float() - want.float()).abs().max())
    if world == 4 and dtype == torch.float32:  # the data tells rank order from another order
        assert not torch.equal(want, rank_order_sum(xs[::-1]))


def test_one_launch_mode_matches_two_launches_in_place_and_any_shape() -> None:
    """Rank 0 uses the one-launch mode once ranks 1..3 have pushed (the interpreter runs one launch at a time),
    with a [5, 8] input reduced in place; ranks 1..3 then reduce. Every rank has the same bits."""
    bufs = make(4, torch.bfloat16)
    xs = [x.view(5, 8) for x in inputs(4, torch.bfloat16, seed=1)]
    want = rank_order_sum(xs)
    for b, x in zip(bufs[1:], xs[1:], strict=True):
        peer_push(x, b, 1)
    x0 = xs[0].clone()
    out0 = peer_all_reduce(x0, bufs[0], 1, out=x0, check=True)
    assert out0.data_ptr() == x0.data_ptr() and torch.equal(out0, want)
    for b in bufs[1:]:
        assert torch.equal(peer_reduce(b, 1, N, check=True).view(5, 8), want)


def test_a_rank_one_step_ahead_does_not_disturb_a_slow_peer() -> None:
    """Rank 0 finishes step 1 and pushes step 2 before rank 1 reduces step 1: step 2 lands in the other parity,
    so rank 1 still sums step 1's values; then step 2 completes."""
    bufs = make(2)
    s1, s2 = inputs(2, torch.float32, seed=2), inputs(2, torch.float32, seed=3)
    for b, x in zip(bufs, s1, strict=True):
        peer_push(x, b, 1)
    r0 = peer_reduce(bufs[0], 1, N)
    peer_push(s2[0], bufs[0], 2)  # rank 0 runs ahead
    r1 = peer_reduce(bufs[1], 1, N, check=True)
    assert torch.equal(r0, rank_order_sum(s1)) and torch.equal(r1, rank_order_sum(s1))
    peer_push(s2[1], bufs[1], 2)
    for b in bufs:
        assert torch.equal(peer_reduce(b, 2, N, check=True), rank_order_sum(s2))


def test_tags_wrap_with_alternating_parity() -> None:
    assert [next_tag(t) for t in (0, 1, TAG_CYCLE - 1, TAG_CYCLE)] == [1, 2, TAG_CYCLE, 1]
    bufs = make(2)
    tag = TAG_CYCLE - 1
    for seed in range(3):  # TAG_CYCLE - 1, TAG_CYCLE, 1: odd, even, odd
        xs = inputs(2, torch.float32, seed=seed)
        outs = two_launch_step(bufs, xs, tag)
        for b, out in zip(bufs, outs, strict=True):
            b.check()
            assert torch.equal(out, rank_order_sum(xs))
        tag = next_tag(tag)


# -- stale flags, faults, deadlines --------------------------------------------------------------------------

def test_a_stale_flag_from_an_older_step_does_not_satisfy_the_wait() -> None:
    """After steps 1 and 2, rank 1's flags in rank 0's parity-1 slots still hold tag 1 (and its data step 1's
    values); at step 3 rank 1 never pushes, so rank 0 must time out naming rank 1, not sum the stale data."""
    bufs = make(2)
    for tag in (1, 2):
        two_launch_step(bufs, inputs(2, torch.float32, seed=tag), tag)
        for b in bufs:
            b.check()
    assert torch.all(bufs[0].flags[1, :3, 1] == 1)  # the stale tag is there
    peer_push(inputs(2, torch.float32, seed=3)[0], bufs[0], 3)
    with guard(bufs):
        out = peer_reduce(bufs[0], 3, N)
    assert_timed_out(bufs[0], peer=1, tag=3)
    assert torch.isnan(out).all()
    with pytest.raises(PeerWaitTimeout, match=r"rank 0 timed out in stage 'reduce' waiting for rank 1's push "
                                              r"\(step tag 3, tile \d"):
        bufs[0].check()


def test_a_rank_that_never_publishes_stops_every_rank_within_the_deadline() -> None:
    """W = 4, rank 2 never publishes: every rank (rank 2 too: its own slot is missing) gives up at the deadline
    with a record naming rank 2, the stage and the tag; the host raises a clear error on each; later calls leave
    at once through the abort word; after a reset on every rank the next step is correct again."""
    bufs = make(4)
    xs = inputs(4, torch.float32, seed=4)
    t0 = time.monotonic()
    with guard(bufs):
        outs = two_launch_step(bufs, xs, tag=1, silent=(2,))
    elapsed = time.monotonic() - t0
    for b, out in zip(bufs, outs, strict=True):
        assert_timed_out(b, peer=2, tag=1)
        assert torch.isnan(out).all()
        with pytest.raises(PeerWaitTimeout) as err:
            b.check()
        msg = str(err.value)
        assert f"rank {b.rank} timed out in stage 'reduce' waiting for rank 2's push (step tag 1, tile" in msg
        assert "Check that rank 2 is alive" in msg and "same order" in msg
        assert ("this rank's own push" in msg) == (b.rank == 2)
        assert isinstance(err.value, StepDeadlineExceeded) and err.value.peer == 2 and err.value.rank == b.rank
    if not CPU:
        assert elapsed < 4 * 1.0  # four ranks, one after the other, each stopped after ~0.2 s
    # The next call (rank 2 still silent) does not time out again: its waits see the abort word (it keeps tag 1).
    with guard(bufs):
        outs = two_launch_step(bufs, xs, tag=2, silent=(2,))
    assert all(record(b)["abort"] == 1 and record(b)["tag"] == 1 for b in bufs)
    assert all(torch.isnan(out).all() for out in outs)
    for b in bufs:
        b.reset()
    for b, out in zip(bufs, two_launch_step(bufs, xs, tag=1), strict=True):
        b.check()
        assert torch.equal(out, rank_order_sum(xs))


@pytest.mark.parametrize("deadline", [1, 7] if CPU else [1_000_000, 50_000_000])
def test_the_deadline_bounds_the_wait(deadline: int) -> None:
    """Nobody pushes: the wait gives up exactly at the first poll past the deadline (CPU), or within a few ms of
    it (GPU, nanoseconds)."""
    bufs = make(2, deadline=deadline)
    with guard(bufs):
        out = peer_reduce(bufs[1], 5, N)
    assert_timed_out(bufs[1], peer=0, tag=5)
    assert torch.isnan(out).all()


def test_the_host_check_is_lazy_unless_asked() -> None:
    """A failed wait raises nothing by itself (no host sync per call); ``check()``, ``check_record`` on a host copy
    and ``check=True`` raise. An abort word set from outside raises naming that."""
    bufs = make(2, deadline=3)
    peer_push(inputs(2, torch.float32)[0], bufs[0], 1)
    with guard(bufs):
        peer_reduce(bufs[0], 1, N)  # rank 1 never pushed: no exception here
    host = bufs[0].ctl.tolist()
    with pytest.raises(PeerWaitTimeout, match="waiting for rank 1's push"):
        bufs[0].check_record(host)
    with pytest.raises(PeerWaitTimeout, match="waiting for rank 1's push"):
        peer_reduce(bufs[0], 1, N, check=True)
    bufs[1].check()  # rank 1 waited for nothing
    with pytest.raises(PeerWaitTimeout, match="aborted from outside"):
        bufs[1].check_record([-1] + [0] * (len(CTL_FIELDS) - 1))


@pytest.mark.skipif(not CPU, reason="a host thread as the peer: the interpreter's polls see its writes at once")
def test_the_reduce_reads_a_tile_only_after_its_flags_are_acquired() -> None:
    """Rank 1's push is played by a host thread that writes each tile's data, then its flag, 50 ms apart, into
    rank 0's buffer (which holds garbage before). Rank 0's reduce must wait per tile and read each tile only
    after its flag: the result is exactly x0 + x1."""
    bufs = make(2, deadline=10**7)
    x0, x1 = inputs(2, torch.float32, seed=5)
    peer_push(x0, bufs[0], 1)
    bufs[0].data[1, 1].fill_(1e30)  # stale garbage in rank 1's slot (parity 1 = tag 1)

    def peer() -> None:
        for t in range(3):
            time.sleep(0.05)
            lo, hi = t * BLOCK, min((t + 1) * BLOCK, N)
            bufs[0].data[1, 1, lo:hi] = x1[lo:hi]
            bufs[0].flags[1, t, 1] = 1

    th = threading.Thread(target=peer)
    th.start()
    with guard(bufs):
        out = peer_reduce(bufs[0], 1, N)
    th.join()
    bufs[0].check()
    assert torch.equal(out, rank_order_sum([x0, x1]))


@pytest.mark.skipif(not CPU, reason="watches the interpreter's memory operations")
def test_every_flag_release_follows_its_data_and_a_barrier(monkeypatch) -> None:
    """The interpreter runs one program at a time, so the results alone cannot show a flag released before its
    data, a missing CTA barrier or a weaker memory order; this test watches the interpreted operations instead. At
    every flag exchange the tile's data is already in the target rank's buffer, a barrier ran after the last data
    store, and the exchange is a release at system scope; every flag poll is an acquire at system scope."""
    from triton._C.libtriton import ir
    from triton.runtime.interpreter import InterpreterBuilder

    bufs = make(2)
    xs = inputs(2, torch.float32, seed=6)
    flag_ranges = [(b.flags.data_ptr(), b.flags.data_ptr() + b.flags.numel() * 4, b) for b in bufs]
    seen = {"release": 0, "acquire": 0, "stores_since_barrier": 0}
    store, barrier, rmw = (InterpreterBuilder.create_masked_store, InterpreterBuilder.create_barrier,
                           InterpreterBuilder.create_atomic_rmw)

    def on_store(self, *args):
        seen["stores_since_barrier"] += 1
        return store(self, *args)

    def on_barrier(self):
        seen["stores_since_barrier"] = 0
        return barrier(self)

    def on_rmw(self, op, ptr, val, mask, sem, scope):
        out = rmw(self, op, ptr, val, mask, sem, scope)
        for addr, live in zip(ptr.data.reshape(-1).tolist(), mask.data.reshape(-1).tolist(), strict=True):
            for lo, hi, b in flag_ranges:
                if live and lo <= addr < hi:
                    p, t, src = torch.unravel_index(torch.tensor((addr - lo) // 4), b.flags.shape)
                    if op == ir.ATOMIC_OP.XCHG:
                        assert (sem, scope) == (ir.MEM_SEMANTIC.RELEASE, ir.MEM_SYNC_SCOPE.SYSTEM)
                        assert seen["stores_since_barrier"] == 0, "a flag released with no barrier after the data"
                        tile = slice(int(t) * BLOCK, min((int(t) + 1) * BLOCK, N))
                        assert torch.equal(b.data[p, src, tile], xs[src][tile]), "a flag released before its data"
                        seen["release"] += 1
                    else:
                        assert (op, sem, scope) == (ir.ATOMIC_OP.ADD, ir.MEM_SEMANTIC.ACQUIRE, ir.MEM_SYNC_SCOPE.SYSTEM)
                        seen["acquire"] += 1
        return out

    monkeypatch.setattr(InterpreterBuilder, "create_masked_store", on_store)
    monkeypatch.setattr(InterpreterBuilder, "create_barrier", on_barrier)
    monkeypatch.setattr(InterpreterBuilder, "create_atomic_rmw", on_rmw)
    outs = two_launch_step(bufs, xs, tag=1)
    assert seen["release"] == 2 * 2 * 3 and seen["acquire"] == 2 * 2 * 3  # ranks x peers x tiles; one poll each
    assert all(torch.equal(out, rank_order_sum(xs)) for out in outs)


@pytest.mark.skipif(DEV.type != "cuda", reason="needs CUDA: two ranks' one-launch kernels running at once")
@pytest.mark.parametrize("world", [2, 4])
def test_cuda_one_launch_ranks_on_concurrent_streams(world: int) -> None:
    """Each simulated rank's one-launch kernel on its own stream of one GPU: the waits see the other kernels'
    pushes while they run (release/acquire at system scope, %globaltimer deadline). Ten consecutive tags."""
    bufs = make(world, torch.bfloat16, deadline=2_000_000_000)
    streams = [torch.cuda.Stream() for _ in range(world)]
    for tag in range(1, 11):
        xs = inputs(world, torch.bfloat16, seed=tag, n=CAP)
        torch.cuda.synchronize()
        outs = []
        for b, x, s in zip(bufs, xs, streams, strict=True):
            with torch.cuda.stream(s):
                outs.append(peer_all_reduce(x, b, tag))
        torch.cuda.synchronize()
        for b, out in zip(bufs, outs, strict=True):
            b.check()
            assert torch.equal(out, rank_order_sum(xs)), (tag, b.rank)


def test_kernel_compiles_for_sm90_with_system_scope_release_acquire() -> None:
    """Without a GPU: Triton's compiler and bundled ptxas build the kernel for sm90 (one launch, push alone, reduce
    alone; three dtypes; W = 2, 4, 8; both timers), and its PTX publishes with a system-scope release exchange,
    polls with a system-scope acquire, orders with bar.sync, reads %globaltimer for the nanosecond deadline, and
    draws the device tag's ticket with an acq_rel add in the launches that end a call (never in a push alone)."""
    pytest.importorskip("triton.backends.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("_sm90_compile_peer.py")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    if r.returncode and "ptxas" in r.stderr and "not found" in r.stderr:
        pytest.skip("this Triton has no bundled ptxas")
    assert r.returncode == 0, r.stderr[-3000:]
    got = {tuple(d["config"]): set(d["ops"]) for d in map(json.loads, r.stdout.splitlines())}
    release, acquire = "atom.global.sys.release.exch.b32", "atom.global.sys.acquire.add.u32"
    assert got[("bf16", 2, True, True, 1)] >= {release, acquire, "bar.sync", "%globaltimer", "ld.volatile.global.b64"}
    assert release in got[("fp32", 4, True, False, 1)] and acquire not in got[("fp32", 4, True, False, 1)]
    assert acquire in got[("fp16", 8, False, True, 0)] and "%globaltimer" not in got[("fp16", 8, False, True, 0)]
    ticket = "atom.global.gpu.acq_rel.add.u32"
    assert ticket in got[("bf16", 2, True, True, 1)] and ticket in got[("fp16", 8, False, True, 0)]
    assert ticket not in got[("fp32", 4, True, False, 1)]


# -- inputs and allocation -----------------------------------------------------------------------------------

def test_buffers_are_allocated_through_the_given_allocator() -> None:
    seen: list[tuple[str, int]] = []

    def alloc(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        t = torch.zeros(shape, dtype=dtype, device=DEV)
        seen.append((name, t.numel() * t.element_size()))
        return t

    bufs = make(2, torch.float16, alloc=alloc)
    assert sorted(n for n, _ in seen) == sorted(f"peer_{k}.{r}" for k in ("data", "flags", "ctl", "tag")
                                                 for r in (0, 1))
    data_bytes, flag_bytes = 2 * 2 * CAP * 2, 2 * 4 * 2 * 4  # [2, W, CAP] fp16 and [2, 4 tiles, W] int32
    assert bufs[0].nbytes == data_bytes + flag_bytes + 8 * 8 + 2 * 4 + 2 * 2 * 8  # + record, tag, tables
    assert bufs[0].data_ptrs.tolist() == [b.data.data_ptr() for b in bufs]
    assert bufs[1].flag_ptrs.tolist() == [b.flags.data_ptr() for b in bufs]
    assert bufs[0].fits(torch.zeros(CAP, dtype=torch.float16, device=DEV))
    assert not bufs[0].fits(torch.zeros(CAP + 1, dtype=torch.float16, device=DEV))
    assert not bufs[0].fits(torch.zeros(8, dtype=torch.float32, device=DEV))


@pytest.mark.parametrize("call, match", [
    (lambda b: peer_push(torch.zeros(8, dtype=torch.float16, device=DEV), b, 1), "must be torch.float32"),
    (lambda b: peer_push(torch.zeros(CAP + 1, device=DEV), b, 1), "use the NCCL all-reduce"),
    (lambda b: peer_push(torch.zeros(8, 2, device=DEV).t(), b, 1), "must be contiguous"),
    (lambda b: peer_push(torch.zeros(8, device=DEV), b, 0), "or an int in"),
    (lambda b: peer_push(torch.zeros(8, device=DEV), b, TAG_CYCLE + 1), "or an int in"),
    (lambda b: peer_reduce(b, 1, 8, out=torch.zeros(9, device=DEV)), "expected n = 8"),
    (lambda b: peer_all_reduce(torch.zeros(8, device=DEV), b, 1, out=torch.zeros(4, 2, device=DEV)), "shaped like"),
    (lambda b: PeerBuffers.simulated(1, 8, torch.float32), r"world must be in \[2, 8\]"),
    (lambda b: PeerBuffers.simulated(2, 8, torch.float32, block=24), "power of two"),
    (lambda b: PeerBuffers.simulated(2, 8, torch.int32), "bf16, fp16 or fp32"),
    (lambda b: PeerBuffers.simulated(2, 8, torch.float32, deadline=0), "positive count"),
])
def test_bad_inputs_raise(call, match: str) -> None:
    bufs = make(2)
    with pytest.raises(ValueError, match=match):
        call(bufs[0])
