"""One-shot all-reduce over peer buffers: every rank pushes its contribution into every rank, then sums locally.

Layout (one rank's buffers; ``PeerBuffers`` owns them, ``W`` ranks, capacity ``C`` elements, tile ``BLOCK``):

    data  [2, W, C]  x's dtype   data[p, s] holds rank s's contribution of the last step whose tag has parity p
    flags [2, T, W]  int32       flags[p, t, s] holds the tag of the last step rank s published tile t for
                                 (T = ceil(C / BLOCK); 0 = never published)
    ctl   [CTL_SIZE] int64       this rank's error record (below); never written by peers
    tag_state [2] int32          this rank's device tag: [last tag used (0 = none yet), ticket]; local

Each rank's table ``data_ptrs`` / ``flag_ptrs`` (int64 [W], on the device) holds the base address of every
rank's ``data`` / ``flags`` as seen from this rank (the way torch's symmetric-memory Triton kernels take
``buffer_ptrs_dev``: load the int64, cast it to a pointer of the element type).

PUSH (rank r, tile t): store x[t] into ``data[p, r, t]`` of every rank, a CTA barrier, then a release
exchange (system scope: the flags live in other GPUs' memory) of the tag into ``flags[p, t, r]`` of every rank.
REDUCE (tile t): poll ``flags[p, t, 0:W]`` of this rank's own buffer with acquire atomics until every one
holds the tag (bounded by the deadline), then ``out[t] = sum(data[p, s, t] for s in 0..W-1)``, added in rank
order in float32 and cast once to x's dtype: every rank adds the same values in the same order, so the result is
bit-identical on every rank. ``p = tag & 1``.

Why two parities: a rank can run at most one step ahead of a peer (its reduce of step k waits for every rank's
push of step k, which each rank issues after its own reduce of step k - 1), so the push of step k + 1 lands in
the other parity while a slow peer still reads step k, and a flag that still holds step k - 1's tag (same parity,
tag - 2) never equals the tag being waited for. Tags must therefore be consecutive (``next_tag``): 1 .. 2**30,
then 1 again (2**30 is even, so the parity alternates across the wrap too). One stream per ``PeerBuffers``.

The device tag (the engine's path, and what makes a call capturable in a CUDA graph: no host value changes from
one replay to the next). A call without a host ``tag`` reads ``tag_state[0]`` (the last tag used) in every
program and uses ``tag = last % TAG_CYCLE + 1``. The last launch of a call (the one-launch kernel, or the reduce
of the two-launch mode; a push-only launch never bumps) writes that tag back, through a ticket: each program,
after a CTA barrier (every thread has read the tag), adds 1 to ``tag_state[1]`` (acq_rel); the program that draws
``num_programs - 1`` is the last of the launch, so it stores the tag into ``tag_state[0]`` and resets the ticket
to 0. No program can read the bumped value: the bump happens after every program's ticket, each released after
its own read. The next call is a later launch on the same stream, so it sees the bump. Rejected: a separate
bump launch after each call (one more launch, ~1 us, on the path this kernel exists to shorten); bumping in the
first program of the next call (the other programs of that call would race with it); a host counter (a CUDA
graph bakes it in). A host ``tag`` (tests) overrides the read and is stored the same way, so device-tagged calls
continue from it. ``PeerBuffers.reset`` zeroes ``tag_state`` (tags restart at 1 on every rank).

Modes: ``peer_all_reduce`` is one launch (push, then reduce; programs walk the tiles grid-stride and the grid is
at most the SM count, so every program is resident and every push happens before any program can block).
``peer_push`` + ``peer_reduce`` are two launches: under the Triton interpreter a launch runs to its end before
the next starts, so simulated peers must all push before any reduces.

Deadline: each tile's wait reads a clock when it starts and gives up once ``deadline`` units pass: nanoseconds of
``%globaltimer`` on CUDA (``TIMER_NS``), or the number of polls (``TIMER_POLLS``: the interpreter has no clock,
since it cannot run inline assembly). The first wait to give up writes the error record and sets the abort word;
every later wait on this rank (this launch and later ones, until ``PeerBuffers.reset``) sees the abort word and
leaves at once, so a dead peer costs one deadline, not one per call. Outputs of tiles that were not ready are NaN
(undefined once the record is set). The host turns the record into ``PeerWaitTimeout`` (``PeerBuffers.check``).

``ctl`` layout (int64): [abort word (the first timed-out tag; any non-zero value stops the waits), tag, rank,
awaited peer, stage, tile, call site, time waited (in the timer's unit)].

Design sources, read for ideas only (no code taken): the one-shot custom all-reduce of vLLM and SGLang
(``custom_all_reduce.cuh``, ``cross_device_reduce_1stage``: after a flag barrier each rank *reads* every peer's
input and sums in rank order; here each rank *pushes* instead, so the wait is per tile and the reduce reads only
local memory), torch symmetric memory's Triton kernels (``buffer_ptrs_dev`` and signal pads, flags stored with
release and polled with acquire at system scope) and the tag protocol of ``lowlat_amd_mono.kernels.sync``
(acquire polling, a clock or poll-count deadline, an abort word, an error record naming the stage).
"""

