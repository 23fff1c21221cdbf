"""The tag protocol: how one workgroup of a persistent launch tells others that a value is ready.

Every work item of a stage owns one int32 flag in ``flags[layer, stage, item]``. When the item's stores are
done, its workgroup runs ``publish``: a CTA barrier (so every thread's stores happen before), then an atomic
exchange with release semantics that writes the step's *tag*. A consumer runs ``wait_flags``: it polls the
flags it needs with acquire atomics (``tl.atomic_add(p, 0, sem="acquire")``; a volatile load would not order
the data loads after it) until all of them equal the tag. The tag is a device int32 step counter that the
embedding kernel bumps once per step (1, 2, ..., 2**30 - 1, then 1 again), so flags are never reset: a stale
flag simply holds an older tag. Flags are per layer, so layer ``l + 1`` never sees layer ``l``'s flags.

Deadline: each wait reads a clock when it starts and gives up when ``deadline`` ticks pass. The clock is
``%globaltimer`` (nanoseconds) on CUDA, ``s_memrealtime`` (a 100 MHz constant clock on CDNA3; untested here)
on ROCm, and the poll count in the stage-per-launch mode and under the interpreter (``TIMER_SPIN``).
The first workgroup to time out writes the step's tag to the abort word and fills the error record; every
wait polls the abort word, so all workgroups of this launch and of the step's later launches leave promptly.
The host reads the record (``ctl``) and raises an error naming the layer and the stage.

``ctl`` layout (int32): [abort tag, error count, tag, layer, waiting stage, awaited stage, first missing item,
kind]. ``debug_mask`` (a runtime int) lets tests and benchmarks alter stages: bit ``s`` skips stage ``s``'s
compute (it still publishes), bit ``8 + s`` makes stage ``s`` never publish (fault injection).

Design after the flag/counter handshakes of persistent "megakernels" (Hazy Research's Llama megakernel,
Mirage MPK) and the PTX memory model's release/acquire patterns (PTX ISA, "Memory Consistency Model").
"""

from __future__ import annotations

import triton
import triton.language as tl

CTL_ABORT = tl.constexpr(0)
CTL_COUNT = tl.constexpr(1)
CTL_TAG = tl.constexpr(2)
CTL_LAYER = tl.constexpr(3)
CTL_STAGE = tl.constexpr(4)
CTL_AWAITED = tl.constexpr(5)
CTL_ITEM = tl.constexpr(6)
CTL_KIND = tl.constexpr(7)
CTL_SIZE = 8

KIND_DEADLINE = tl.constexpr(1)  # a per-item flag wait timed out; the record's item is the first missing item
KIND_COUNT = tl.constexpr(2)  # a stage-counter wait timed out; the record's item is the count of items seen

TIMER_SPIN = 0  # deadline counted in polls
TIMER_CUDA = 1  # %globaltimer, nanoseconds
TIMER_HIP = 2  # s_memrealtime, 100 MHz on gfx942/gfx950

TAG_WRAP = 1 << 30  # the step tag cycles through 1 .. TAG_WRAP - 1; 0 means "never published"
CNT_STRIDE = 32  # int32s between two stage counters (wait_count): one 128-byte line each
CNT = tl.constexpr(CNT_STRIDE)


@triton.jit
def read_timer(TIMER: tl.constexpr):
    """A 64-bit clock value in the unit of ``TIMER`` (0 when counting polls)."""
    if TIMER == 1:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    elif TIMER == 2:
        t = tl.inline_asm_elementwise("s_memrealtime $0\ns_waitcnt lgkmcnt(0)", "=s", [], dtype=tl.int64,
                                      is_pure=False, pack=1)
    else:
        t = tl.full([], 0, tl.int64)
    return t


@triton.jit
def _elapsed(t0, spins, TIMER: tl.constexpr):
    """Time since ``t0`` in the unit of ``TIMER``; with no clock (``TIMER_SPIN``), the polls done (``spins``)."""
    if TIMER == 0:
        e = spins
    else:
        e = read_timer(TIMER) - t0
    return e


