"""Tensor-parallel decode latency per path, and the all-reduce alone (issue 22): ``bench/scripts/tp_bench.py``.

A row is data (``TPRow``: label, plugin, EngineConfig overrides, environment overrides); ``ROWS`` are the
general path over NCCL and over the one-shot peer all-reduce, nvidia_mega with epilogue publishing (its default)
and summing through NCCL (``LOWLAT_MEGA_TP_REDUCE=nccl``), and amd_mono's in-kernel TP. ``run_tp_bench`` starts
``world`` ranks (``lowlat.bench.tp_rank``: rank r on cuda:r under NCCL, or gloo on CPU), which build each row's
ModelRunner at two depths and time DECODE steps at each batch size (CUDA-graph replays timed with CUDA events;
eager steps with ``time.perf_counter`` on CPU), ranks in lockstep (a gloo barrier before each timed run), then
time the all-reduce alone (``lowlat.bench.tp_allreduce``). Rank 0's figures make the table; every rank's median
is in the JSON.

Deadlines: every collective of a rank has ``rank_timeout_s`` (``LOWLAT_TP_TIMEOUT`` in the ranks); the parent
fails the run (``TPBenchError``) when a rank reports an error, exits, sends nothing for ``stall_s`` seconds, or
the run passes ``timeout_s``; it then terminates every rank (kill after 5 s): no process is left behind.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import queue
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lowlat.bench.tp_report import GENERAL, assemble

CPU_NOTE = ("CPU figures: eager steps on a CPU under the Triton interpreter, timed with perf_counter; they check the "
            "tool only and mean nothing about speed (GPU figures: CUDA-graph replays timed with CUDA events)")


@dataclass(frozen=True)
class TPRow:
    """One row: ``plugin`` ("none" = the general path) built with ``engine`` EngineConfig overrides while ``env``
    is set in every rank (restored after the row)."""

    label: str
    plugin: str
    engine: tuple[tuple[str, Any], ...] = ()
    env: tuple[tuple[str, str], ...] = ()

    @property
    def as_dict(self) -> dict[str, Any]:
        return {"label": self.label, "plugin": self.plugin, "engine": dict(self.engine), "env": dict(self.env)}


ROWS = (
    TPRow(GENERAL, "none", (("all_reduce", "nccl"),)),
    TPRow("general-peer", "none", (("all_reduce", "peer"),)),
    TPRow("nvidia_mega", "nvidia_mega"),
    TPRow("nvidia_mega-nccl", "nvidia_mega", env=(("LOWLAT_MEGA_TP_REDUCE", "nccl"),)),
    TPRow("amd_mono", "amd_mono"),
)
"""The rows of issue 22, in run order; ``select_rows`` picks them by label (an unknown label is a plugin name)."""


def select_rows(labels: list[str]) -> tuple[TPRow, ...]:
    """The ``ROWS`` named by ``labels``, in the given order; a label not in ``ROWS`` is a row of that plugin with
    no overrides (a missing plugin is then a skipped row). Raises ValueError on an empty list."""
    if not labels:
        raise ValueError("--paths is empty; name rows such as general,general-peer,nvidia_mega")
    known = {r.label: r for r in ROWS}
    return tuple(known.get(name) or TPRow(name, name) for name in dict.fromkeys(labels))


@dataclass(frozen=True)
class TPBenchConfig:
    """One run. Times: ``warmup`` untimed then 2 x ``iters`` timed steps per shape; ``ar_iters`` timed samples of
    ``ar_calls`` all-reduces per size on CUDA (one eager call per sample on CPU). ``context``: cached tokens per
    request. ``layer_depth``: the second decoder-layer count for per-layer µs (slope between the depths).
    ``rank_timeout_s``: each collective's timeout in the ranks (s); ``stall_s``: longest silence of the ranks the
    parent accepts (s); ``timeout_s``: the whole run (s). ``fault``: tests only ("die:R", "hang:R")."""

    model: str
    device: str
    rows: tuple[TPRow, ...] = ROWS
    world: int = 2
    batch_sizes: tuple[int, ...] = (1, 8)
    context: int = 1024
    warmup: int = 10
    iters: int = 100
    input_sets: int = 2
    layer_depth: int | None = 4
    dtype: str = "bfloat16"
    seed: int = 0
    all_reduce: bool = True
    ar_kib: tuple[int, ...] = (4, 16, 64)
    ar_calls: int = 20
    ar_warmup: int = 5
    ar_iters: int = 50
    rank_timeout_s: float = 120.0
    stall_s: float = 600.0
    timeout_s: float = 3600.0
    fault: str | None = None
    full_depth: int = 0  # filled by run_tp_bench from the model
    depths: tuple[int, ...] = field(default=())

    def bench_config(self) -> Any:
        """The ``lowlat bench`` BenchConfig whose input sets and EngineConfig the ranks reuse (DECODE only)."""
        from lowlat.bench.config import BenchConfig
        from lowlat.forward_batch import ForwardMode

        return BenchConfig(models=(self.model,), paths=(GENERAL,), batch_sizes=self.batch_sizes,
                           modes=(ForwardMode.DECODE,), context=self.context, input_sets=self.input_sets,
                           warmup=self.warmup, iters=self.iters, device=self.device, dtype=self.dtype,
                           seed=self.seed, layer_depth=self.layer_depth)

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["rows"] = [r.as_dict for r in self.rows]
        return d


class TPBenchError(RuntimeError):
    """The run failed as a whole: a rank errored, died, stalled, or the run passed its deadline."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def check_setup(cfg: TPBenchConfig) -> None:
    """Raise ValueError before any rank starts: bad sizes, too few GPUs, plugins on CPU without the interpreter."""
    if cfg.world < 2:
        raise ValueError(f"--tp must be at least 2, got {cfg.world}")
    if cfg.device == "cuda" and torch.cuda.device_count() < cfg.world:
        raise ValueError(f"--tp {cfg.world} needs {cfg.world} GPUs on this host, torch sees {torch.cuda.device_count()}"
                         " (run on a machine of 2 GPUs, or --device cpu to check the tool)")
    if cfg.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("on a CPU the peer all-reduce and the plugins need TRITON_INTERPRET=1 in the environment")
    if min(cfg.batch_sizes) < 1 or cfg.iters < 1 or cfg.ar_iters < 1 or cfg.ar_calls < 1:
        raise ValueError("batch sizes, --iters, --ar-iters and --ar-calls must be >= 1")


