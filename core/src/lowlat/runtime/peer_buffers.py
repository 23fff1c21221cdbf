"""Peer buffers: one rank's symmetric buffers for the one-shot peer all-reduce, and its error record.

Every rank holds the same-shaped ``data`` [2, W, capacity] (the all-reduce's dtype) and ``flags``
[2, ceil(capacity / block), W] int32 (zero at the start), plus a local ``ctl`` error record and a local
``tag_state`` (the device tag: the last tag used and a launch's ticket, int32 [2]); a table of int64 base
addresses (``data_ptrs``, ``flag_ptrs``, [W], on the device) tells this rank where every rank's buffers are in its
own address space. The layout and the protocol are in ``lowlat.kernels.peer_allreduce``.

Where the table comes from:

* ``PeerBuffers.simulated`` (implemented): W ranks' buffers in one process on one device (separate tensors, their
  real addresses in one shared table), one ``PeerBuffers`` per simulated rank. Tests use it on CPU under the
  Triton interpreter; on one GPU it runs the two-launch mode.
* ``PeerBuffers.rendezvous`` (implemented): one rank per process, every rank of a TP group calls it; the
  buffers are shared and the peers' mapped through ``lowlat.runtime.peer_exchange`` (CPU: shared-memory files;
  CUDA: CUDA IPC through torch's tensor sharing, which maps another GPU's memory or, for two processes of one
  GPU, the same GPU's), and each process builds its own table. Rejected: torch symmetric memory
  (``torch.distributed._symmetric_memory``): its rendezvous may set up NVLink multicast, which is forbidden on
  the machines we run on, and it needs CUDA (the CPU tests could not run it).

Accounting: every buffer is allocated through ``alloc(name, shape, dtype)`` (default: a zero-filled tensor on the
device), so the caller can hand in an accounted workspace allocator; ``nbytes`` is this rank's total. The general
path's rule (``ModelRunner.reserved_bytes``): allocate before the KV pool is sized, or reserve ``nbytes`` first.

Deadline: each cross-rank wait gives up after ``deadline`` units of ``timer``: nanoseconds on CUDA
(``DEFAULT_DEADLINE_NS`` = 5 s, below the engine's 60 s step watchdog), polls on CPU (the interpreter has no
clock; 350 to 480 polls per second were measured for W = 2..8 on a busy 2-core CPU, so the default 2,000 polls is
about 5 s). Polls on a GPU (``timer=TIMER_POLLS``, a fallback) take an explicit deadline: a poll's duration there
is not measured yet. A rank still compiling its first launch while its peers wait counts against the
deadline: warm the kernels before the first cross-rank call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import triton

from lowlat.distributed import TPInfo
from lowlat.kernels.peer_allreduce import (
    CTL_FIELDS,
    CTL_SIZE,
    STAGE_NAMES,
    TAG_STATE_SIZE,
    TIMER_NS,
    TIMER_POLLS,
    peer_all_reduce,
    peer_push,
)
from lowlat.runtime.deadline import StepDeadlineExceeded
from lowlat.runtime.peer_exchange import PeerExchangeError, exchange

__all__ = ["DEFAULT_BLOCK", "DEFAULT_DEADLINE_NS", "DEFAULT_DEADLINE_POLLS", "PeerBuffers", "PeerExchangeError",
           "PeerWaitTimeout"]

DEFAULT_BLOCK = 1024  # elements per tile (one program's work in a loop step, one flag per rank)
DEFAULT_DEADLINE_NS = 5_000_000_000
DEFAULT_DEADLINE_POLLS = 2_000  # about 5 s under the interpreter

Alloc = Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor]


class PeerWaitTimeout(StepDeadlineExceeded):
    """A rank's peer all-reduce gave up waiting for a peer within its deadline (this engine is unusable).

    Attributes:
        rank, peer, stage, tag, tile, site, waited: the error record (``peer`` is the first rank found missing).
    """

    def __init__(self, message: str, record: dict[str, int]) -> None:
        super().__init__(message)
        self.record = record
        for k, v in record.items():
            setattr(self, k, v)


def _check_sizes(world: int, capacity: int, dtype: torch.dtype, block: int) -> None:
    if not 2 <= world <= 8:
        raise ValueError(f"world must be in [2, 8], got {world}")
    if capacity < 1 or block < 16 or block & (block - 1):
        raise ValueError(f"capacity must be >= 1 and block a power of two >= 16, got {capacity} and {block}")
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"dtype must be bf16, fp16 or fp32, got {dtype}")


def _timer_and_deadline(device: torch.device, timer: int | None, deadline: int | None) -> tuple[int, int]:
    if timer is None:
        timer = TIMER_NS if device.type == "cuda" else TIMER_POLLS
    if timer not in (TIMER_NS, TIMER_POLLS) or (timer == TIMER_NS and device.type != "cuda"):
        raise ValueError(f"timer must be TIMER_POLLS, or TIMER_NS on CUDA; got {timer} on {device}")
    if deadline is None:
        if timer == TIMER_POLLS and device.type != "cpu":
            raise ValueError("timer=TIMER_POLLS on a GPU needs an explicit deadline, in polls")
        deadline = DEFAULT_DEADLINE_NS if timer == TIMER_NS else DEFAULT_DEADLINE_POLLS
    if not 0 < deadline < 2**62:
        raise ValueError(f"deadline must be a positive count of {'ns' if timer == TIMER_NS else 'polls'}, "
                         f"got {deadline}")
    return timer, int(deadline)


def _zeros(device: torch.device) -> Alloc:
    return lambda name, shape, dtype: torch.zeros(shape, dtype=dtype, device=device)


class PeerBuffers:
    """This rank's peer buffers, the table of every rank's addresses, and the error record.

    Attributes:
        rank, world: this rank and the number of ranks (2 <= world <= 8).
        capacity: elements per rank a call may reduce at most; dtype: the element dtype; device: where all live.
        block: elements per tile; the same on every rank.
        data: [2, world, capacity] ``dtype``; flags: [2, ceil(capacity / block), world] int32; ctl: [CTL_SIZE]
            int64, the error record (``lowlat.kernels.peer_allreduce``), local to this rank; tag_state:
            [TAG_STATE_SIZE] int32, the device tag (the last tag used, a launch's ticket), local to this rank.
        data_ptrs, flag_ptrs: int64 [world] on ``device``: every rank's ``data`` / ``flags`` base address.
        timer, deadline: TIMER_NS (CUDA) or TIMER_POLLS, and the wait's bound in that unit.
        max_programs: the one-launch mode's grid bound (the SM count on CUDA).
        closed: True after ``close``; the launchers then refuse these buffers.
    """

    def __init__(self, *, rank: int, world: int, capacity: int, dtype: torch.dtype, block: int,
                 data: torch.Tensor, flags: torch.Tensor, ctl: torch.Tensor, tag_state: torch.Tensor,
                 data_ptrs: torch.Tensor, flag_ptrs: torch.Tensor, deadline: int | None = None,
                 timer: int | None = None, keep: object = None) -> None:
        _check_sizes(world, capacity, dtype, block)
        if not 0 <= rank < world:
            raise ValueError(f"rank must be in [0, {world}), got {rank}")
        device = data.device
        timer, deadline = _timer_and_deadline(device, timer, deadline)
        tiles = triton.cdiv(capacity, block)
        want = {"data": (data, (2, world, capacity), dtype), "flags": (flags, (2, tiles, world), torch.int32),
                "ctl": (ctl, (CTL_SIZE,), torch.int64), "tag_state": (tag_state, (TAG_STATE_SIZE,), torch.int32),
                "data_ptrs": (data_ptrs, (world,), torch.int64),
                "flag_ptrs": (flag_ptrs, (world,), torch.int64)}
        for name, (t, shape, dt) in want.items():
            if tuple(t.shape) != shape or t.dtype != dt or t.device != device or not t.is_contiguous():
                raise ValueError(f"{name} must be a contiguous {dt} {shape} on {device}, got {t.dtype} "
                                 f"{tuple(t.shape)} on {t.device}")
        self.rank, self.world, self.capacity, self.dtype, self.block = rank, world, capacity, dtype, block
        self.device = device
        self.data, self.flags, self.ctl, self.data_ptrs, self.flag_ptrs = data, flags, ctl, data_ptrs, flag_ptrs
        self.tag_state = tag_state
        self.closed = False
        self._keep = keep  # what keeps the peers' buffers mapped (``rendezvous``); released by ``close``
        self.timer, self.deadline = timer, deadline
        self.max_programs = (torch.cuda.get_device_properties(device).multi_processor_count
                             if device.type == "cuda" else tiles)

    @classmethod
    def simulated(cls, world: int, capacity: int, dtype: torch.dtype, *, device: torch.device | str = "cpu",
                  block: int = DEFAULT_BLOCK, deadline: int | None = None, timer: int | None = None,
                  alloc: Alloc | None = None) -> list[PeerBuffers]:
        """``world`` simulated ranks in this process: each its own buffers, all of them in one shared table.

        Args:
            world: 2 .. 8 ranks. capacity: elements per rank (> 0). dtype: bf16, fp16 or fp32.
            block: elements per tile, a power of two. deadline, timer: see the class (defaults by device).
            alloc: ``alloc(name, shape, dtype) -> tensor`` (contiguous, on ``device``; flags are zeroed); called once
                per buffer and rank (names ``peer_data.<rank>`` etc.), e.g. an accounted workspace allocator.
        Returns:
            the ``PeerBuffers`` of ranks 0 .. world - 1.
        Raises:
            ValueError: a size, dtype or block out of range, or an allocator returning the wrong tensor.
        """
        device = torch.device(device)
        _check_sizes(world, capacity, dtype, block)
        alloc = alloc or _zeros(device)
        tiles = triton.cdiv(capacity, block)
        data = [alloc(f"peer_data.{r}", (2, world, capacity), dtype) for r in range(world)]
        flags = [alloc(f"peer_flags.{r}", (2, tiles, world), torch.int32) for r in range(world)]
        ctls = [alloc(f"peer_ctl.{r}", (CTL_SIZE,), torch.int64) for r in range(world)]
        tags = [alloc(f"peer_tag.{r}", (TAG_STATE_SIZE,), torch.int32) for r in range(world)]
        for t in flags + ctls + tags:  # the protocol starts from zero flags, tags and record, whatever alloc returned
            t.zero_()
        data_ptrs = torch.tensor([d.data_ptr() for d in data], dtype=torch.int64, device=device)
        flag_ptrs = torch.tensor([f.data_ptr() for f in flags], dtype=torch.int64, device=device)
        return [cls(rank=r, world=world, capacity=capacity, dtype=dtype, block=block, data=data[r], flags=flags[r],
                    ctl=ctls[r], tag_state=tags[r], data_ptrs=data_ptrs, flag_ptrs=flag_ptrs, deadline=deadline,
                    timer=timer) for r in range(world)]

    @classmethod
    def rendezvous(cls, tp: TPInfo, capacity: int, dtype: torch.dtype, *, device: torch.device | str,
                   alloc: Alloc | None = None, block: int = DEFAULT_BLOCK, deadline: int | None = None,
                   timer: int | None = None) -> PeerBuffers:
        """This process's rank of a TP group: its buffers, shared with the group, and every rank's mapped here.

        A collective: every rank of ``tp`` calls it with the same capacity, dtype, block and device type
        (``lowlat.runtime.peer_exchange`` has the steps and the handles).

        Args:
            tp: this rank's TPInfo (rank, size 2..8, group); torch.distributed initialized, every rank on one host.
            capacity: elements per rank (> 0). dtype: bf16, fp16 or fp32. device: this rank's device (CPU, or its
                CUDA device).
            alloc: ``alloc(name, shape, dtype) -> tensor`` on ``device`` (names ``peer_data``, ``peer_flags``,
                ``peer_ctl``, ``peer_tag``), e.g. the accounted workspace allocator; on CPU ``data`` and ``flags``
                then move into shared memory of the same size (their bytes copied, as ``share_memory_`` does).
            block, deadline, timer: as ``simulated``.
        Returns:
            this rank's ``PeerBuffers``; it keeps the peers' buffers mapped until ``close``.
        Raises:
            ValueError: sizes out of range, a bad group, or ranks asking for different buffers (the field named).
            PeerExchangeError: a rank could not share or map, died or never arrived within the group's timeout.
        """
        device = torch.device(device)
        _check_sizes(tp.size, capacity, dtype, block)
        timer, deadline = _timer_and_deadline(device, timer, deadline)  # before the exchange: no rank fails alone
        alloc = alloc or _zeros(device)
        tiles = triton.cdiv(capacity, block)
        shapes = {"data": ((2, tp.size, capacity), dtype), "flags": ((2, tiles, tp.size), torch.int32)}
        own: dict[str, torch.Tensor] | str
        try:
            own = {name: alloc(f"peer_{name}", shape, dt) for name, (shape, dt) in shapes.items()}
            ctl = alloc("peer_ctl", (CTL_SIZE,), torch.int64)
            tag_state = alloc("peer_tag", (TAG_STATE_SIZE,), torch.int32)
            for t in (own["flags"], ctl, tag_state):  # the protocol starts from zero, whatever alloc returned
                t.zero_()
        except Exception as e:  # told to the other ranks in the exchange, so that every rank fails now
            own = f"could not allocate its buffers ({type(e).__name__}: {e})"
        meta = {"world": tp.size, "capacity": capacity, "dtype": str(dtype), "block": block}
        mapped, keep = exchange(tp, shapes, own, meta)
        try:
            ptrs = {name: torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device=device)
                    for name, ts in mapped.items()}
            bufs = cls(rank=tp.rank, world=tp.size, capacity=capacity, dtype=dtype, block=block,
                       data=mapped["data"][tp.rank], flags=mapped["flags"][tp.rank], ctl=ctl, tag_state=tag_state,
                       data_ptrs=ptrs["data"], flag_ptrs=ptrs["flags"], deadline=deadline, timer=timer, keep=keep)
            if device.type == "cuda":
                bufs.warm()
            return bufs
        except BaseException:
            keep.close()
            raise

    def warm(self) -> None:
        """Compile the one-launch kernel for these buffers' shapes on this rank alone, with simulated peers of a
        small capacity on this device (same specialization), so that a rank's first cross-rank call does not
        spend its peers' deadline compiling. ``rendezvous`` calls it on CUDA. Leaves these buffers untouched.

        Raises:
            PeerWaitTimeout: the simulated call failed (never expected: every simulated peer pushed first).
        """
        cap = self.block + (self.capacity % 16 != 0)  # Triton specializes ints by divisibility by 16 only
        sim = PeerBuffers.simulated(self.world, cap, self.dtype, device=self.device, block=self.block,
                                    deadline=self.deadline, timer=self.timer)
        x = torch.zeros(self.block, dtype=self.dtype, device=self.device)
        for b in sim[1:]:
            peer_push(x, b)
        peer_all_reduce(x, sim[0], check=True)

    @property
    def nbytes(self) -> int:
        """Bytes of this rank's buffers (data, flags, error record, device tag; the tables are counted too)."""
        ts = (self.data, self.flags, self.ctl, self.tag_state, self.data_ptrs, self.flag_ptrs)
        return sum(t.numel() * t.element_size() for t in ts)

    @property
    def last_tag(self) -> int:
        """The device tag's last value (0 before the first call; a host sync: for tests and reports)."""
        return int(self.tag_state[0])

    def fits(self, x: torch.Tensor) -> bool:
        """True when ``x`` can go through the peer all-reduce (dtype, device, contiguity, size); else use NCCL."""
        return (x.dtype == self.dtype and x.device == self.device and x.is_contiguous()
                and x.numel() <= self.capacity)

    def check(self) -> None:
        """Read the error record (one small device-to-host copy: a sync; call it where the engine already reads
        back) and raise when a wait gave up.

        Raises:
            PeerWaitTimeout: naming this rank, the awaited peer, the stage, the tag and what to check.
        """
        self.check_record(self.ctl.tolist())

    def check_record(self, values: Sequence[int]) -> None:
        """``check`` on a host copy of ``ctl`` (e.g. copied non-blocking beside the step's sampled ids)."""
        if len(values) != CTL_SIZE:
            raise ValueError(f"an error record has {CTL_SIZE} values, got {len(values)}")
        rec = dict(zip(CTL_FIELDS, (int(v) for v in values), strict=True))
        if rec["abort"] == 0:
            return
        if rec["stage"] not in STAGE_NAMES:
            raise PeerWaitTimeout(f"peer all-reduce on rank {self.rank}: the waits were aborted from outside (abort "
                                  f"word {rec['abort']}, no wait timed out); outputs since then are undefined", rec)
        unit = "ns" if self.timer == TIMER_NS else "polls"
        who = (f"rank {rec['peer']} never published" if rec["peer"] != rec["rank"] else
               f"this rank's own push (rank {rec['peer']}) never published (a skipped push launch, or fault "
               "injection)")
        raise PeerWaitTimeout(
            f"peer all-reduce: rank {rec['rank']} timed out in stage {STAGE_NAMES[rec['stage']]!r} waiting for rank "
            f"{rec['peer']}'s push (step tag {rec['tag']}, tile {rec['tile']}, call site {rec['site']}) after "
            f"{rec['waited']} {unit} (deadline {self.deadline} {unit}): {who} its contribution. Check that rank "
            f"{rec['peer']} is alive and has not failed earlier (its log), that every rank issues the same "
            "all-reduces in the same order with the same sizes and consecutive tags, and that no rank stalled past "
            "the deadline (first-launch compilation, a host pause). Later waits on this rank are skipped until "
            "PeerBuffers.reset(); this engine is unusable: close it and create a new one", rec)

    def reset(self) -> None:
        """Clear the error record, the flags and the device tag. Only when no launch is in flight on any rank and
        every rank resets before its next call; tags then start again at 1."""
        self.ctl.zero_()
        self.flags.zero_()
        self.tag_state.zero_()

    def close(self) -> None:
        """Wait for this rank's launches on the device, then release the peers' mappings (idempotent); the
        launchers refuse closed buffers. Peers may still store into this rank's buffers: they stay mapped until
        every process has released them."""
        if self.closed:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.closed = True
        self.data_ptrs = self.flag_ptrs = torch.zeros(self.world, dtype=torch.int64, device=self.device)
        keep, self._keep = self._keep, None
        if hasattr(keep, "close"):
            keep.close()

    def __enter__(self) -> PeerBuffers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
