"""Mapping every rank's peer buffers into this process: the handles ranks exchange and how a peer's are opened.

``PeerBuffers.rendezvous`` (every rank of a TP group calls it) uses this module in three collective steps over the
group (``torch.distributed.all_gather_object``: gloo on CPU groups, and on ``cpu:gloo,cuda:nccl`` groups too, as
the object travels through host memory):

1. **share**: each rank moves its ``data`` and ``flags`` where other processes can map them and sends their
   handles, with its sizes and host, or the error that stopped it (so every rank fails together, not by timeout);
2. **open**: each rank checks that every rank asked for the same buffers (world, capacity, dtype, block, device
   type, host) and maps the peers' buffers; it sends whether that worked;
3. the files that named the CPU buffers are unlinked once every rank has mapped them (nothing is left in
   ``/dev/shm`` after the exchange, whatever happens to the processes later).

Handles:

* CPU: a file in ``/dev/shm`` (tmpfs; tempfile's directory where there is none), created and mapped ``MAP_SHARED``
  by ``torch.from_file(path, shared=True)``; peers map the same path. Rejected: torch's file_system sharing
  (``UntypedStorage._share_filename_cpu_``) starts a ``torch_shm_manager`` child that lives as long as the
  process (the test suite refuses leftover children); ``multiprocessing.shared_memory`` registers every
  attachment with the resource tracker on Python < 3.13, which then unlinks peers' segments at exit (and spawned
  ranks share one tracker).
* CUDA: CUDA IPC through torch's own tensor sharing: ``torch.multiprocessing.reductions.reduce_tensor`` gives a
  rebuild function and its picklable arguments (the caching allocator block's IPC handle, its offset, a shared
  reference count and an event); calling it in a peer opens the handle on the owner's device
  (``cudaIpcOpenMemHandle`` with lazy peer access: a GPU maps another GPU's memory; two processes of one GPU
  share it). Torch keeps the owner's block alive until every peer has released its mapping. No multicast object
  is ever created and symmetric memory is not used (NVLink multicast is forbidden on the machines we run on).

Deadline: every step is a collective of the TP group, bounded by the group's timeout (``init_process_group(...,
timeout=)``; the engine sets ``LOWLAT_TP_TIMEOUT``); a rank that died makes gloo fail at once, a rank that never
arrives at the group's timeout. Either way every rank raises ``PeerExchangeError`` naming itself and the step.
"""

from __future__ import annotations

import os
import secrets
import socket
import tempfile
from typing import Any

import torch
import torch.distributed as dist

from lowlat.distributed import TPInfo

__all__ = ["PeerExchangeError", "PeerMappings", "exchange"]

SHM_DIR = "/dev/shm"


class PeerExchangeError(RuntimeError):
    """Ranks could not exchange or map their peer buffers (a rank died, never arrived, or could not map)."""