from __future__ import annotations

from typing import Protocol

import torch
import triton
import triton.language as tl

from lowlat.kernels._launch import check_cpu_launch


class PeerBuffers(Protocol):
    """What the launchers read of one rank's buffers: ``lowlat.runtime.peer_buffers.PeerBuffers`` (which sits
    above this module and imports its constants, so the kernels name only this shape of it)."""

    world: int
    rank: int
    block: int
    capacity: int
    max_programs: int
    deadline: int
    timer: int
    dtype: torch.dtype
    device: torch.device
    data_ptrs: torch.Tensor
    flag_ptrs: torch.Tensor
    ctl: torch.Tensor
    tag_state: torch.Tensor
    closed: bool

    def check(self) -> None: ...

__all__ = ["CTL_FIELDS", "CTL_SIZE", "STAGE_NAMES", "TAG_CYCLE", "TAG_STATE_SIZE", "TIMER_NS", "TIMER_POLLS",
           "check_launchable", "device_tag", "finish_call", "next_tag", "peer_all_reduce", "peer_push", "peer_reduce",
           "publish_tile", "wait_tiles"]

CTL_FIELDS = ("abort", "tag", "rank", "peer", "stage", "tile", "site", "waited")  # the record, in order
CTL_SIZE = len(CTL_FIELDS)
CTL_ABORT, CTL_TAG, CTL_RANK, CTL_PEER, CTL_STAGE, CTL_TILE, CTL_SITE, CTL_WAITED = map(tl.constexpr, range(CTL_SIZE))
STAGE_REDUCE = tl.constexpr(1)
STAGE_NAMES = {int(STAGE_REDUCE): "reduce"}  # the stage whose wait gave up (only the reduce waits)

TIMER_POLLS = 0  # deadline counted in polls (the interpreter; a fallback on GPUs)
TIMER_NS = 1  # %globaltimer, nanoseconds (CUDA)

TAG_CYCLE = 1 << 30  # tags run 1 .. TAG_CYCLE, then 1 again; 0 means "never published"
_TAG_CYCLE = tl.constexpr(TAG_CYCLE)  # the kernels' copy (a jit function reads only constexpr globals)
TAG_LAST, TAG_TICKET = tl.constexpr(0), tl.constexpr(1)  # tag_state: the last tag used, the launch's ticket
TAG_STATE_SIZE = 2


def next_tag(tag: int) -> int:
    """The tag of the call after one tagged ``tag`` (0 gives the first tag, 1)."""
    return tag % TAG_CYCLE + 1


@triton.jit
def _clock(TIMER: tl.constexpr):
    if TIMER == 1:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    else:
        t = tl.full([], 0, tl.int64)
    return t


@triton.jit
def device_tag(tag_ptr, host_tag):
    """The tag of a call: ``host_tag`` when > 0 (tests), else the device tag, ``tag_state[0] % TAG_CYCLE + 1``.
    Every program of every launch of one call reads it before the call's last launch bumps it (``finish_call``)."""
    last = tl.load(tag_ptr + TAG_LAST, volatile=True)
    return tl.where(host_tag > 0, host_tag, last % _TAG_CYCLE + 1)


@triton.jit
def publish_tile(v, offs, mask, data_ptrs, flag_ptrs, tag, rank, cap, cap_tiles, tile, publish, WORLD: tl.constexpr):
    """PUSH of one tile, from any kernel (a GEMM epilogue, say): store ``v`` (any block shape, the buffers' dtype)
    at element offsets ``offs`` of this rank's slot in every rank's ``data`` (the tag's parity), then a CTA
    barrier, then release ``tag`` into ``flags[parity, tile, rank]`` of every rank (system scope). ``publish`` = 0
    stores the data but never the flags (fault injection: a rank that never arrives)."""
    parity = tag & 1
    live = (tl.zeros([], tl.int32) + publish) != 0  # a tensor even where the caller's int was specialized to 1
    for p in tl.static_range(WORLD):
        peer_data = tl.load(data_ptrs + p).to(tl.pointer_type(v.dtype))
        tl.store(peer_data + (parity * WORLD + rank).to(tl.int64) * cap + offs, v, mask=mask)
    tl.debug_barrier()  # every thread's stores of this tile happen before the release below
    for p in tl.static_range(WORLD):
        peer_flags = tl.load(flag_ptrs + p).to(tl.pointer_type(tl.int32))
        tl.atomic_xchg(peer_flags + (parity * cap_tiles + tile) * WORLD + rank, tag, mask=live, sem="release",
                       scope="sys")


