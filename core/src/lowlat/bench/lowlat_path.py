"""Measure a lowlat path (a general variant or a plugin) at one decoder-layer count through a ModelRunner.

General variants (``lowlat.bench.config.GENERAL_VARIANTS``): "general" (``general_impl="auto"``, the engine's
default: fused on CUDA), "general-reference", "general-fused" and "general-compiled"; each gets its own row and
launches per layer.

The runner is built as ``lowlat run`` builds it (EngineConfig with ``plugin="none"`` or the plugin's name,
``num_layers`` for the second depth), so its CUDA graphs, KV pool and plugin dispatch are the real ones. A
timed step is ``ModelRunner.forward(batch)`` after the engine's input work (``input_sets``: one packed upload and
one KV slot write), replaying the shape's graph (on a CPU: the eager forward).

KV state: instead of prefilling ``context`` tokens per request, each request gets a ``req_to_token`` row and
``context`` slots from the KV pool, and every K/V buffer is filled with random values once. Latency does not
depend on the values (docs/benchmarks.md says so); the slot layout is the one a real prefill gives.

Input sets (``lowlat.bench.input_sets``): ``input_sets`` batches per shape, each with its own requests (so its own KV
pages), its own new-token slots and random token ids; the pool is sized for ``max_batch_size * input_sets`` requests.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from lowlat.bench.config import GENERAL_VARIANTS, BenchConfig, Shape
from lowlat.bench.input_sets import InputSets, free_rows, input_sets
from lowlat.bench.measure import (
    DepthResult,
    Measurement,
    describe_error,
    fmt_row,
    free_device_memory,
    launches_of,
    timed_twice,
)
from lowlat.bench.roofline import measure_routing
from lowlat.bench.timing import summarize, time_steps, warm_up
from lowlat.config import EngineConfig
from lowlat.forward_batch import ForwardBatch, ForwardMode

Log = Callable[[str], None]


def engine_config(cfg: BenchConfig, model: str, path: str, depth: int | None) -> EngineConfig:
    """The EngineConfig of ``path`` at ``depth`` decoder layers (None: all of them).

    ``max_context_len`` is ``context`` plus the largest step (so plugins plan attention for this context),
    ``max_batch_size`` leaves room for ``input_sets`` batches of the largest batch size at once.
    """
    return EngineConfig(
        model=model, device=cfg.device, dtype=cfg.dtype, page_size=cfg.page_size,
        max_batch_size=cfg.max_batch_size * cfg.input_sets, max_context_len=cfg.context + cfg.max_tokens_per_req,
        cuda_graph=True, max_verify_tokens=cfg.max_tokens_per_req, plugin="none" if path in GENERAL_VARIANTS else path,
        seed=cfg.seed, num_layers=depth, general_impl=GENERAL_VARIANTS.get(path, "auto"),
    )


def fill_kv_random(pool: object, seed: int) -> None:
    """Fill every layer's K and V buffer of the pool with seeded standard-normal values (never time on zeros)."""
    gen = torch.Generator(device=pool.k_buffers[0].device).manual_seed(seed)  # type: ignore[attr-defined]
    for buf in [*pool.k_buffers, *pool.v_buffers]:  # type: ignore[attr-defined]
        buf.normal_(generator=gen)


def measure_shape(runner: object, sets: InputSets, cfg: BenchConfig, device: torch.device) -> Measurement:
    """Time ``runner.forward`` over the rotated input ``sets`` (twice) and the pure graph replay."""
    paths: set[str] = set()

    def run(i: int) -> object:
        return runner.forward(sets.step(i))  # type: ignore[attr-defined]

    run(0)  # learn the path and whether it replays a graph
    paths.add(runner.last_path)  # type: ignore[attr-defined]
    graphed = bool(runner.last_graphed)  # type: ignore[attr-defined]
    step, repeat = timed_twice(run, cfg, device)
    paths.add(runner.last_path)  # type: ignore[attr-defined]
    m = Measurement(step=step, repeat=repeat, ran_on="+".join(sorted(paths, reverse=True)), graphed=graphed,
                    inputs=sets.fed)
    graph_runner = runner.graph_runner  # type: ignore[attr-defined]
    if graphed and graph_runner is not None:
        graph = graph_runner.graphs[graph_runner.key_for(sets.batches[0])]
        run(0)  # fills the graph's input buffers

        def replay(i: int) -> None:
            graph.replay()

        warm_up(replay, 2, device)
        m.replay = summarize(time_steps(replay, cfg.iters, device))
    return m


