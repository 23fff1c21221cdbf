"""One rank of the tensor-parallel benchmark (``lowlat.bench.tp_bench``): rows of DECODE steps, then the all-reduce.

Each rank joins the TP group as an engine rank does (``lowlat.runtime.tp_launch.init_rank``: gloo on CPU,
``cpu:gloo,cuda:nccl`` on CUDA, NVLink multicast off) and builds ``ModelRunner(config, tp=..., cpu_group=...)``
per row and depth, as ``contract_tests/.../tp_check.py`` does. Every rank prepares the same batches
(``lowlat.bench.lowlat_path.input_sets`` / ``fill_kv_random`` with one seed) and runs the same steps; a
separate gloo group (``sync``) carries the barriers before each timed run and the agreement on each build and
shape (a row that fails on any rank is skipped on every rank, with every rank's reason).

Messages to the parent (``results`` queue): ``(rank, "row", dict)``, ``(rank, "all_reduce", dict)``,
``(rank, "progress", str)``, ``(rank, "error", traceback)``, ``(rank, "done", None)``.
"""

from __future__ import annotations

import datetime
import os
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lowlat.bench.input_sets import free_rows, input_sets
from lowlat.bench.lowlat_path import engine_config, fill_kv_random
from lowlat.bench.measure import describe_error, free_device_memory
from lowlat.bench.timing import summarize, time_steps, warm_up
from lowlat.bench.tp_allreduce import agree, barrier, measure_all_reduce
from lowlat.forward_batch import ForwardMode


def rank_main(rank: int, init: str, cfg: Any, results: Any) -> None:
    """The body of rank ``rank`` (a spawned or forked process): everything goes to ``results``, nothing raises."""
    from lowlat.runtime.tp_launch import MULTICAST_OFF_ENV

    os.environ.update({**MULTICAST_OFF_ENV, "LOWLAT_TP_TIMEOUT": str(cfg.rank_timeout_s)})
    try:
        if cfg.device == "cpu":
            torch.set_num_threads(1)
        _run(rank, init, cfg, results)
        results.put((rank, "done", None))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run(rank: int, init: str, cfg: Any, results: Any) -> None:
    from lowlat.config import EngineConfig
    from lowlat.runtime.tp_launch import init_rank

    ctx = init_rank(EngineConfig(model=cfg.model, device=cfg.device, tp_size=cfg.world), rank, cfg.world,
                    local_rank=rank, init_method=init)
    sync = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=cfg.rank_timeout_s))
    if cfg.fault == f"die:{rank}":  # tests: a rank that exits without a word
        os._exit(3)
    if cfg.fault == f"hang:{rank}":  # tests: a rank that stops answering
        time.sleep(10 * cfg.rank_timeout_s)

    def say(msg: str) -> None:
        results.put((rank, "progress", msg))

    for row in cfg.rows:
        results.put((rank, "row", measure_row(cfg, row, ctx, sync, say)))
    if cfg.all_reduce:
        say("all-reduce")

        results.put((rank, "all_reduce", measure_all_reduce(cfg, ctx, sync)))


def measure_row(cfg: Any, row: Any, ctx: Any, sync: Any, say: Callable[[str], None]) -> dict[str, Any]:
    """One row at every depth and batch size: ``{"label", "status", "reason", "depths": {L: {b: {...}}}, "info"}``.

    A shape's entry holds ``step_ms`` and ``repeat_ms`` (Stats dicts, ms per step), ``ran_on`` and ``graphed``,
    or ``error``. The row's environment overrides are set while it builds and runs, then restored. ``say(text)``
    tells the parent where the rank is (each depth), which also keeps its stall deadline from expiring.
    """
    out: dict[str, Any] = {"label": row.label, "status": "ok", "reason": None, "depths": {}, "info": {}}
    env = dict(row.env)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        reason = None  # a switch the plugin does not know fails its build (both vendors refuse unknown ones)
        for depth in cfg.depths:
            say(f"{row.label} L={depth}")
            reason, shapes = _measure_depth(cfg, row, depth, ctx, sync, out["info"])
            if reason:
                break
            out["depths"][depth] = shapes
        if reason:
            out.update(status="skipped", reason=reason, depths={})
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return out


def _measure_depth(cfg: Any, row: Any, depth: int, ctx: Any, sync: Any, info: dict[str, Any]
                   ) -> tuple[str | None, dict[int, Any]]:
    import dataclasses

    from lowlat.bench.config import Shape
    from lowlat.runtime.model_runner import ModelRunner

    bcfg = cfg.bench_config()
    ecfg = engine_config(bcfg, cfg.model, "general" if row.plugin == "none" else row.plugin,
                         None if depth == cfg.full_depth else depth)
    runner, err = None, None
    try:
        ecfg = dataclasses.replace(ecfg, tp_size=cfg.world, **dict(row.engine))
        t0 = time.perf_counter()
        runner = ModelRunner(ecfg, tp=ctx.tp, device=ctx.device, cpu_group=ctx.cpu_group, show_progress=False)
        sel = runner.plugin_host.selection
        info[str(depth)] = {"plugin": runner.plugin_host.name, "selection": sel.reason if sel else None,
                            "graphs": len(runner.graph_runner.graphs) if runner.graph_runner else 0,
                            "start_s": round(time.perf_counter() - t0, 2), "all_reduce": ecfg.all_reduce,
                            "peer_all_reduce": runner.peer is not None}
    except Exception as e:
        err = f"could not start at L={depth}: {describe_error(e)}"
    try:
        err = agree(err, sync, cfg.world)
        if err:
            return err, {}
        fill_kv_random(runner.kv_pool, cfg.seed)  # type: ignore[union-attr]
        shapes: dict[int, Any] = {}
        for k, b in enumerate(cfg.batch_sizes):
            shape = Shape(ForwardMode.DECODE, b, 1)
            rows: list[int] = []
            res: dict[str, Any] = {}
            try:
                sets = input_sets(runner, shape, bcfg, seed=cfg.seed * 1000 + k)  # the same on every rank
                rows = sets.rows
                res = time_shape(lambda i, s=sets: runner.forward(s.step(i)), runner, cfg, ctx.device, sync)
            except Exception as e:
                res = {"error": describe_error(e)}
                free_device_memory(ctx.device)
            finally:
                free_rows(runner, rows)
            bad = agree(res.get("error"), sync, cfg.world)
            shapes[b] = {"error": bad} if bad else res
        return None, shapes
    finally:
        if runner is not None:
            runner.close()
        free_device_memory(ctx.device)


def time_shape(run: Callable[[int], object], runner: Any, cfg: Any, device: torch.device, sync: Any
               ) -> dict[str, Any]:
    """Warm up, then two timed runs of ``cfg.iters`` steps, each after a barrier (ranks start together); ms."""
    run(0)
    paths = {runner.last_path}
    graphed = bool(runner.last_graphed)
    warm_up(run, cfg.warmup, device)
    barrier(device, sync)
    first = summarize(time_steps(run, cfg.iters, device))
    barrier(device, sync)
    repeat = summarize(time_steps(run, cfg.iters, device))
    paths.add(runner.last_path)
    return {"step_ms": first.as_dict(), "repeat_ms": repeat.as_dict(), "ran_on": "+".join(sorted(paths, reverse=True)),
            "graphed": graphed}
