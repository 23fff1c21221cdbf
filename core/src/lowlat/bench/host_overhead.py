"""Host overhead of the engine loop per DECODE step, with the model forward replaced by a stub.

What runs is ``Engine.step()`` end to end — schedule, batch building, ``ModelRunner.forward``, sampling,
``Scheduler.update`` and stats — on CPU, with the model compute removed, so what is timed is the Python and
PyTorch-dispatch work the host does for a step (on a GPU this is the time the device may sit idle between
graph replays). Two paths are measured:

* ``graph``: the CUDA-graph replay path. A ``CudaGraphRunner`` is built on the CPU with every key "captured"
  as a no-op graph whose fixed output is a preallocated logits tensor, so input copies into the static
  buffers, padding, key lookup and replay hooks run exactly as on a GPU, minus the replay itself.
* ``eager``: no graphs; the Dispatcher's general forward is a stub returning a slice of a preallocated logits
  tensor.

``python -m lowlat.bench.host_overhead [--baseline REV] [--overlap | --loops]`` prints a table; with ``--baseline``
the same measurement also runs in a subprocess on ``git archive REV core/src`` (the code before a change, always
with plain steps) and the table shows before, after and the ratio. ``--overlap`` measures this tree's overlapped
loop (``EngineConfig(overlap=True)``, ``lowlat.runtime.overlap``): on CPU nothing runs concurrently, so its figure
is the host work per step that a GPU step has to cover (on a GPU it runs while the previous step computes).
``--loops`` measures both loops of this tree in one run, plain steps (``--no-overlap``) as "before" and the
overlapped loop as "after". Times are medians of per-step ``time.perf_counter`` wall times in ms, or with
``--clock thread`` of ``time.thread_time`` (this thread's CPU time: on a machine shared with other work the wall
clock also counts the time the process waits for a core; the stub forward never waits on a device, and torch runs
on one thread here, so on an idle machine the two agree).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

PATHS = ("graph", "eager")


class _NoopGraph:
    """Stands in for a captured ``torch.cuda.CUDAGraph``: replaying it does nothing (the stub output is fixed)."""

    def replay(self) -> None:
        pass


def _stub_engine(model: str, max_batch_size: int, max_context_len: int, path: str,  # type: ignore[no-untyped-def]
                 overlap: bool = False):
    """A CPU Engine whose forward is a stub; ``path`` "graph" installs the emulated graph runner."""
    from lowlat.config import EngineConfig
    from lowlat.runtime import Engine
    from lowlat.runtime.cuda_graph_runner import CudaGraphRunner

    cfg = EngineConfig(model=model, device="cpu", dtype="float32", plugin="none", cuda_graph=False,
                       max_batch_size=max_batch_size, max_context_len=max_context_len, page_size=16,
                       max_verify_tokens=4, **({"overlap": True} if overlap else {}))  # older trees lack it
    engine = Engine(cfg)
    runner = engine.runner
    vocab = runner.model_config.vocab_size
    rows = max_batch_size * cfg.max_verify_tokens
    # Fixed logits whose argmax differs per row, so every request keeps feeding a valid, varying token.
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))
    stub = lambda batch: logits[:batch.num_logit_rows]  # noqa: E731
    if getattr(runner, "dispatcher", None) is not None:  # core 0.3: the Dispatcher is always installed
        runner.dispatcher.general_forward = stub
    else:
        runner.forward_fn = stub
    runner.model = None  # nothing may reach the real model
    if path == "graph":
        kw = {"inputs": runner.step_inputs} if hasattr(runner, "step_inputs") else {}
        graphs = CudaGraphRunner(device=runner.device, dummy_row=runner.dummy_row, max_batch_size=max_batch_size,
                                 max_verify_tokens=cfg.max_verify_tokens, vocab_size=vocab, **kw)
        for key in graphs.keys():
            graphs.graphs[key] = _NoopGraph()
            graphs.outputs[key] = logits[:key.num_tokens]
        runner.graph_runner = graphs
    return engine


CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}


def _time_decode_steps(engine, batch_size: int, steps: int, warmup: int,  # type: ignore[no-untyped-def]
                       clock=time.perf_counter) -> list[float]:
    """Seconds of each of ``steps`` DECODE steps at ``batch_size`` requests (after prefill and ``warmup``)."""
    from lowlat.runtime import ForwardMode, SamplingParams

    params = SamplingParams(max_new_tokens=steps + warmup + 2, stop_at_eos=False)
    for i in range(batch_size):
        engine.add_request([1 + i, 2, 3, 4], params)
    while engine.scheduler.waiting or any(r.state.name != "DECODING" for r in engine.scheduler.running):
        engine.step()
    for _ in range(warmup):
        engine.step()
    decode = engine.stats.by_mode[ForwardMode.DECODE]
    before = decode.steps
    gc.collect()
    out = []
    for _ in range(steps):
        t0 = clock()
        engine.step()
        out.append(clock() - t0)
    if decode.steps - before != steps or len(engine.scheduler.running) != batch_size:
        raise RuntimeError("the timed steps were not all DECODE steps of the whole batch")
    while engine.has_unfinished():
        engine.step()
    return out


def measure_host_overhead(model: str = "tiny-llama", batch_sizes: Sequence[int] = (1, 8), steps: int = 200, *,
                          warmup: int = 20, repeats: int = 3, paths: Sequence[str] = PATHS,
                          overlap: bool = False, clock: str = "wall") -> dict:
    """Host milliseconds per DECODE step of ``Engine.step()`` with a stub forward (no model compute), on CPU.

    Args:
        model: a preset name (its vocabulary sizes the stub logits; weights are never used).
        batch_sizes: requests decoding together.
        steps: timed DECODE steps per repeat; ``warmup`` untimed steps run first.
        repeats: independent runs (fresh requests) per batch size and path; the best median is kept.
        paths: "graph" (emulated CUDA-graph replay) and/or "eager" (stub ``forward_fn``).
        overlap: measure the overlapped loop (``EngineConfig(overlap=True)``) instead of plain steps.
        clock: "wall" (``time.perf_counter``) or "thread" (``time.thread_time``, this thread's CPU time).

    Returns:
        ``{"model", "steps", "torch", "overlap", "clock", "host_ms": {path: {batch_size: ms}}}`` where ms is the
        median time of one step in milliseconds on that clock (best of ``repeats``).
    """
    bad = [p for p in paths if p not in PATHS]
    if bad or not batch_sizes or min(batch_sizes) < 1 or steps < 1 or clock not in CLOCKS:
        raise ValueError(f"paths must be among {PATHS}, batch sizes >= 1, steps >= 1 and clock one of "
                         f"{tuple(CLOCKS)}; got {paths}, {batch_sizes}, {steps}, {clock!r}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ctx = 4 + steps + warmup + 16
        result: dict[str, dict[int, float]] = {}
        for path in paths:
            engine = _stub_engine(model, max(batch_sizes), ctx, path, overlap)
            try:
                for b in batch_sizes:
                    medians = [statistics.median(_time_decode_steps(engine, b, steps, warmup, CLOCKS[clock]))
                               for _ in range(repeats)]
                    result.setdefault(path, {})[b] = 1e3 * min(medians)
            finally:
                engine.close()
    finally:
        torch.set_num_threads(threads)
    return {"model": model, "steps": steps, "torch": torch.__version__, "overlap": overlap, "clock": clock,
            "host_ms": result}


def measure_baseline(rev: str, model: str, batch_sizes: Sequence[int], steps: int, paths: Sequence[str],
                     repeats: int = 3, clock: str = "wall") -> dict:
    """``measure_host_overhead`` on the code at git revision ``rev`` (``git archive``; this file is copied in).

    Raises:
        RuntimeError: ``git archive`` or the subprocess failed.
    """
    repo = Path(__file__).resolve().parents[4]
    with tempfile.TemporaryDirectory(prefix="lowlat-baseline-") as tmp:
        arch = Path(tmp) / "src.tar"
        with open(arch, "wb") as f:
            proc = subprocess.run(["git", "-C", str(repo), "archive", rev, "core/src"], stdout=f,
                                  stderr=subprocess.PIPE)
        if proc.returncode:
            raise RuntimeError(f"git archive {rev} failed: {proc.stderr.decode().strip()}")
        with tarfile.open(arch) as tar:
            safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # Python < 3.10.12 lacks it
            tar.extractall(tmp, **safe)
        src = Path(tmp) / "core" / "src"
        shutil.copy(__file__, src / "lowlat" / "bench" / "host_overhead.py")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")])}
        cmd = [sys.executable, "-m", "lowlat.bench.host_overhead", "--json", "--model", model, "--steps", str(steps),
               "--repeats", str(repeats), "--clock", clock, "--batch-sizes", *map(str, batch_sizes), "--paths", *paths]
        proc = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"baseline run at {rev} failed:\n{proc.stderr[-4000:]}")
        out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["host_ms"] = {p: {int(b): v for b, v in row.items()} for p, row in out["host_ms"].items()}
    out["rev"] = rev
    return out


def format_table(after: dict, before: dict | None = None) -> str:
    """A plain-text table of host ms per DECODE step; with ``before``: before, after and before/after."""
    head = f"{'path':<6} {'batch':>5} "
    head += f"{'before ms':>10} {'after ms':>10} {'ratio':>7}" if before else f"{'host ms':>10}"
    lines = [head]
    for path, row in after["host_ms"].items():
        for b, ms in row.items():
            if before:
                old = before["host_ms"][path][b]
                lines.append(f"{path:<6} {b:>5} {old:>10.4f} {ms:>10.4f} {old / ms:>6.1f}x")
            else:
                lines.append(f"{path:<6} {b:>5} {ms:>10.4f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lowlat.bench.host_overhead", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    ap.add_argument("--repeats", type=int, default=3, help="runs per cell; the best median is kept (default 3)")
    ap.add_argument("--baseline", metavar="REV", help="also measure git revision REV and print the ratio")
    ap.add_argument("--overlap", action="store_true", help="measure the overlapped loop (the baseline stays plain)")
    ap.add_argument("--loops", action="store_true",
                    help="measure plain steps (before, --no-overlap) and the overlapped loop (after) of this tree")
    ap.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                    help="wall (time.perf_counter, default) or thread (time.thread_time: CPU time, for busy machines)")
    ap.add_argument("--json", action="store_true", help="print one JSON line instead of the table")
    args = ap.parse_args(argv)
    if args.loops and (args.overlap or args.baseline):
        ap.error("--loops measures both loops of this tree: leave out --overlap and --baseline")
    after = measure_host_overhead(args.model, args.batch_sizes, args.steps, repeats=args.repeats, paths=args.paths,
                                  clock=args.clock, **({"overlap": True} if args.overlap or args.loops else {}))
    if args.loops:
        before = measure_host_overhead(args.model, args.batch_sizes, args.steps, repeats=args.repeats,
                                       paths=args.paths, clock=args.clock)
    else:
        before = measure_baseline(args.baseline, args.model, args.batch_sizes, args.steps, args.paths,
                                  args.repeats, args.clock) if args.baseline else None
    if args.json:
        print(json.dumps({"after": after, "before": before} if before else after))
        return 0
    title = f"host ms per DECODE step ({args.clock} clock), {args.model}, stub forward on CPU, torch {after['torch']}"
    title += ", overlapped loop" if args.overlap or args.loops else ""
    if args.loops:
        title += " (before = plain steps of this tree)"
    print(title + (f" (before = {args.baseline})" if args.baseline else ""))
    print(format_table(after, before))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
