"""Starting tensor-parallel ranks: under torchrun, or as spawned worker processes of the engine.

Two launch modes, both SPMD (every rank builds its shard of the model and runs the same schedule):

* **torchrun** (``RANK``/``WORLD_SIZE`` set): every process runs the user's program, which creates an Engine on
  each rank; ``init_process_group`` uses ``env://``. All ranks return the same results.
* **spawned** (otherwise): rank 0 (the process that created the Engine) spawns ``tp_size - 1`` workers with
  ``torch.multiprocessing``'s spawn context. Each worker builds an Engine of its own and then executes, in
  order, the engine calls rank 0 mirrors to it over a per-worker command queue (``WorkerGroup.send``).
  As with any spawn-based multiprocessing, a script that creates such an engine at import time must guard
  it with ``if __name__ == "__main__":``.

The default process group is ``gloo`` on CPU and ``cpu:gloo,cuda:nccl`` on CUDA, so host-side agreement
(the KV pool size) runs over gloo and model collectives over NCCL. Every collective has the group's timeout
(``LOWLAT_TP_TIMEOUT`` seconds, default 300). Workers report errors (with their traceback) on a result
queue and exit; rank 0 checks the queue and the workers' liveness while it waits, so a failed worker
surfaces as ``WorkerError`` on rank 0 rather than a hang. NVLink multicast stays off in every process:
``NCCL_NVLS_ENABLE=0`` and ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` (multicast is not allowed on the multi-GPU
machines we test on).
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lowlat.config import EngineConfig, ModelConfig
from lowlat.distributed import TPInfo, kv_heads_per_rank

MULTICAST_OFF_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
POLL_S = 0.05


class WorkerError(RuntimeError):
    """A tensor-parallel worker failed or stopped answering; the message carries its traceback."""


def check_tp(model: ModelConfig, tp_size: int) -> None:
    """Raise ValueError when ``tp_size`` cannot shard ``model``'s attention heads (checked before any rank starts)."""
    if model.num_attention_heads % tp_size:
        raise ValueError(f"tp_size={tp_size} does not divide num_attention_heads={model.num_attention_heads}; "
                         "pick a tp_size that does")
    kv_heads_per_rank(model.num_key_value_heads, tp_size)


def tp_timeout_s() -> float:
    """Seconds a collective or a worker may take before it counts as failed (``LOWLAT_TP_TIMEOUT``, 300)."""
    return float(os.environ.get("LOWLAT_TP_TIMEOUT", "300"))


def set_multicast_off() -> None:
    """Force NVLink multicast off in this process's environment (inherited by processes it starts)."""
    os.environ.update(MULTICAST_OFF_ENV)


