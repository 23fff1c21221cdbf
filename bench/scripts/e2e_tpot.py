"""Engine.generate's time per output token against ``lowlat bench``'s step latency, plain and overlapped loop.

    python bench/scripts/e2e_tpot.py --model llama-3.2-1b --paths general,nvidia_mega --batch-sizes 1,8

One engine per path (``general``, ``general-reference``, ``general-fused``, ``general-compiled``: plugin "none"
with that general implementation, as ``lowlat bench`` names them; else a plugin's name), bf16 on CUDA, DECODE
graphs only. Per batch size B:

* step ms: ``ModelRunner.forward`` of a DECODE batch of B requests at ``--context`` cached tokens each, timed as
  ``lowlat bench`` times a row (``lowlat.bench.lowlat_path.measure_shape``: CUDA events around each step, no sync
  between steps, ``--input-sets`` rotated request sets over seeded random KV); the median, in ms;
* TPOT ms: ``Engine.generate`` of B greedy prompts of ``context - new/2`` tokens with ``new`` tokens each (so the
  mean KV length of its DECODE steps is ``--context``), decode seconds over decode tokens per request
  (``Completion.decode_s / decode_tokens``), median over ``--repeats`` runs after one warm-up run; once with
  plain steps (``Engine.overlap = None``) and once overlapped (``lowlat.runtime.overlap.OverlapLoop``), in the
  same engine (same graphs, same KV pool);
* ratio = TPOT / step ms (issue 17's target: within 1.03 overlapped, the ``<= 1.03`` column), and whether both
  loops gave the same tokens (they run the same kernels on the same batches, so bf16 output must be identical).

All B prompts are prefilled in one PREFILL step (``chunked_prefill_size`` >= B x prompt length): with the default
4096 a batch of 8 x 960 tokens takes two, and the requests done in the first one would count the second one's
prefill in their decode time (about 5% of a llama-3.2-1b batch-8 TPOT).

Prints one table row per (path, batch) and a summary line; ``--json PATH`` writes the rows, rewritten after each
path (a step cut off by its time limit keeps the paths already measured). Exits 1 when the two loops' tokens
differ or a path failed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from lowlat import Engine, EngineConfig, SamplingParams
from lowlat.bench.config import GENERAL_VARIANTS, BenchConfig
from lowlat.bench.lowlat_path import measure_decode
from lowlat.runtime import ForwardMode
from lowlat.runtime.overlap import OverlapLoop

TARGET = 1.03  # issue 17: Engine.generate's overlapped TPOT within 3% of lowlat bench's step


def step_ms(engine: Engine, batch: int, args: argparse.Namespace) -> float:
    """``lowlat bench``'s DECODE step latency (median ms) at ``batch`` requests in ``engine``'s runner."""
    runner = engine.runner
    cfg = BenchConfig(models=(args.model,), paths=("general",), batch_sizes=(batch,), modes=(ForwardMode.DECODE,),
                      context=args.context, input_sets=args.input_sets, warmup=args.warmup, iters=args.iters,
                      device=args.device, dtype=args.dtype, seed=0, page_size=args.page_size)
    m = measure_decode(runner, cfg, batch, seed=batch)
    if not m.graphed and args.device == "cuda":
        print(f"  warning: DECODE b={batch} did not replay a CUDA graph", flush=True)
    return m.step.median


def prompt_len(args: argparse.Namespace) -> int:
    """Prompt tokens per request: the DECODE steps' mean KV length is then ``--context``."""
    return args.context - args.new_tokens // 2


def tpot_ms(engine: Engine, batch: int, overlap: bool, args: argparse.Namespace) -> tuple[float, list[list[int]]]:
    """Median over runs of the mean per-request decode ms per token of ``Engine.generate``; and the tokens."""
    engine.overlap = OverlapLoop(engine) if overlap else None  # the engine is idle: safe to swap the loop
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(batch)
    plen = prompt_len(args)
    prompts = torch.randint(0, vocab, (batch, plen), generator=gen).tolist()
    params = SamplingParams(max_new_tokens=args.new_tokens, stop_at_eos=False)
    engine.generate(prompts, SamplingParams(max_new_tokens=8, stop_at_eos=False))  # warm-up (allocator, paths)
    runs, tokens = [], []
    for _ in range(args.repeats):
        done = engine.generate(prompts, params)
        runs.append(1e3 * statistics.fmean(c.decode_s / c.decode_tokens for c in done))
        tokens = [c.token_ids for c in done]
    return statistics.median(runs), tokens