@triton.jit
def stage_runs(debug_mask, STAGE_ID: tl.constexpr):
    """False when a benchmark asked to skip stage ``STAGE_ID``'s compute (the stage still publishes)."""
    return ((debug_mask >> STAGE_ID) & 1) == 0


@triton.jit
def publish(flag_ptr, cnt_ptr, tag, debug_mask, STAGE_ID: tl.constexpr, COUNT: tl.constexpr):
    """Release this item's stores and mark it ready for step ``tag``; with ``COUNT``, also add 1 to the stage's
    counter ``cnt_ptr`` (release), which ``wait_count`` polls.

    The barrier orders every thread's stores before the release atomics (release is cumulative in the PTX and
    HSA models). Fault injection (bit ``8 + STAGE_ID`` of ``debug_mask``) suppresses both writes.
    """
    keep = ((debug_mask >> (8 + STAGE_ID)) & 1) == 0
    tl.debug_barrier()
    tl.atomic_xchg(flag_ptr, tag, mask=keep, sem="release", scope="gpu")
    if COUNT:
        tl.atomic_add(cnt_ptr, 1, mask=keep, sem="release", scope="gpu")


@triton.jit
def _record_timeout(timed_out, tag, layer, item, ctl_ptr, STAGE_ID: tl.constexpr, AWAITED: tl.constexpr,
                    KIND: tl.constexpr):
    """Raise the abort for step ``tag`` and, if this workgroup is the first to time out, fill the error record."""
    prev = tl.atomic_xchg(ctl_ptr + CTL_ABORT, tag, mask=timed_out, sem="acq_rel", scope="gpu")
    first = timed_out & (prev != tag)
    tl.store(ctl_ptr + CTL_TAG, tag, mask=first)
    tl.store(ctl_ptr + CTL_LAYER, layer, mask=first)
    tl.store(ctl_ptr + CTL_STAGE, STAGE_ID, mask=first)
    tl.store(ctl_ptr + CTL_AWAITED, AWAITED, mask=first)
    tl.store(ctl_ptr + CTL_ITEM, item, mask=first)
    tl.store(ctl_ptr + CTL_KIND, KIND, mask=first)
    tl.debug_barrier()
    tl.atomic_add(ctl_ptr + CTL_COUNT, 1, mask=first, sem="release", scope="gpu")


@triton.jit
def wait_flags(flags_ptr, lo, hi, tag, ctl_ptr, deadline, layer,
               STAGE_ID: tl.constexpr, AWAITED: tl.constexpr, MAXW: tl.constexpr, TIMER: tl.constexpr):
    """Wait until ``flags_ptr[lo:hi]`` all hold ``tag``; return 1 when they do, 0 when the launch aborts.

    Flags are scanned in chunks of ``MAXW`` from the first one not yet seen ready (a flag that holds the tag
    keeps it for the rest of the step), with acquire atomics, so the caller's later loads see the producers'
    stores. While blocked, the wait polls the abort word and its deadline; on timeout the first workgroup to
    notice records (tag, layer, stage, awaited stage, first missing item) in ``ctl`` and raises the abort.
    """
    pos = tl.full([], 0, tl.int32) + lo
    state = tl.full([], 0, tl.int32)  # 0 waiting, 1 ready, 2 abort seen, 3 timed out
    t0 = read_timer(TIMER)
    spins = tl.full([], 0, tl.int64)
    lanes = tl.zeros([MAXW], tl.int32)
    while state == 0:
        offs = pos + tl.arange(0, MAXW)
        live = offs < hi
        seen = tl.atomic_add(flags_ptr + offs, 0, mask=live, sem="acquire", scope="gpu")
        missing = live & (seen != tag)
        nxt = tl.min(tl.where(missing, offs, pos + MAXW), axis=0)
        blocked = nxt < pos + MAXW
        pos = tl.minimum(nxt, hi)
        abort_tag = tl.load(ctl_ptr + CTL_ABORT, volatile=True)
        elapsed = _elapsed(t0, spins, TIMER)
        spins += 1
        # Each thread read the abort word and the clock itself; a reduction makes the decision the same for all
        # threads of the workgroup (a split decision would diverge around the barriers of the next poll).
        sig = tl.max(tl.where(lanes + abort_tag == tag, 2, tl.where((lanes + elapsed) > deadline, 1, 0)), axis=0)
        state = tl.where(pos >= hi, 1, tl.where(blocked & (sig == 2), 2, tl.where(blocked & (sig == 1), 3, 0)))
    _record_timeout(state == 3, tag, layer, pos, ctl_ptr, STAGE_ID, AWAITED, KIND_DEADLINE)
    return (state == 1).to(tl.int32)


