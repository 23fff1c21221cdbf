"""A bench step's two input paths side by side, in one runner: field-by-field copies against the engine's build.

    python bench/scripts/input_path_ab.py --model llama-3.2-1b --path nvidia_mega --batch-sizes 1,8

Per batch size, the same input sets (``lowlat.bench.input_sets``) are timed as ``lowlat bench`` times a row
(``lowlat_path.measure_shape``), alternating A B A B ... for ``--rounds`` rounds:

* A "copied": each step hands the runner a standalone batch, which ``CudaGraphRunner.replay`` copies into the
  graph's buffers field by field (five copies and two fills before the replay): ``lowlat bench`` before 2026-12-07;
* B "built": each step restores its set into the runner's step inputs as the scheduler's ``BatchBuilder`` builds an
  engine step (one packed host->device copy and one KV slot write), so the replay copies nothing.

Prints the medians (ms) of each round and the ratio A / B of their medians; the pure graph replay is the same
graph in both. bf16 on CUDA at ``--context`` cached tokens per request.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from lowlat.bench.config import BenchConfig, Shape
from lowlat.bench.input_sets import FED_COPIED, InputSets, free_rows, input_sets
from lowlat.bench.lowlat_path import engine_config, fill_kv_random, measure_shape
from lowlat.runtime import ForwardMode
from lowlat.runtime.model_runner import ModelRunner


def copied(sets: InputSets) -> InputSets:
    """The same sets, fed as standalone batches (the replay copies them in)."""
    n = len(sets.batches)
    return InputSets(sets.batches, sets.rows, FED_COPIED, lambda i: sets.batches[i % n])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--path", default="nvidia_mega", help="a plugin's name, or general")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    sizes = tuple(int(b) for b in args.batch_sizes.split(","))
    cfg = BenchConfig(models=(args.model,), paths=(args.path,), batch_sizes=sizes, modes=(ForwardMode.DECODE,),
                      context=args.context, input_sets=2, warmup=5, iters=args.iters, device=args.device,
                      dtype="bfloat16", seed=0)
    device = torch.device(args.device)
    runner = ModelRunner(engine_config(cfg, args.model, args.path, None), device=device, show_progress=False)
    try:
        fill_kv_random(runner.kv_pool, 0)
        served = f"plugin {runner.plugin_host.name}" if runner.plugin_host.name else "the general path"
        print(f"{args.model} {args.path} DECODE, context {args.context}, {args.iters} steps per run on {served}; "
              f"medians in ms{' (on a CPU, run it with OMP_NUM_THREADS=1)' if device.type == 'cpu' else ''}")
        for k, b in enumerate(sizes):
            built = input_sets(runner, Shape(ForwardMode.DECODE, b, 1), cfg, seed=k)
            try:
                a_ms, b_ms = [], []
                for _ in range(args.rounds):
                    a_ms.append(measure_shape(runner, copied(built), cfg, device).step.median)
                    b_ms.append(measure_shape(runner, built, cfg, device).step.median)
                ratio = statistics.median(a_ms) / statistics.median(b_ms)
                print(f"b={b}: copied {' '.join(f'{x:.4f}' for x in a_ms)} | {built.fed} "
                      f"{' '.join(f'{x:.4f}' for x in b_ms)} | copied / built {ratio:.3f}", flush=True)
            finally:
                free_rows(runner, built.rows)
    finally:
        runner.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
