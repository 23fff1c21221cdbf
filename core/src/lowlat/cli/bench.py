"""``lowlat bench``: decode step latency per path, mode and batch size, against the roofline and the peers.

``lowlat bench --report results.json`` prints the markdown table of an earlier run instead (docs/benchmarks.md);
``lowlat bench serve`` measures a server instead (``lowlat.cli.bench_serve``).
Flags left unset take the device's defaults (``lowlat.bench.config.GPU_DEFAULTS`` / ``CPU_DEFAULTS``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from lowlat.cli.errors import one_line_errors
from lowlat.config import DTYPES, dtype_name


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand to ``subparsers``; sets ``func=run``."""
    p = subparsers.add_parser(
        "bench", help="measure decode step latency against the roofline and the peers",
        description="Measure decode/verify step latency per path and batch size (CUDA-graph replays on a GPU, "
                    "eager steps on a CPU; medians), the roofline (bytes / measured copy bandwidth), per-layer "
                    "latency and launches, and the ratios to the general path and HF transformers. Writes "
                    "results.json, results.md and results.png (into ./lowlat-bench-<UTC timestamp> unless --out).")
    add_arguments(p)
    p.set_defaults(func=run)
    from lowlat.cli import bench_serve

    bench_serve.add_parser(p.add_subparsers(dest="bench_command", metavar="{serve}",
                                            help="serve: per-user decode speed of a server (lowlat bench serve -h)"))
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``lowlat bench`` (None = the device's default)."""
    p.add_argument("--model", default=None,
                   help="preset names or checkpoint dirs, comma-separated (default: llama-3.2-1b on a GPU, "
                        "tiny-llama on a CPU)")
    p.add_argument("--paths", default=None,
                   help="comma-separated: general (general_impl auto: fused on CUDA, reference elsewhere), "
                        "general-reference, general-fused (CUDA or TRITON_INTERPRET=1), general-compiled, a plugin "
                        "name, plugins (every installed plugin), hf "
                        "(default: general,plugins,hf on a GPU; general,hf on a CPU)")
    p.add_argument("--batch-sizes", default=None, help="DECODE batch sizes (default 1,2,4,8; CPU 1,2)")
    p.add_argument("--modes", default="decode,verify", help="decode and/or verify (default decode,verify)")
    p.add_argument("--verify-tokens", type=int, default=6, help="k+1 tokens per request of a VERIFY row (default 6)")
    p.add_argument("--verify-batch-sizes", default="1", help="VERIFY batch sizes (default 1)")
    p.add_argument("--context", type=int, default=None, help="cached tokens per request (default 1024; CPU 64)")
    p.add_argument("--input-sets", type=int, default=4, help="input sets rotated through the steps (default 4)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per row (default 10; CPU 1)")
    p.add_argument("--iters", type=int, default=None, help="timed steps per timing run, two runs per row "
                                                           "(default 100; CPU 3)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="default auto")
    p.add_argument("--dtype", type=dtype_name, choices=tuple(DTYPES), default="bfloat16",
                   help="weights, activations and KV: bfloat16 (bf16, the default on a CPU too, which the "
                        "plugins need; lowlat run's --dtype auto computes in float32 on a CPU), float16 (fp16, half) "
                        "or float32 (fp32, float); the output's header names it")
    p.add_argument("--seed", type=int, default=0, help="weights, token ids and KV contents (default 0)")
    p.add_argument("--page-size", type=int, default=16, help="KV page size (default 16)")
    p.add_argument("--layer-depth", type=int, default=None,
                   help="second decoder-layer count for per-layer figures (default: half the model's layers)")
    p.add_argument("--hf-batch-sizes", default=None, help="DECODE batch sizes the hf peer runs (default: all)")
    p.add_argument("--hf-layer-batch-sizes", default="1",
                   help="DECODE batch sizes the hf peer also runs at the second depth (default 1)")
    p.add_argument("--hf-budget-s", type=float, default=150.0,
                   help="seconds per model the hf peer may spend compiling and timing (default 150)")
    p.add_argument("--copy-bytes", type=int, default=None, help="bytes of the bandwidth copy (default 2 GiB; CPU "
                                                                "64 MiB)")
    p.add_argument("--out", default=None, help="output directory (default ./lowlat-bench-<UTC timestamp>, or "
                                               "./<--name>, in the current directory)")
    p.add_argument("--name", default=None, help="name of the default output directory (in the current directory)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--report", metavar="RESULTS_JSON", default=None,
                   help="print the markdown table of an earlier run's results.json and exit")


def config_from_args(args: argparse.Namespace) -> Any:
    """A BenchConfig from parsed flags. Raises ConfigError / ValueError on bad values."""
    import torch

    from lowlat.bench.config import BenchConfig, parse_int_list, parse_modes

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")

    def ints(text: str | None, what: str) -> tuple[int, ...] | None:
        return None if text is None else parse_int_list(text, what)

    def names(text: str | None) -> tuple[str, ...] | None:
        return None if text is None else tuple(t.strip() for t in text.split(",") if t.strip())

    return BenchConfig.with_defaults(
        device, models=names(args.model), paths=names(args.paths), batch_sizes=ints(args.batch_sizes, "--batch-sizes"),
        modes=parse_modes(args.modes), verify_tokens=args.verify_tokens,
        verify_batch_sizes=ints(args.verify_batch_sizes, "--verify-batch-sizes"), context=args.context,
        input_sets=args.input_sets, warmup=args.warmup, iters=args.iters, dtype=args.dtype, seed=args.seed,
        page_size=args.page_size, layer_depth=args.layer_depth,
        hf_batch_sizes=ints(args.hf_batch_sizes, "--hf-batch-sizes"),
        hf_layer_batch_sizes=ints(args.hf_layer_batch_sizes, "--hf-layer-batch-sizes"),
        hf_budget_s=args.hf_budget_s, copy_bytes=args.copy_bytes,
    )


def command_line(args: argparse.Namespace) -> list[str]:
    """The command as flags (every flag that is set, defaults included), for the results' metadata."""
    out = ["lowlat", "bench"]
    for key, value in vars(args).items():
        if key in ("func", "command", "bench_command") or value is None or value is False:
            continue
        out += [f"--{key.replace('_', '-')}"] + ([] if value is True else [str(value)])
    return out


@one_line_errors("bench")
def run(args: argparse.Namespace) -> int:
    """Run ``lowlat bench``. Returns 0; 1 when a lowlat path asked for could not start (a plugin that fails to build
    or is not installed; its rows are skipped, the others measured and every file written); or 2 after printing one
    error line (LOWLAT_DEBUG=1 re-raises)."""
    from lowlat.bench.report import load_results, print_table, render_markdown

    if args.report:
        print(render_markdown(load_results(args.report)), end="")
        return 0
    from lowlat.bench.harness import default_out_dir, run_bench

    cfg = config_from_args(args)
    out = Path(args.out) if args.out else default_out_dir(args.name)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if args.device == "auto" and cfg.device == "cpu":  # say so at once: a GPU command run here by mistake is slow
        log("[bench] no CUDA GPU here: measuring on the CPU (figures check the harness only; plugins need "
            "TRITON_INTERPRET=1, hf is skipped; a GPU-sized preset takes seconds per step). --device cpu says so "
            "and silences this line")
    results = run_bench(cfg, out_dir=out, command=command_line(args), plot=not args.no_plot, log=log)
    print_table(results)
    unstarted = sorted({f"{r['model']} {r['path']}" for r in results["rows"]
                        if r.get("status") == "skipped" and " could not start: " in str(r.get("reason"))})
    if unstarted:  # the table and files are written; a script must still see that an asked-for path never ran
        log(f"[bench] exit status 1: {', '.join(unstarted)} could not start (the reasons are under the table)")
        return 1
    return 0
