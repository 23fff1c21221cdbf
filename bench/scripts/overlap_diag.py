"""Where the overlapped loop loses time on a GPU: host syncs and device idle gaps per DECODE step.

    python bench/scripts/overlap_diag.py --model llama-3.2-1b --paths general-fused,nvidia_mega --batch-sizes 1,8

Per path and batch size, after a warm-up ``Engine.generate`` with the overlapped loop (``EngineConfig.overlap``):

1. **host syncs**: the same generate under ``torch.cuda.set_sync_debug_mode("warn")``; every synchronizing CUDA
   call (``.item()``, a blocking copy, ``tolist()`` of a device tensor, ...) is printed once with the lowlat
   frames of its stack and how many times it fired. The overlapped loop must have none on the step path (its one
   read is the non-blocking copy into pinned memory, waited on through an event).
2. **device gaps**: ``torch.profiler`` over 32 overlapped DECODE steps (``Engine.step`` after every request has
   decoded; no prefill in the trace); the device kernels and copies are sorted by start, and the idle time
   between consecutive ones is summed: busy and idle µs per step, the five largest gaps with the operations on
   each side, and the costliest device operations per step;
3. **epilogue**: device µs of the per-step work after the forward (argmax, finiteness flags, pack, copy to the
   host) on random logits, by CUDA events without the profiler.

Idle time and epilogue per step are what separate Engine.generate's TPOT from ``lowlat bench``'s step latency
(issue 17).

Diagnostic only (no pass/fail); bf16 on CUDA.
"""

from __future__ import annotations

import argparse
import collections
import traceback
import warnings

import torch
from lowlat import Engine, EngineConfig, SamplingParams
from lowlat.bench.config import GENERAL_VARIANTS


def _syncs(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> collections.Counter:
    """Counter of (warning text, lowlat frames) for every synchronizing CUDA call during one generate."""
    seen: collections.Counter = collections.Counter()
    old = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001
        frames = [f"{f.filename.split('/src/')[-1]}:{f.lineno} {f.name}" for f in traceback.extract_stack()[:-1]
                  if "lowlat" in f.filename]
        seen[(str(message).splitlines()[0][:100], " <- ".join(reversed(frames[-6:])))] += 1

    warnings.showwarning = show
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                engine.generate(prompts, params)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        warnings.showwarning = old
    return seen


def _decode_steps(engine: Engine, prompts: list[list[int]], params: SamplingParams, steps: int, fn) -> None:
    """Admit ``prompts``, step until every request decodes, run ``fn(n)`` around ``steps`` steps, then drain."""
    for p in prompts:
        engine.add_request(p, params)
    run = engine.scheduler.running
    while len(run) < len(prompts) or any(len(r.output_ids) < 2 for r in run):
        engine.step()
    fn(lambda: [engine.step() for _ in range(steps)])
    while engine.has_unfinished():
        engine.step()


def _gaps(engine: Engine, prompts: list[list[int]], params: SamplingParams, steps: int) -> dict:
    """Device busy/idle µs per DECODE step, the largest gaps and the costliest device operations per step, from a
    profiler trace of ``steps`` overlapped DECODE steps (prefill excluded)."""
    from torch.profiler import ProfilerActivity, profile

    box = {}

    def traced(run) -> None:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        box["prof"] = prof

    _decode_steps(engine, prompts, params, steps, traced)
    dev = sorted((e for e in box["prof"].events() if e.device_type == torch.autograd.DeviceType.CUDA),
                 key=lambda e: e.time_range.start)
    if len(dev) < 2:
        return {"busy_us": 0.0, "idle_us": 0.0, "top": [], "ops": []}
    busy = idle = 0.0
    gaps = []
    per_op: collections.Counter = collections.Counter()
    end = dev[0].time_range.start
    for prev, e in zip([None, *dev[:-1]], dev):
        s, f = e.time_range.start, e.time_range.end
        per_op[e.name[:70]] += f - s
        if s > end:
            idle += s - end
            gaps.append((s - end, prev.name if prev else "-", e.name))
        busy += max(0.0, f - max(s, end))
        end = max(end, f)
    gaps.sort(reverse=True)
    return {"busy_us": busy / steps, "idle_us": idle / steps, "top": gaps[:5],
            "ops": [(name, us / steps) for name, us in per_op.most_common(12)]}


def _epilogue_us(engine: Engine, batch: int, reps: int = 200) -> float:
    """Device µs of the overlapped loop's per-step work after the forward (greedy argmax, the finiteness flags,
    the pack and the non-blocking copy to pinned memory) on ``[batch, vocab]`` float32 logits."""
    from lowlat.runtime.step_guard import packed_picks

    logits = torch.randn(batch, engine.model_config.vocab_size, device="cuda")
    host = torch.empty(2 * batch, dtype=torch.int64, pin_memory=True)

    def once() -> None:
        picked = torch.argmax(logits, dim=-1)
        host.copy_(packed_picks(logits, picked), non_blocking=True)

    for _ in range(10):
        once()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        once()
    b.record()
    b.synchronize()
    return 1e3 * a.elapsed_time(b) / reps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--paths", default="general-fused,nvidia_mega")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=32)
    args = ap.parse_args()
    for path in args.paths.split(","):
        general = GENERAL_VARIANTS.get(path)
        bss = [int(b) for b in args.batch_sizes.split(",")]
        cfg = EngineConfig(model=args.model, device="cuda", dtype="bfloat16", plugin="none" if general else path,
                           general_impl=general or "auto", max_batch_size=max(bss),
                           max_context_len=args.context + 2 * args.steps + 16, max_verify_tokens=1, overlap=True)
        with Engine(cfg) as e:
            vocab = e.model_config.vocab_size
            for b in bss:
                prompts = torch.randint(0, vocab, (b, args.context), generator=torch.Generator().manual_seed(b))
                prompts = prompts.tolist()
                params = SamplingParams(max_new_tokens=2 * args.steps + 8, stop_at_eos=False)
                e.generate(prompts, params)  # warm-up
                syncs = _syncs(e, prompts, params)
                g = _gaps(e, prompts, params, args.steps)
                print(f"== {args.model} {path} batch={b}: device busy {g['busy_us']:.1f} us/step, idle "
                      f"{g['idle_us']:.1f} us/step (profiled); epilogue {_epilogue_us(e, b):.1f} us/step "
                      f"(unprofiled); {sum(syncs.values())} host syncs", flush=True)
                for name, us in g["ops"]:
                    print(f"   op {us:8.1f} us/step  {name}")
                for (msg, where), k in syncs.most_common(8):
                    print(f"   sync x{k}: {msg} at {where}")
                for us, a, z in g["top"]:
                    print(f"   gap {us:.1f} us between {a[:60]} and {z[:60]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