class PeerMappings:
    """What keeps every rank's buffers mapped in this process: this rank's shared tensors and the peers' mapped
    ones (CPU: file mappings; CUDA: IPC mappings). ``close`` releases them (idempotent)."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.files: list[str] = []  # this rank's files not unlinked yet (only until the exchange ends)

    def unlink(self) -> None:
        for path in self.files:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self.files.clear()

    def close(self) -> None:
        self.unlink()
        self.tensors.clear()


def _shm_dir() -> str:
    return SHM_DIR if os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK) else tempfile.gettempdir()


def _share(t: torch.Tensor, name: str, keep: PeerMappings) -> tuple[torch.Tensor, tuple]:
    """This rank's tensor as peers can map it, and its handle. CPU: moved into a new shared file (the bytes are
    copied, as ``Tensor.share_memory_`` does); CUDA: the tensor itself, shared through CUDA IPC."""
    if t.device.type == "cuda":
        from torch.multiprocessing.reductions import reduce_tensor

        rebuild, args = reduce_tensor(t)
        keep.tensors.append(t)
        return t, ("cuda", rebuild, args)
    path = os.path.join(_shm_dir(), f"lowlat-peer-{os.getpid()}-{secrets.token_hex(8)}-{name}")
    keep.files.append(path)  # unlinked at the end of the exchange, or at once if it fails
    shared = torch.from_file(path, shared=True, size=t.numel(), dtype=t.dtype).view(t.shape)
    shared.copy_(t)
    keep.tensors.append(shared)
    return shared, ("file", path, t.numel() * t.element_size())


def _open(handle: tuple, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Map a peer's buffer from its handle (``_share``) into this process."""
    if handle[0] == "cuda":
        _, rebuild, args = handle
        t = rebuild(*args)
    else:
        _, path, nbytes = handle
        size = os.stat(path).st_size  # FileNotFoundError: from_file would create an empty one instead
        if size != nbytes:
            raise ValueError(f"{path} holds {size} bytes, expected {nbytes}")
        t = torch.from_file(path, shared=True, size=nbytes // dtype.itemsize, dtype=dtype)
    if tuple(t.shape) != shape and t.numel() == torch.Size(shape).numel():
        t = t.view(shape)
    if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
        raise ValueError(f"a peer's buffer is {t.dtype} {tuple(t.shape)}, expected a contiguous {dtype} {shape}")
    return t


def _gather(obj: Any, tp: TPInfo, step: str) -> list[Any]:
    out: list[Any] = [None] * tp.size
    try:
        dist.all_gather_object(out, obj, group=tp.group)
    except Exception as e:  # gloo: a closed connection, a timeout; anything else the backend raises
        raise PeerExchangeError(
            f"peer buffers: rank {tp.rank} of {tp.size} failed in step {step!r} of the exchange ({type(e).__name__}: "
            f"{e}). Another rank died, failed earlier or never called PeerBuffers.rendezvous (the wait is bounded "
            "by the process group's timeout, LOWLAT_TP_TIMEOUT in the engine): check the other ranks' logs") from e
    return out


def _check_group(tp: TPInfo) -> None:
    if tp.size < 2:
        raise ValueError(f"peer buffers need a TP group of 2 to 8 ranks, got size {tp.size}")
    if not dist.is_initialized():
        raise ValueError("peer buffers exchange handles through torch.distributed, which is not initialized: call "
                         "init_process_group (gloo on CPU, cpu:gloo,cuda:nccl on CUDA) in every rank first")
    size, rank = dist.get_world_size(tp.group), dist.get_rank(tp.group)
    if (size, rank) != (tp.size, tp.rank):
        raise ValueError(f"the TPInfo says rank {tp.rank} of {tp.size} but its process group says rank {rank} of "
                         f"{size}; pass the TPInfo of this process's group")


def _failures(replies: list[Any]) -> str:
    return "; ".join(f"rank {r}: {m}" for r, m in enumerate(replies) if isinstance(m, str))


def exchange(tp: TPInfo, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]],
             own: dict[str, torch.Tensor] | str, meta: dict[str, Any]) -> tuple[dict[str, list[torch.Tensor]],
                                                                              PeerMappings]:
    """Share this rank's ``own`` buffers with the TP group and map every peer's (a collective: every rank calls it).

    Args:
        tp: this rank's TPInfo (rank, size, group); torch.distributed must be initialized.
        shapes: name -> (shape, dtype) every rank's buffer of that name has.
        own: name -> this rank's buffer (contiguous, on this rank's device), as ``shapes`` says; or the error
            that stopped this rank before (it takes part in the first step anyway, so every rank fails there).
        meta: what every rank must agree on (sizes, dtype, block: plain values), checked field by field.
    Returns:
        (name -> the W ranks' buffers as mapped in this process, in rank order: this rank's entry is its own
        shared buffer; the mappings to keep alive for as long as the table of their addresses is used).
    Raises:
        ValueError: a bad group, or ranks that asked for different buffers (naming the field and the ranks).
        PeerExchangeError: a rank failed to share or map, died or never arrived (naming them and the step).
    """
    _check_group(tp)
    keep = PeerMappings()
    try:
        shared: dict[str, torch.Tensor] = {}
        mine: dict[str, Any] = {}
        try:
            if isinstance(own, str):
                raise RuntimeError(own)
            device = next(iter(own.values())).device
            mine = {**meta, "device": device.type, "host": socket.gethostname()}
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the zeroed flags land before any peer can store into them
            handles = {}
            for name, t in own.items():
                shared[name], handles[name] = _share(t, name, keep)
            reply: Any = {**mine, "handles": handles}
        except Exception as e:
            keep.close()
            reply = str(e) if isinstance(own, str) else f"could not share its buffers ({type(e).__name__}: {e})"
        replies = _gather(reply, tp, "share")
        if failed := _failures(replies):
            raise PeerExchangeError(f"peer buffers: a rank failed before the exchange, so none maps them: {failed}")
        for key in mine:
            values = [r[key] for r in replies]
            if any(v != values[0] for v in values):
                raise ValueError(f"peer buffers: the ranks disagree on {key!r}: " + ", ".join(
                    f"rank {r}: {v!r}" for r, v in enumerate(values)) + ("; every rank of the group must be on one "
                    "host" if key == "host" else "; every rank must ask for the same buffers"))
        mapped: dict[str, list[torch.Tensor]] = {name: [] for name in own}
        try:
            for s, r in enumerate(replies):
                for name, (shape, dtype) in shapes.items():
                    t = shared[name] if s == tp.rank else _open(r["handles"][name], shape, dtype)
                    keep.tensors.append(t)
                    mapped[name].append(t)
            status: Any = None
        except Exception as e:
            status = f"could not map rank {s}'s {name!r} ({type(e).__name__}: {e})"
        statuses = _gather(status, tp, "open")
        if failed := _failures(statuses):
            raise PeerExchangeError(f"peer buffers: a rank could not map its peers' buffers: {failed}")
        keep.unlink()  # every rank has mapped every file: the names can go
        return mapped, keep
    except BaseException:
        keep.close()
        raise