def measure_decode(runner: object, cfg: BenchConfig, batch: int, seed: int) -> Measurement:
    """``lowlat bench``'s DECODE measurement of ``batch`` requests in an existing runner (an Engine's): random KV
    (``fill_kv_random``), ``cfg.input_sets`` fresh input sets at ``cfg.context``, ``measure_shape``, rows freed."""
    fill_kv_random(runner.kv_pool, 0)  # type: ignore[attr-defined]
    sets = input_sets(runner, Shape(ForwardMode.DECODE, batch, 1), cfg, seed=seed)
    try:
        return measure_shape(runner, sets, cfg, runner.device)  # type: ignore[attr-defined]
    finally:
        free_rows(runner, sets.rows)


def eager_pass(runner: object, batches: list[ForwardBatch], device: torch.device, m: Measurement,
               routing: bool) -> list[float] | None:
    """The eager work of a row, run after every shape's graphs were timed: count the launches of one eager step
    (``forward_fn``, no graph) into ``m``; with ``routing``, the MoE union over ``batches`` (general forward, hooked).
    """
    with torch.inference_mode():
        launches_of(lambda: runner.forward_fn(batches[0]), device, m)  # type: ignore[attr-defined]
    if not routing:
        return None
    top_k = runner.model_config.num_experts_per_tok  # type: ignore[attr-defined]
    return measure_routing(runner.model, top_k,  # type: ignore[attr-defined]
                           [lambda b=b: runner.general_forward(b) for b in batches])  # type: ignore[attr-defined]


def run_lowlat_path(cfg: BenchConfig, model: str, path: str, depth: int, full_depth: int, shapes: list[Shape],
                    device: torch.device, *, routing_for: list[Shape] | None = None, log: Log = print) -> DepthResult:
    """Build ``path``'s ModelRunner at ``depth`` layers and measure every shape; never raises for a path failure.

    Args:
        routing_for: shapes whose MoE routing to measure (eager general forward with the routers hooked, over
            the same input sets); only meaningful at full depth on an MoE model.

    Returns:
        A DepthResult; a runner that fails to build turns every row into "skipped: <reason>".
    """
    from lowlat.runtime.model_runner import ModelRunner

    res = DepthResult(path=path, depth=depth)
    prefix = f"[bench] {model} {path} L={depth}"
    t0 = time.perf_counter()
    ecfg = engine_config(cfg, model, path, None if depth == full_depth else depth)
    log(f"{prefix}: starting (weights, KV pool for {ecfg.max_batch_size} requests"
        f"{', CUDA graphs' if device.type == 'cuda' else ''})")
    try:
        runner = ModelRunner(ecfg, device=device if device.type == "cuda" else None, show_progress=False)
    except Exception as e:
        free_device_memory(device)
        reason = f"{path} could not start: {describe_error(e)}"
        log(f"{prefix}: skipped: {reason}")
        return res.fail_all(shapes, reason)
    try:
        host = runner.plugin_host
        sel = host.selection
        res.info = {"plugin": host.name, "selection": sel.reason if sel else None,
                    "graphs": len(runner.graph_runner.graphs) if runner.graph_runner else 0,
                    "kv_pool_slots": runner.kv_pool.num_slots, "start_s": round(time.perf_counter() - t0, 2)}
        graphs = f"{res.info['graphs']} CUDA graphs" if runner.graph_runner else "eager steps"
        log(f"{prefix}: started in {res.info['start_s']:.1f} s ({graphs}"
            f"{', plugin ' + host.name if host.name else ''})")
        fill_kv_random(runner.kv_pool, cfg.seed)
        for k, shape in enumerate(shapes):  # graphs first: no eager step runs between graph timings
            rows: list[int] = []
            try:
                sets = input_sets(runner, shape, cfg, seed=cfg.seed * 1000 + k)
                rows = sets.rows
                res.rows[shape] = measure_shape(runner, sets, cfg, device)
            except Exception as e:
                res.rows[shape] = describe_error(e)
                free_device_memory(device)
            finally:
                free_rows(runner, rows)
            log(fmt_row(prefix, shape, res.rows[shape]))
        for k, shape in enumerate(shapes):  # then the eager work: launch counts and the MoE routing
            m = res.rows[shape]
            if not isinstance(m, Measurement):
                continue
            rows = []
            try:
                sets = input_sets(runner, shape, cfg, seed=cfg.seed * 1000 + k)  # the same token ids
                rows, batches = sets.rows, sets.batches
                want = bool(routing_for) and shape in routing_for and runner.model_config.is_moe
                union = eager_pass(runner, batches, device, m, want)
                if union is not None:
                    res.routing[shape] = union
                    res.routing_source = f"lowlat general forward (eager, {len(batches)} input sets) in path {path}"
            except Exception as e:
                m.launches_error = m.launches_error or describe_error(e)
                log(f"{prefix} {shape.label}: eager pass (launches, routing) failed: {m.launches_error}")
                free_device_memory(device)
            finally:
                free_rows(runner, rows)
    finally:
        runner.close()
        free_device_memory(device)
    return res

