"""Where the overlapped loop loses time on a GPU: host syncs and device idle gaps per DECODE step.

    python bench/scripts/overlap_diag.py --model llama-3.2-1b --paths general-fused,nvidia_mega --batch-sizes 1,8

Per path and batch size, after a warm-up ``Engine.generate`` with the overlapped loop (``EngineConfig.overlap``):

1. **host syncs**: the same generate under ``torch.cuda.set_sync_debug_mode("warn")``; every synchronizing CUDA
   call (``.item()``, a blocking copy, ``tolist()`` of a device tensor, ...) is printed once with the lowlat
   frames of its stack and how many times it fired. The overlapped loop must have none on the step path (its one
   read is the non-blocking copy into pinned memory, waited on through an event).
2. **device gaps**: ``torch.profiler`` over 32 DECODE steps; the device kernels and copies are sorted by start,
   and the idle time between consecutive ones is summed: busy and idle µs per step, and the five largest gaps with
   the names of the operations on each side. Idle time per step is what separates Engine.generate's TPOT from
   ``lowlat bench``'s step latency (issue 17).

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


def _gaps(engine: Engine, prompts: list[list[int]], params: SamplingParams, steps: int) -> dict:
    """Device busy/idle µs per step and the largest gaps, from a profiler trace of one generate."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.generate(prompts, params)
        torch.cuda.synchronize()
    dev = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                 key=lambda e: e.time_range.start)
    if len(dev) < 2:
        return {"busy_us": 0.0, "idle_us": 0.0, "top": []}
    # The decode part only: skip the prefill (the first 10% of device time), end at the last event.
    t_first, t_last = dev[0].time_range.start, dev[-1].time_range.end
    start = t_first + 0.1 * (t_last - t_first)
    dev = [e for e in dev if e.time_range.start >= start]
    busy = idle = 0.0
    gaps = []
    end = dev[0].time_range.start
    for prev, e in zip([None, *dev[:-1]], dev):
        s, f = e.time_range.start, e.time_range.end
        if s > end:
            idle += s - end
            gaps.append((s - end, prev.name if prev else "-", e.name))
        busy += max(0.0, f - max(s, end))
        end = max(end, f)
    n = max(1, int(steps * 0.9))
    gaps.sort(reverse=True)
    return {"busy_us": busy / n, "idle_us": idle / n, "top": gaps[:5]}


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
                           max_context_len=args.context + args.steps + 8, max_verify_tokens=1, overlap=True)
        with Engine(cfg) as e:
            vocab = e.model_config.vocab_size
            for b in bss:
                prompts = torch.randint(0, vocab, (b, args.context), generator=torch.Generator().manual_seed(b))
                prompts = prompts.tolist()
                params = SamplingParams(max_new_tokens=args.steps, stop_at_eos=False)
                e.generate(prompts, params)  # warm-up
                syncs = _syncs(e, prompts, params)
                g = _gaps(e, prompts, params, args.steps)
                print(f"== {args.model} {path} batch={b}: device busy {g['busy_us']:.1f} us/step, idle "
                      f"{g['idle_us']:.1f} us/step; {sum(syncs.values())} host syncs", flush=True)
                for (msg, where), k in syncs.most_common(8):
                    print(f"   sync x{k}: {msg} at {where}")
                for us, a, z in g["top"]:
                    print(f"   gap {us:.1f} us between {a[:60]} and {z[:60]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
