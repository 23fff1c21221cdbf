"""Per-layer decode latency at tensor parallelism, per path, and the all-reduce alone (issue 22).

    python bench/scripts/tp_bench.py --model llama-3.2-1b --tp 2 --out /tmp/out/tp_llama   # a machine of 2 GPUs
    TRITON_INTERPRET=1 python bench/scripts/tp_bench.py --device cpu --model tiny-llama --layer-depth 1  # the tool

Rows (``--paths``, default all): general (NCCL), general-peer (one-shot peer all-reduce), nvidia_mega (epilogue
publishing), nvidia_mega-nccl (LOWLAT_MEGA_TP_REDUCE=nccl), amd_mono (in-kernel TP); any other name is that
plugin with no overrides. A row whose plugin is missing or refuses is skipped with its reason. Writes
``tp_bench.md`` and ``tp_bench.json`` into ``--out`` (``--json`` moves the JSON) and prints the Markdown.
Exit codes: 0 done, 1 the run failed (a rank errored, died or stalled), 2 bad arguments. The method is in
docs/benchmarks.md, "Tensor parallelism".
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    """The flags (None = the device's default)."""
    from lowlat.bench.tp_bench import ROWS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="preset or checkpoint (default llama-3.2-1b; CPU tiny-llama)")
    ap.add_argument("--tp", type=int, default=2, help="ranks, one GPU each (default 2)")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--paths", default=",".join(r.label for r in ROWS), help="rows, comma-separated (default all)")
    ap.add_argument("--batch-sizes", default="1,8", help="DECODE batch sizes (default 1,8)")
    ap.add_argument("--context", type=int, default=None, help="cached tokens per request (default 1024; CPU 16)")
    ap.add_argument("--layer-depth", type=int, default=4, help="second depth for per-layer us (default 4)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps per shape (default 10; CPU 1)")
    ap.add_argument("--iters", type=int, default=None, help="timed steps per run, 2 runs (default 100; CPU 2)")
    ap.add_argument("--input-sets", type=int, default=None, help="input sets rotated (default 2; CPU 1)")
    ap.add_argument("--dtype", default="bfloat16", help="model dtype (default bfloat16)")
    ap.add_argument("--ar-kib", default="4,16,64", help="generic all-reduce sizes in KiB (default 4,16,64)")
    ap.add_argument("--ar-iters", type=int, default=None, help="timed all-reduce samples per size (default 50; CPU 2)")
    ap.add_argument("--ar-calls", type=int, default=20, help="all-reduces per CUDA graph sample (default 20)")
    ap.add_argument("--no-all-reduce", action="store_true", help="skip the all-reduce table")
    ap.add_argument("--rank-timeout-s", type=float, default=120.0, help="each collective's timeout (default 120)")
    ap.add_argument("--stall-s", type=float, default=600.0, help="fail when the ranks say nothing this long (600)")
    ap.add_argument("--timeout-s", type=float, default=3600.0, help="fail when the run takes longer (3600)")
    ap.add_argument("--out", default=None, help="output directory (default ./lowlat-tp-bench-<UTC time>)")
    ap.add_argument("--json", default=None, help="JSON path (default OUT/tp_bench.json)")
    return ap


def main(argv: list[str] | None = None) -> int:
    from lowlat.bench.config import parse_int_list
    from lowlat.bench.harness import default_out_dir
    from lowlat.bench.tp_bench import TPBenchConfig, TPBenchError, run_tp_bench, select_rows
    from lowlat.bench.tp_report import render_markdown, write

    args = build_parser().parse_args(argv)

    import torch

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    cpu = device == "cpu"

    def pick(value: object, gpu: object, on_cpu: object) -> object:
        return value if value is not None else (on_cpu if cpu else gpu)

    try:
        cfg = TPBenchConfig(
            model=str(pick(args.model, "llama-3.2-1b", "tiny-llama")), device=device,
            rows=select_rows([p.strip() for p in args.paths.split(",") if p.strip()]), world=args.tp,
            batch_sizes=parse_int_list(args.batch_sizes, "--batch-sizes"), context=int(pick(args.context, 1024, 16)),
            warmup=int(pick(args.warmup, 10, 1)), iters=int(pick(args.iters, 100, 2)),
            input_sets=int(pick(args.input_sets, 2, 1)), layer_depth=args.layer_depth, dtype=args.dtype,
            all_reduce=not args.no_all_reduce, ar_kib=parse_int_list(args.ar_kib, "--ar-kib"),
            ar_calls=args.ar_calls, ar_iters=int(pick(args.ar_iters, 50, 2)), ar_warmup=1 if cpu else 5,
            rank_timeout_s=args.rank_timeout_s, stall_s=args.stall_s, timeout_s=args.timeout_s)
        res = run_tp_bench(cfg, command=["python", "bench/scripts/tp_bench.py", *(argv or sys.argv[1:])],
                           log=lambda line: print(line, file=sys.stderr, flush=True))
    except (ValueError, TPBenchError) as e:
        print(f"tp_bench: error: {e}", file=sys.stderr)
        return 1 if isinstance(e, TPBenchError) else 2
    out = Path(args.out) if args.out else default_out_dir(None, prefix="lowlat-tp-bench")
    md, jp = write(res, out, Path(args.json) if args.json else None)
    print(render_markdown(res), end="")
    print(f"[tp-bench] wrote {md} and {jp}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