def measure_path(path: str, args: argparse.Namespace) -> list[dict]:
    general = GENERAL_VARIANTS.get(path)  # "general", "general-fused", ...: plugin none and that general_impl
    cfg = EngineConfig(model=args.model, device=args.device, dtype=args.dtype, plugin="none" if general else path,
                       general_impl=general or "auto",
                       max_batch_size=max(args.batch_sizes) * args.input_sets, page_size=args.page_size,
                       max_context_len=args.context + args.new_tokens, max_verify_tokens=1, overlap=True,
                       chunked_prefill_size=max(4096, max(args.batch_sizes) * prompt_len(args)))
    t0 = time.perf_counter()
    rows = []
    with Engine(cfg) as e:
        print(f"[e2e] {args.model} {path}: started in {time.perf_counter() - t0:.1f} s "
              f"(plugin {e.runner.plugin_host.name or 'none'})", flush=True)
        for b in args.batch_sizes:
            step = step_ms(e, b, args)
            plain, want = tpot_ms(e, b, False, args)
            e.stats.reset()
            over, got = tpot_ms(e, b, True, args)
            paths = sorted({p for p, mode in e.stats.by_path if mode is ForwardMode.DECODE})
            rows.append({"model": args.model, "path": path, "batch": b, "context": args.context,
                         "step_ms": step, "tpot_plain_ms": plain, "tpot_overlap_ms": over,
                         "ratio_plain": plain / step, "ratio_overlap": over / step,
                         "identical": got == want, "decode_paths": paths})
            r = rows[-1]
            print(f"| {args.model} | {path} | {b} | {step:.3f} | {plain:.3f} | {r['ratio_plain']:.3f} | {over:.3f} | "
                  f"{r['ratio_overlap']:.3f} | {'yes' if r['ratio_overlap'] <= TARGET else 'no'} | "
                  f"{'identical' if r['identical'] else 'DIFFERENT'} | {'+'.join(paths)} |", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--paths", default="general,nvidia_mega",
                    help="general variants (general, general-reference, general-fused, general-compiled) and/or "
                         "plugin names")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--context", type=int, default=1024, help="mean KV length of the DECODE steps (tokens)")
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens generated per request")
    ap.add_argument("--repeats", type=int, default=3, help="timed generate runs per loop (median)")
    ap.add_argument("--input-sets", type=int, default=2, help="as lowlat bench --input-sets")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--device", default="cuda", help="cuda (cpu: a smoke test of the script only)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--json", default=None, metavar="PATH", help="write the rows as JSON")
    args = ap.parse_args(argv)
    args.batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    if args.new_tokens < 2 or args.context <= args.new_tokens:
        ap.error("need --new-tokens >= 2 and --context > --new-tokens")
    print("| model | path | batch | step ms | TPOT plain ms | ratio | TPOT overlap ms | ratio | <= 1.03 | tokens | "
          "ran on |")
    print("|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    rows, failed = [], []
    for path in args.paths.split(","):
        try:
            rows += measure_path(path, args)
        except Exception as exc:  # one path failing must not hide the others
            failed.append(path)
            print(f"[e2e] {args.model} {path}: error: {type(exc).__name__}: {exc}", flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if args.json:  # after every path: a time limit that ends the run keeps what was measured
            with open(args.json, "w") as f:
                json.dump({"rows": rows, "failed": failed, "argv": sys.argv[1:]}, f, indent=1)
    bad = [r for r in rows if not r["identical"]]
    over = [f"{r['path']} b={r['batch']} {r['ratio_overlap']:.3f}" for r in rows if r["ratio_overlap"] > TARGET]
    print(f"[e2e] {args.model}: {len(rows) - len(over)} of {len(rows)} rows within {TARGET} overlapped"
          + (f"; over: {', '.join(over)}" if over else "") + (f"; failed: {', '.join(failed)}" if failed else ""),
          flush=True)
    return 1 if bad or failed else 0


if __name__ == "__main__":
    sys.exit(main())