def run_ranks(cfg: TPBenchConfig, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Start the ranks and collect their reports: per rank ``{"rows": [...], "all_reduce": dict | None}``.

    Raises:
        TPBenchError: a rank errored (its traceback), exited, sent nothing for ``stall_s`` s, or the run passed
            ``timeout_s`` s. Every rank process is gone when this returns or raises.
    """
    from lowlat.bench.tp_rank import rank_main
    from lowlat.runtime.tp_launch import set_multicast_off

    set_multicast_off()
    # fork on CPU (fast to start, torch already imported; as tp_check does); spawn with CUDA (no fork after init)
    forkable = cfg.device == "cpu" and not torch.cuda.is_initialized() and "fork" in mp.get_all_start_methods()
    ctx = mp.get_context("fork" if forkable else "spawn")
    results = ctx.Queue()
    init = f"tcp://127.0.0.1:{_free_port()}"
    procs = [ctx.Process(target=rank_main, args=(r, init, cfg, results), name=f"tp-bench-rank{r}", daemon=True)
             for r in range(cfg.world)]
    reports: list[dict[str, Any]] = [{"rows": [], "all_reduce": None, "done": False, "said": "nothing"}
                                     for _ in procs]
    start = last = time.monotonic()

    def dead() -> list[str]:
        return [f"rank {i} exited (exit code {p.exitcode}) before finishing" for i, p in enumerate(procs)
                if p.pid is not None and not p.is_alive() and not reports[i]["done"]]

    def where() -> str:
        return "; ".join(f"rank {i} last said: {r['said']}" for i, r in enumerate(reports))

    try:
        for p in procs:
            p.start()
        while not all(r["done"] for r in reports):
            now = time.monotonic()
            late = [str(i) for i, r in enumerate(reports) if not r["done"]]
            if now - start > cfg.timeout_s:
                raise TPBenchError(f"rank(s) {', '.join(late)} did not finish within the run's {cfg.timeout_s:.0f} s "
                                   f"({where()})")
            if now - last > cfg.stall_s:
                raise TPBenchError(f"rank(s) {', '.join(late)} sent nothing for {cfg.stall_s:.0f} s: a hung rank "
                                   f"({where()}; --stall-s sets this deadline)")
            try:
                rank, kind, payload = results.get(timeout=0.5)
            except queue.Empty:
                if dead():
                    raise TPBenchError("; ".join(dead()) + f" ({where()})") from None
                continue
            last = time.monotonic()
            if kind == "error":
                time.sleep(1.0)  # a peer that died and caused this error: name it first
                others = [d for d in dead() if not d.startswith(f"rank {rank} ")]
                raise TPBenchError("".join(f"{d}\n" for d in others) + f"rank {rank} failed:\n{payload}")
            if kind == "done":
                reports[rank]["done"] = True
            elif kind == "row":
                reports[rank]["rows"].append(payload)
            elif kind == "all_reduce":
                reports[rank]["all_reduce"] = payload
            else:
                reports[rank]["said"] = repr(payload)
                if rank == 0:
                    log(f"[tp-bench] rank 0: {payload} ({time.monotonic() - start:.0f} s)")
    finally:
        for p in procs:
            if p.pid is not None:
                p.join(timeout=5 if all(r["done"] for r in reports) else 0.1)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        results.close()
    return reports


def run_tp_bench(cfg: TPBenchConfig, *, command: list[str] | None = None,
                 log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the benchmark; returns the results (what the JSON holds). Writes nothing (``tp_report.write``).

    Raises:
        ValueError: a bad configuration (``check_setup``); TPBenchError: the run failed (``run_ranks``).
    """
    from lowlat.bench.env import environment
    from lowlat.loader import resolve_model

    check_setup(cfg)
    full = resolve_model(cfg.model).num_hidden_layers
    second = min(cfg.layer_depth or full, full)
    cfg = dataclasses.replace(cfg, full_depth=full, depths=(full,) if second >= full else (full, second))
    meta = environment(torch.device("cuda", 0) if cfg.device == "cuda" else torch.device("cpu"), command)
    meta["gpus"] = cfg.world if cfg.device == "cuda" else 0
    if cfg.device == "cpu":
        meta["note"] = CPU_NOTE
        log(f"[tp-bench] {CPU_NOTE}")
    t0 = time.perf_counter()
    reports = run_ranks(cfg, log)
    meta["wall_s"] = round(time.perf_counter() - t0, 1)
    return assemble(cfg, meta, reports)