@triton.jit
def wait_count(cnt_ptr, need, tag, ctl_ptr, deadline, layer, STAGE_ID: tl.constexpr, AWAITED: tl.constexpr,
               TIMER: tl.constexpr):
    """Wait until the stage counter ``cnt_ptr`` reaches ``need``; return 1 when it does, 0 when the launch aborts.

    One acquire atomic per poll on one address, instead of one per awaited flag (``wait_flags``): with 132
    workgroups polling 128 flags, the atomics on the flags' few cache lines serialize in L2. The counter is
    zeroed once per step by the embedding launch, so it counts only this step's items. Deadline and abort as in
    ``wait_flags``; the error record's item field holds the count seen.
    """
    state = tl.full([], 0, tl.int32)  # 0 waiting, 1 ready, 2 abort seen, 3 timed out
    t0 = read_timer(TIMER)
    spins = tl.full([], 0, tl.int64)
    seen = tl.full([], 0, tl.int32)
    lanes = tl.zeros([16], tl.int32)
    while state == 0:
        seen = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
        abort_tag = tl.load(ctl_ptr + CTL_ABORT, volatile=True)
        elapsed = _elapsed(t0, spins, TIMER)
        spins += 1
        # One decision for the whole workgroup (see wait_flags).
        sig = tl.max(tl.where(lanes + seen >= need, 3, tl.where(lanes + abort_tag == tag, 2,
                                                                   tl.where((lanes + elapsed) > deadline, 1, 0))),
                     axis=0)
        state = tl.where(sig == 3, 1, tl.where(sig == 2, 2, tl.where(sig == 1, 3, 0)))
    _record_timeout(state == 3, tag, layer, seen, ctl_ptr, STAGE_ID, AWAITED, KIND_COUNT)
    return (state == 1).to(tl.int32)


@triton.jit
def wait_if(alive, flags_ptr, lo, hi, tag, ctl_ptr, deadline, layer,
            STAGE_ID: tl.constexpr, AWAITED: tl.constexpr, MAXW: tl.constexpr, TIMER: tl.constexpr,
            PERSISTENT: tl.constexpr):
    """``wait_flags`` for a workgroup still alive in a persistent launch; a no-op (returns ``alive``) in the
    stage-per-launch mode, where the launch boundary already orders producer and consumer."""
    if PERSISTENT:
        if alive != 0:
            alive = wait_flags(flags_ptr, lo, hi, tag, ctl_ptr, deadline, layer, STAGE_ID, AWAITED, MAXW, TIMER)
    return alive


@triton.jit
def wait_all_if(alive, flags_ptr, cnt_ptr, n, tag, ctl_ptr, deadline, layer, STAGE_ID: tl.constexpr,
                AWAITED: tl.constexpr, MAXW: tl.constexpr, TIMER: tl.constexpr, PERSISTENT: tl.constexpr,
                COUNT: tl.constexpr):
    """Wait for the first ``n`` items of a stage: its counter with ``COUNT``, else its flags ``[0, n)``; a no-op in
    the stage-per-launch mode (see ``wait_if``)."""
    if PERSISTENT:
        if alive != 0:
            if COUNT:
                alive = wait_count(cnt_ptr, n, tag, ctl_ptr, deadline, layer, STAGE_ID, AWAITED, TIMER)
            else:
                alive = wait_flags(flags_ptr, 0, n, tag, ctl_ptr, deadline, layer, STAGE_ID, AWAITED, MAXW, TIMER)
    return alive