@triton.jit
def wait_tiles(flag_ptr, tag, ctl_ptr, deadline, rank, tile, site, live_tiles,
               WORLD: tl.constexpr, WPAD: tl.constexpr, TIMER: tl.constexpr, NT: tl.constexpr):
    """Poll the first ``live_tiles`` (<= ``NT``) of ``NT`` consecutive tiles' flags from ``flag_ptr`` (``[NT, WORLD]``
    int32, one flag per tile and source rank, this rank's own buffer) until all hold ``tag``, bounded by
    ``deadline`` units of ``TIMER``.

    Returns 1 when they do, 0 when the deadline passed or the abort word is set (then the first wait to give up
    on this rank writes the error record: ``tile`` is the first of the ``NT``, ``peer`` the first missing rank).
    Each thread read the abort word and the clock itself, so the decision goes through a reduction: every thread
    of the program takes the same one. A CTA barrier follows, so the data loads after it are ordered after every
    thread's acquire.
    """
    lanes = tl.arange(0, NT * WPAD)
    live = ((lanes % WPAD) < WORLD) & ((lanes // WPAD) < live_tiles)
    offs = (lanes // WPAD) * WORLD + lanes % WPAD
    zero = tl.zeros([NT * WPAD], tl.int64)
    t0 = _clock(TIMER)
    polls = tl.full([], 0, tl.int64)
    waited = tl.full([], 0, tl.int64)
    peer = tl.full([], 0, tl.int32)
    state = tl.full([], 0, tl.int32)  # 0 polling, 1 ready, 2 abort word seen, 3 deadline passed
    while state == 0:
        seen = tl.atomic_add(flag_ptr + offs, 0, mask=live, sem="acquire", scope="sys")
        peer = tl.min(tl.where(live & (seen != tag), lanes % WPAD, WPAD), axis=0)
        abort = tl.load(ctl_ptr + CTL_ABORT, volatile=True)
        polls += 1
        if TIMER == 1:
            waited = _clock(TIMER) - t0
        else:
            waited = polls
        sig = tl.max(tl.where(zero + abort != 0, 2, tl.where(zero + waited > deadline, 3, 0)), axis=0)
        state = tl.where(peer >= WORLD, 1, sig)
    timed_out = state == 3
    prev = tl.atomic_xchg(ctl_ptr + CTL_ABORT, tag.to(tl.int64), mask=timed_out, sem="acq_rel", scope="gpu")
    first = timed_out & (prev == 0)
    tl.store(ctl_ptr + CTL_TAG, tag.to(tl.int64), mask=first)
    tl.store(ctl_ptr + CTL_RANK, rank.to(tl.int64), mask=first)
    tl.store(ctl_ptr + CTL_PEER, peer.to(tl.int64), mask=first)
    tl.store(ctl_ptr + CTL_STAGE, STAGE_REDUCE, mask=first)
    tl.store(ctl_ptr + CTL_TILE, tl.zeros([], tl.int64) + tile, mask=first)  # tile: a Python int when interpreted
    tl.store(ctl_ptr + CTL_SITE, site.to(tl.int64), mask=first)
    tl.store(ctl_ptr + CTL_WAITED, waited, mask=first)
    tl.debug_barrier()  # the data loads that follow are ordered after every thread's acquire
    return state == 1


@triton.jit
def finish_call(tag_ptr, tag, nprog):
    """End of a call's last launch (the one that reduces): the program that draws the last of ``nprog`` tickets
    stores ``tag`` as the last tag used and re-arms the ticket (module docstring, "The device tag")."""
    tl.debug_barrier()  # every thread of this program has read the tag
    drawn = tl.atomic_add(tag_ptr + TAG_TICKET, 1, sem="acq_rel", scope="gpu")
    last_program = drawn == nprog - 1
    tl.store(tag_ptr + TAG_LAST, tag, mask=last_program)
    tl.store(tag_ptr + TAG_TICKET, 0, mask=last_program)


@triton.jit(do_not_specialize=["n", "rank", "host_tag", "deadline", "site", "publish"])
def _peer_all_reduce_kernel(
    x_ptr, out_ptr, data_ptrs, flag_ptrs, ctl_ptr, tag_ptr,
    n, cap, rank, host_tag, deadline, site, publish,
    WORLD: tl.constexpr, WPAD: tl.constexpr, BLOCK: tl.constexpr,
    PUSH: tl.constexpr, REDUCE: tl.constexpr, TIMER: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    tag = device_tag(tag_ptr, host_tag)  # every program reads before any bump (below)
    n_tiles = tl.cdiv(n, BLOCK)
    cap_tiles = tl.cdiv(cap, BLOCK)
    parity = tag & 1
    elem = out_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    if PUSH:
        for t in tl.range(pid, n_tiles, nprog):
            offs = t * BLOCK + cols
            mask = offs < n
            v = tl.load(x_ptr + offs, mask=mask)
            publish_tile(v, offs, mask, data_ptrs, flag_ptrs, tag, rank, cap, cap_tiles, t, publish, WORLD)
    if REDUCE:
        own_data = tl.load(data_ptrs + rank).to(tl.pointer_type(elem))
        own_flags = tl.load(flag_ptrs + rank).to(tl.pointer_type(tl.int32))
        for t in tl.range(pid, n_tiles, nprog):
            offs = t * BLOCK + cols
            mask = offs < n
            ready = wait_tiles(own_flags + (parity * cap_tiles + t) * WORLD, tag, ctl_ptr, deadline, rank, t, site, 1,
                               WORLD, WPAD, TIMER, 1)
            if ready:
                acc = tl.zeros([BLOCK], tl.float32)
                for s in tl.static_range(WORLD):
                    v = tl.load(own_data + (parity * WORLD + s).to(tl.int64) * cap + offs, mask=mask, other=0.0)
                    acc += v.to(tl.float32)
                tl.store(out_ptr + offs, acc.to(elem), mask=mask)
            else:
                tl.store(out_ptr + offs, tl.full([BLOCK], float("nan"), tl.float32).to(elem), mask=mask)
        finish_call(tag_ptr, tag, nprog)  # the call's last launch (module docstring)


def check_launchable(device: torch.device, what: str) -> None:
    """Raise ValueError naming ``what`` when the kernel cannot launch on ``device`` (a CPU without the Triton
    interpreter), so a caller can refuse at start-up rather than at its first call."""
    if device.type == "cpu":
        check_cpu_launch(what, _peer_all_reduce_kernel)


def _check_tag(tag: int | None) -> None:
    if tag is not None and (not isinstance(tag, int) or not 1 <= tag <= TAG_CYCLE):
        raise ValueError(f"tag must be None (the device tag) or an int in [1, {TAG_CYCLE}] (next_tag gives "
                         f"consecutive tags), got {tag!r}")


def _check_input(x: torch.Tensor, bufs: PeerBuffers, what: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{what} must be a tensor, got {type(x).__name__}")
    if x.dtype != bufs.dtype or x.device != bufs.device:
        raise ValueError(f"{what} must be {bufs.dtype} on {bufs.device} (the PeerBuffers'), got {x.dtype} on "
                         f"{x.device}")
    if not x.is_contiguous():
        raise ValueError(f"{what} must be contiguous; pass {what}.contiguous()")
    if x.numel() > bufs.capacity:
        raise ValueError(f"{what} has {x.numel()} elements but the PeerBuffers hold {bufs.capacity}; use the NCCL "
                         "all-reduce for messages that do not fit (PeerBuffers.fits)")


def _launch(bufs: PeerBuffers, x: torch.Tensor | None, out: torch.Tensor | None, tag: int | None, site: int,
            publish: bool, push: bool, reduce: bool, check: bool = False) -> None:
    """Launch the kernel in one mode; ``check`` then reads the error record (``PeerBuffers.check``, a host sync)."""
    if bufs.closed:
        raise RuntimeError("these PeerBuffers are closed (their peers' mappings are released); make new ones")
    _check_tag(tag)
    if not 0 <= site < 2**31:
        raise ValueError(f"site must be in [0, 2**31), got {site}")
    ref = x if x is not None else out
    assert ref is not None
    n = ref.numel()
    if n == 0:
        return
    if bufs.device.type == "cpu":
        check_cpu_launch("peer all-reduce", _peer_all_reduce_kernel)
    tiles = triton.cdiv(n, bufs.block)
    grid = tiles if not (push and reduce) or bufs.device.type == "cpu" else min(tiles, bufs.max_programs)
    _peer_all_reduce_kernel[(grid,)](
        x if x is not None else out, out if out is not None else x,
        bufs.data_ptrs, bufs.flag_ptrs, bufs.ctl, bufs.tag_state,
        n, bufs.capacity, bufs.rank, 0 if tag is None else tag, bufs.deadline, site, int(publish),
        WORLD=bufs.world, WPAD=triton.next_power_of_2(bufs.world), BLOCK=bufs.block,
        PUSH=push, REDUCE=reduce, TIMER=bufs.timer, num_warps=4,
    )
    if check:
        bufs.check()


def peer_push(x: torch.Tensor, bufs: PeerBuffers, tag: int | None = None, *, publish: bool = True) -> None:
    """PUSH alone (the first of the two launches): store ``x`` into this rank's slot of every rank's buffer.

    Args:
        x: this rank's contribution, any shape, contiguous, ``bufs.dtype`` (bf16/fp16/fp32) on ``bufs.device``,
            at most ``bufs.capacity`` elements (flattened).
        tag: None (the engine's way): the device tag, ``bufs.tag_state``'s last tag + 1 (module docstring). Or a
            host tag, in [1, TAG_CYCLE], consecutive across calls (``next_tag``), the same on every rank (tests);
            it overrides the device tag, which then continues from it.
        publish: fault injection: False stores the data but never publishes the flags (a rank that never
            arrives), so every rank's reduce times out naming this rank.
    Raises:
        ValueError: bad dtype, device, layout, size or tag; CPU tensors without ``TRITON_INTERPRET=1``.
        RuntimeError: ``bufs`` is closed.
    """
    _check_input(x, bufs, "x")
    _launch(bufs, x, None, tag, 0, publish, True, False)


def peer_reduce(bufs: PeerBuffers, tag: int | None, n: int, *, out: torch.Tensor | None = None, site: int = 0,
                check: bool = False) -> torch.Tensor:
    """REDUCE alone (the second launch): wait for every rank's push of ``tag``, then sum in rank order; with the
    device tag (``tag=None``) it then advances ``bufs.tag_state`` (the push before it does not).

    Args:
        tag: as ``peer_push`` (the same as the push's).
        n: elements per rank (the pushes' ``x.numel()``).
        out: optional contiguous [n] tensor of ``bufs.dtype`` on ``bufs.device`` to write into.
        site: a caller's id of this all-reduce (e.g. 2 * layer + k, < 2**31), copied into the error record.
        check: read the error record right away (a host sync: for tests) and raise if it is set.
    Returns:
        ``out`` (or a new [n] tensor): the float32 rank-order sum cast to ``bufs.dtype``; NaN in the tiles whose
        wait gave up (see ``PeerBuffers.check``).
    Raises:
        ValueError, RuntimeError: as ``peer_push``; PeerWaitTimeout: only with ``check=True``.
    """
    if out is None:
        out = torch.empty(n, dtype=bufs.dtype, device=bufs.device)
    elif out.numel() != n:
        raise ValueError(f"out has {out.numel()} elements, expected n = {n}")
    _check_input(out, bufs, "out")
    _launch(bufs, None, out, tag, site, True, False, True, check)
    return out


def peer_all_reduce(x: torch.Tensor, bufs: PeerBuffers, tag: int | None = None, *, out: torch.Tensor | None = None,
                    site: int = 0, publish: bool = True, check: bool = False) -> torch.Tensor:
    """The sum of every rank's ``x`` in one launch (push, then reduce). The GPU mode, and the engine's call: with
    the default device tag it captures in a CUDA graph and each replay advances the tag on the device.

    Under the interpreter it completes only once every other simulated rank has pushed ``tag`` (``peer_push``), or
    once the other processes' ranks have (``PeerBuffers.rendezvous``).

    Args:
        x, tag, publish: as ``peer_push``. out, site, check: as ``peer_reduce`` (``out`` may be ``x``: each tile
            is read by the program that later overwrites it).
    Returns:
        ``out`` (or a new tensor shaped like ``x``): the float32 rank-order sum in ``x``'s dtype, bit-identical on
        every rank; NaN in the tiles whose wait gave up.
    Raises:
        ValueError, RuntimeError: as ``peer_push``; PeerWaitTimeout: only with ``check=True``.
    """
    _check_input(x, bufs, "x")
    if out is None:
        out = torch.empty_like(x)
    elif out.shape != x.shape:
        raise ValueError(f"out must be shaped like x {tuple(x.shape)}, got {tuple(out.shape)}")
    _check_input(out, bufs, "out")
    _launch(bufs, x, out, tag, site, publish, True, True, check)
    return out