def under_torchrun() -> bool:
    """Whether this process was started by torchrun (or another launcher setting RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


@dataclass
class TPContext:
    """One rank's distributed state: its TPInfo, device, host-side group, and whether it owns the group.

    ``progress`` (spawned mode): shared per-rank counters of finished steps, so a missed step deadline names
    the ranks that did not finish (``lowlat.runtime.step_guard.laggards``).
    """

    tp: TPInfo
    device: torch.device
    cpu_group: Any
    owns_group: bool
    progress: Any = None
    keep: Any = None

    def close(self, *, abort: bool = False) -> None:
        """Destroy the process group if this process created it (abort it when a peer has failed)."""
        try:
            self._close(abort)
        finally:
            self.keep = None  # the rendezvous store (it closes its listening socket)

    def _close(self, abort: bool) -> None:
        if not (self.owns_group and dist.is_initialized()):
            return
        aborter = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if abort and aborter is not None:
            try:
                aborter()
                return
            except Exception:  # fall back to an orderly destroy
                pass
        dist.destroy_process_group()


def _device_for(config: EngineConfig, local_rank: int, world_size: int) -> torch.device:
    if config.resolved_device != "cuda":
        return torch.device("cpu")
    n = torch.cuda.device_count()
    if n < world_size:
        raise ValueError(f"tp_size={world_size} needs {world_size} GPUs on this host but torch sees {n}; "
                         "lower --tp or run under torchrun across hosts")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def init_rank(config: EngineConfig, rank: int, world_size: int, *, local_rank: int, init_method: str,
              store: Any = None) -> TPContext:
    """Join (or reuse) the default process group as ``rank`` of ``world_size`` (through ``store`` when given).

    Raises:
        ValueError: a reused group's size differs from ``config.tp_size``, or too few GPUs.
    """
    set_multicast_off()
    device = _device_for(config, local_rank, world_size)
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise ValueError(f"torch.distributed is initialized with world size {dist.get_world_size()} "
                             f"but tp_size={world_size}")
        return TPContext(TPInfo(dist.get_rank(), world_size, None), device, None, owns_group=False)
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=tp_timeout_s())
    if store is not None:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    else:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout)
    return TPContext(TPInfo(rank, world_size, None), device, None, owns_group=True)


def init_from_torchrun(config: EngineConfig) -> TPContext:
    """The TPContext of a process started by torchrun. Raises ValueError when WORLD_SIZE != tp_size."""
    world = int(os.environ["WORLD_SIZE"])
    if world != config.tp_size:
        raise ValueError(f"torchrun started {world} processes but tp_size={config.tp_size}; make them equal")
    return init_rank(config, int(os.environ["RANK"]), world, local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                     init_method="env://")


def _loopback_listener() -> socket.socket:
    """A TCP socket listening on 127.0.0.1 (a free port): the rendezvous store of spawned mode.

    TCPStore binds every interface when it opens its own socket; handing it this one keeps the store on
    loopback (and leaves no window in which another process could take the port).
    """
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(128)
    return s


class WorkerGroup:
    """Ranks 1..tp_size-1 as spawned processes, driven by rank 0.

    Use ``start_spawned(config, engine_cls)``, which also makes rank 0's TPContext. Each worker builds
    ``engine_cls(config, _tp_context=ctx)`` (the Engine class is passed in, so this module never imports the
    engine that imports it).
    """

    def __init__(self, config: EngineConfig, init_method: str, engine_cls: type) -> None:
        ctx = torch.multiprocessing.get_context("spawn")
        self.world_size = config.tp_size
        self.results = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(1, config.tp_size)]
        self.progress = ctx.Array("q", config.tp_size, lock=False)  # finished steps per rank
        self.procs = [
            ctx.Process(target=_worker_main, args=(engine_cls, config, r, config.tp_size, init_method, q,
                                                   self.results, torch.get_num_threads(), self.progress),
                        name=f"lowlat-tp{r}", daemon=True)
            for r, q in zip(range(1, config.tp_size), self.commands)
        ]
        self._seq = 0
        self._errors: list[str] = []
        self._acks: dict[int, set[int]] = {}
        self._stage: dict[int, str] = {}
        self._closed = False

    def start(self) -> None:
        set_multicast_off()
        for p in self.procs:
            p.start()

    def wait_stage(self, stage: str, timeout: float) -> None:
        """Wait until every worker reported ``stage`` ("joining" or "ready"). Raises WorkerError otherwise."""
        deadline = time.monotonic() + timeout
        while any(self._stage.get(r) != stage for r in range(1, self.world_size)):
            self._drain(block_s=POLL_S)
            self.check()
            if time.monotonic() > deadline:
                late = [str(r) for r in range(1, self.world_size) if self._stage.get(r) != stage]
                raise WorkerError(f"TP worker rank(s) {', '.join(late)} did not reach '{stage}' within {timeout:.0f} s "
                                  f"(the start-up deadline, LOWLAT_TP_TIMEOUT seconds; raise it for slow loads)")

    def send(self, method: str, args: tuple, kwargs: dict, *, ack: bool) -> int:
        """Ask every worker to call ``engine.method(*args, **kwargs)``; returns the call's sequence number."""
        self.check()
        self._seq += 1
        for q in self.commands:
            q.put(("call", self._seq, method, args, kwargs, ack))
        return self._seq

    def wait_ack(self, seq: int, timeout: float) -> None:
        """Wait until every worker acknowledged call ``seq``. Raises WorkerError on failure or timeout."""
        deadline = time.monotonic() + timeout
        while len(self._acks.get(seq, ())) < self.world_size - 1:
            self._drain(block_s=POLL_S)
            self.check()
            if time.monotonic() > deadline:
                late = [str(r) for r in range(1, self.world_size) if r not in self._acks.get(seq, ())]
                raise WorkerError(f"TP worker rank(s) {', '.join(late)} did not finish call {seq} within "
                                  f"{timeout:.0f} s (LOWLAT_TP_TIMEOUT seconds)")
        self._acks.pop(seq, None)

    def check(self) -> None:
        """Raise WorkerError if a worker reported an error or died (non-blocking)."""
        self._drain(block_s=0.0)
        if self._errors:
            raise WorkerError("tensor-parallel worker failed:\n" + "\n".join(self._errors))
        dead = [p for p in self.procs if not p.is_alive()]
        if dead:
            self._drain(block_s=0.5)  # a worker that failed may have queued its traceback just before exiting
            if self._errors:
                raise WorkerError("tensor-parallel worker failed:\n" + "\n".join(self._errors))
            codes = ", ".join(f"{p.name} exit code {p.exitcode}" for p in dead)
            raise WorkerError(f"tensor-parallel worker exited unexpectedly ({codes})")

    def close(self, timeout: float = 10.0) -> None:
        """Stop the workers: ask them to exit, join with a timeout, then terminate and kill stragglers (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for q in self.commands:
            try:
                q.put(("stop",))
            except (ValueError, OSError):  # queue already closed
                pass
        deadline = time.monotonic() + timeout
        for p in self.procs:
            if p.pid is not None:
                p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.pid is not None and p.is_alive():
                p.terminate()
                p.join(2.0)
                if p.is_alive():
                    p.kill()
                    p.join(2.0)
        for q in [*self.commands, self.results]:
            q.close()
            q.join_thread()

    def _drain(self, block_s: float) -> None:
        try:
            msg = self.results.get(timeout=block_s) if block_s > 0 else self.results.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, rank = msg[0], msg[1]
            if kind == "error":
                self._errors.append(f"[rank {rank}] {msg[2]}")
            elif kind == "ack":
                self._acks.setdefault(msg[2], set()).add(rank)
            else:
                self._stage[rank] = kind
            try:
                msg = self.results.get_nowait()
            except queue.Empty:
                return


def start_spawned(config: EngineConfig, engine_cls: type) -> tuple[TPContext, WorkerGroup]:
    """Spawn the workers (each runs an ``engine_cls``) and join the process group as rank 0.

    Raises:
        WorkerError: a worker failed before joining; ValueError: too few GPUs.
    """
    set_multicast_off()
    if config.resolved_device == "cuda":
        _device_for(config, 0, config.tp_size)  # fail before spawning when GPUs are missing
    listener = _loopback_listener()
    port = listener.getsockname()[1]
    init_method = f"tcp://127.0.0.1:{port}"
    workers = WorkerGroup(config, init_method, engine_cls)
    try:
        store = dist.TCPStore("127.0.0.1", port, config.tp_size, True, datetime.timedelta(seconds=tp_timeout_s()),
                              wait_for_workers=False, master_listen_fd=listener.detach())  # the store owns the fd
        workers.start()
        workers.wait_stage("joining", tp_timeout_s())
        ctx = init_rank(config, 0, config.tp_size, local_rank=0, init_method=init_method, store=store)
        ctx.progress = workers.progress
        ctx.keep = store  # it serves the group for its lifetime
    except BaseException:
        workers.close(timeout=2.0)
        listener.close()  # a no-op once detached
        raise
    return ctx, workers


def _worker_main(engine_cls: type, config: EngineConfig, rank: int, world_size: int, init_method: str,
                 commands: Any, results: Any, num_threads: int, progress: Any = None) -> None:
    """A spawned worker: join the group, build ``engine_cls``, then run rank 0's mirrored calls until told to stop.

    It uses as many intra-op CPU threads as rank 0 (``num_threads``).
    """
    import multiprocessing

    set_multicast_off()
    torch.set_num_threads(num_threads)
    engine = None
    ctx = None
    try:
        results.put(("joining", rank))
        host, port = init_method.removeprefix("tcp://").rsplit(":", 1)
        store = dist.TCPStore(host, int(port), world_size, False, datetime.timedelta(seconds=tp_timeout_s()))
        ctx = init_rank(config, rank, world_size, local_rank=rank, init_method=init_method, store=store)
        ctx.progress = progress
        engine = engine_cls(config, _tp_context=ctx)
        results.put(("ready", rank))
        parent = multiprocessing.parent_process()
        while True:
            try:
                msg = commands.get(timeout=1.0)
            except queue.Empty:
                if parent is not None and not parent.is_alive():
                    return
                continue
            if msg[0] == "stop":
                return
            _, seq, method, args, kwargs, ack = msg
            getattr(engine, method)(*args, **kwargs)
            if ack:
                results.put(("ack", rank, seq))
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))
        if ctx is not None:
            ctx.close(abort=True)
            ctx = None
        raise SystemExit(1) from None
    finally:
        if engine is not None:
            engine.close()
        if ctx is not None:
            ctx.close()
