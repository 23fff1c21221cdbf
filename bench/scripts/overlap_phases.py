"""Where an overlapped DECODE step's time goes, without a profiler: device phases by CUDA events, host by clock.

    python bench/scripts/overlap_phases.py --model llama-3.2-1b --paths general,nvidia_mega --batch-sizes 1,8

Per path and batch size, ``--steps`` overlapped DECODE steps (after every request has decoded twice; no prefill)
are run with CUDA events recorded in stream order at four points of each step (``lowlat.runtime.overlap``):

- ``a``: before the batch is built (``OverlapLoop._next_step``: the upload and the KV-slot write are queued there),
- ``b``/``c``: around ``ModelRunner.forward`` (the graph replay with its replay hooks and the output copy; the
  ``replay`` column is ``CUDAGraph.replay`` alone, by two more events),
- ``d``: after the picked ids' copy to the host (the end of ``OverlapLoop._enqueue``).

and printed as device µs per step (medians): ``inputs`` a->b (upload, slot write, the ids gather), ``forward``
b->c, ``epilogue`` c->d (pick, pack, copy to the host), ``gap`` d->next a (idle: the device waited for the host),
``period`` a->next a (what a token costs). Beside them the host's µs per ``Engine.step()`` call and, of it, the
time spent waiting for the device (``OverlapLoop._wait``): when the wait is near zero the loop is host-bound.
``--wait`` picks how the host waits: ``spin`` (the loop's own ``event.query()`` poll), ``sync``
(``event.synchronize()``) or ``sleep`` (a poll every 20 µs), to see whether the host's polling slows the device.
``--profile`` adds a cProfile of the host over the timed steps.
Then ``lowlat bench``'s step and replay (``lowlat.bench.lowlat_path.measure_shape``) at the loop's mean KV length,
in the same engine, for the side-by-side figure.

Diagnostic only (no pass/fail; it patches the loop's methods in this process); CUDA.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch
from lowlat import Engine, EngineConfig, SamplingParams
from lowlat.bench.config import GENERAL_VARIANTS, BenchConfig
from lowlat.bench.lowlat_path import measure_decode
from lowlat.forward_batch import ForwardMode
from lowlat.runtime.overlap import OverlapLoop


class Phases:
    """Events and host clocks of the patched loop; ``on`` gates recording (warm-up steps are not recorded)."""

    def __init__(self, wait_mode: str = "spin") -> None:
        self.wait_mode = wait_mode
        self.on = False
        self.marks: list[dict[str, torch.cuda.Event]] = []  # one dict per launched step: a, b, c, d
        self.host_us: list[float] = []
        self.wait_us: list[float] = []

    def mark(self, name: str) -> None:
        if not self.on:
            return
        if name == "a" or not self.marks or name in self.marks[-1]:
            self.marks.append({})
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        self.marks[-1][name] = ev

    def patch(self, loop: OverlapLoop) -> None:
        runner = loop.engine.runner
        next_step, enqueue, wait, step, forward = (loop._next_step, loop._enqueue, loop._wait, loop.step,
                                                   runner.forward)

        def p_next(prev):  # noqa: ANN001, ANN202
            self.mark("a")
            return next_step(prev)

        def p_forward(batch, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
            self.mark("b")
            out = forward(batch, *a, **k)
            self.mark("c")
            return out

        def p_enqueue(*a, **k):  # noqa: ANN002, ANN003, ANN202
            out = enqueue(*a, **k)
            self.mark("d")
            return out

        def p_wait(f):  # noqa: ANN001, ANN202
            t = time.perf_counter()
            if self.wait_mode == "sync" and f.event is not None:
                f.event.synchronize()
            elif self.wait_mode == "sleep" and f.event is not None:
                while not f.event.query():
                    time.sleep(2e-5)
            else:
                wait(f)
            if self.on:
                self.wait_us.append(1e6 * (time.perf_counter() - t))

        def p_step():  # noqa: ANN202
            t = time.perf_counter()
            out = step()
            if self.on:
                self.host_us.append(1e6 * (time.perf_counter() - t))
            return out

        loop._next_step, loop._enqueue, loop._wait, loop.step = p_next, p_enqueue, p_wait, p_step
        runner.forward = p_forward
        graphs = runner.graph_runner.graphs if runner.graph_runner is not None else {}
        for key, g in list(graphs.items()):
            graphs[key] = _Timed(g, self)

    def unpatch(self, loop: OverlapLoop) -> None:
        runner = loop.engine.runner
        del runner.forward  # the class's method again
        graphs = runner.graph_runner.graphs if runner.graph_runner is not None else {}
        for key, g in list(graphs.items()):
            graphs[key] = g.graph if isinstance(g, _Timed) else g

    def table(self) -> dict[str, float]:
        torch.cuda.synchronize()
        full = [m for m in self.marks if set(m) >= {"a", "b", "c", "d"}]
        med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
        us = lambda x, y: 1e3 * x.elapsed_time(y)  # noqa: E731
        pairs = list(zip(full, full[1:]))
        return {"steps": len(full), "inputs": med([us(m["a"], m["b"]) for m in full]),
                "forward": med([us(m["b"], m["c"]) for m in full]),
                "epilogue": med([us(m["c"], m["d"]) for m in full]),
                "replay": med([us(m["r0"], m["r1"]) for m in full if "r0" in m and "r1" in m]),
                "gap": med([us(m["d"], n["a"]) for m, n in pairs]),
                "period": med([us(m["a"], n["a"]) for m, n in pairs]),
                "host": med(self.host_us), "wait": med(self.wait_us)}


class _Timed:
    """A captured graph whose ``replay`` is bracketed by two events (``r0``, ``r1``) of the current step."""

    def __init__(self, graph: torch.cuda.CUDAGraph, phases: Phases) -> None:
        self.graph, self.phases = graph, phases

    def replay(self) -> None:
        if self.phases.on and self.phases.marks:
            for name in ("r0", "r1"):
                if name == "r1":
                    self.graph.replay()
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                self.phases.marks[-1][name] = ev
        else:
            self.graph.replay()


def bench_step(engine: Engine, batch: int, context: int) -> tuple[float, float]:
    """``lowlat bench``'s DECODE step and pure replay (median µs) at ``context`` in ``engine``'s runner."""
    runner = engine.runner
    cfg = BenchConfig(models=(engine.config.model,), paths=("general",), batch_sizes=(batch,),
                      modes=(ForwardMode.DECODE,), context=context, input_sets=2, warmup=5, iters=50, device="cuda",
                      dtype="bfloat16", seed=0, page_size=engine.config.page_size)
    m = measure_decode(runner, cfg, batch, seed=batch)
    return 1e3 * m.step.median, 1e3 * m.replay.median if m.replay is not None else float("nan")


def run(engine: Engine, batch: int, steps: int, context: int, wait_mode: str, profile: bool = False
        ) -> dict[str, float]:
    vocab = engine.model_config.vocab_size
    prompts = torch.randint(0, vocab, (batch, context), generator=torch.Generator().manual_seed(batch)).tolist()
    params = SamplingParams(max_new_tokens=steps + 16, stop_at_eos=False)
    engine.generate(prompts, params)  # warm-up
    phases = Phases(wait_mode)
    phases.patch(engine.overlap)
    for p in prompts:
        engine.add_request(p, params)
    while any(len(r.output_ids) < 2 for r in engine.scheduler.running) or len(engine.scheduler.running) < batch:
        engine.step()
    phases.on = True
    prof = cProfile.Profile() if profile else None
    if prof is not None:
        prof.enable()
    for _ in range(steps):
        engine.step()
    if prof is not None:
        prof.disable()
        print(f"  host profile, {engine.config.model} b={batch} (cProfile over {steps} steps; top 14 by own time):")
        stats = pstats.Stats(prof)
        stats.sort_stats("tottime").print_stats(14)
    phases.on = False
    while engine.has_unfinished():
        engine.step()
    phases.unpatch(engine.overlap)
    engine.overlap = OverlapLoop(engine)  # unpatched
    t = phases.table()
    t["bench step"], t["bench replay"] = bench_step(engine, batch, context + (steps + 6) // 2)
    return t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--paths", default="general,nvidia_mega")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=96)
    ap.add_argument("--max-context-len", type=int, default=1152,
                    help="the engine's (it sets the attention's split count): e2e_tpot.py's at its defaults")
    ap.add_argument("--wait", default="spin", help="comma-separated host wait modes: spin, sync, sleep")
    ap.add_argument("--profile", action="store_true", help="also print a cProfile of the host over the timed steps "
                    "(where the host's busy time goes; the profiler slows the host, so its phase rows are not quoted)")
    ap.add_argument("--sweep", default="", help="comma-separated KV lengths: lowlat bench's step and replay at "
                    "each, in a fresh engine before the loop runs and again after it (does the step depend on the "
                    "KV length, or on what ran before?)")
    args = ap.parse_args()
    cols = ("inputs", "forward", "replay", "epilogue", "gap", "period", "host", "wait", "bench step", "bench replay")
    print("| model | path | batch | wait | " + " | ".join(f"{c} us" for c in cols) + " |")
    print("|---|---|---|---|" + "---|" * len(cols))
    if args.context + args.steps + 32 > args.max_context_len:
        ap.error("--context + --steps + 32 must fit --max-context-len")
    for path in args.paths.split(","):
        general = GENERAL_VARIANTS.get(path)
        bss = [int(b) for b in args.batch_sizes.split(",")]
        cfg = EngineConfig(model=args.model, device="cuda", dtype="bfloat16", plugin="none" if general else path,
                           general_impl=general or "auto", max_batch_size=2 * max(bss),  # 2 bench input sets
                           max_context_len=args.max_context_len, max_verify_tokens=1, overlap=True,
                           chunked_prefill_size=max(4096, max(bss) * args.context))
        with Engine(cfg) as e:
            sweep = [int(c) for c in args.sweep.split(",") if c]
            before = {(b, c): bench_step(e, b, c) for b in bss for c in sweep}
            for b in bss:
                for mode in args.wait.split(","):
                    t = run(e, b, args.steps, args.context, mode, args.profile)
                    print(f"| {args.model} | {path} | {b} | {mode} | " + " | ".join(f"{t[c]:.1f}" for c in cols)
                          + " |", flush=True)
            for (b, c), (step, replay) in before.items():
                a_step, a_replay = bench_step(e, b, c)
                print(f"  sweep {path} b={b} KV {c}: bench step {step:.1f} / replay {replay:.1f} us before the loop, "
                      f"{a_step:.1f} / {a_replay:.1f} us after", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
