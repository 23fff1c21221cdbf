"""``lowlat bench serve``: per-user decode speed under concurrent streaming users (``lowlat.bench.serve_bench``).

Either ``--url`` (a running OpenAI-compatible server), or ``--paths`` (each path gets its own ``lowlat serve``
subprocess, started and stopped here; with ``--speculative METHOD`` two per path, speculation off and on). Flags
left unset take the device's defaults (``serve_bench.GPU_DEFAULTS`` / ``CPU_DEFAULTS``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from lowlat.cli.errors import one_line_errors
from lowlat.config import DTYPES, dtype_name


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``serve`` to ``lowlat bench``'s subcommands; sets ``func=run``."""
    p = subparsers.add_parser(
        "serve", help="per-user decode speed of a server under 1..8 concurrent streaming users",
        description="Drive a running server (--url) or start one `lowlat serve` per path, with concurrent "
                    "streaming clients at each concurrency over random prompts of --input-len tokens, "
                    "--output-len tokens each (warm-up excluded). Reports TTFT, TPOT, ITL, end-to-end latency, "
                    "per-user decode tok/s, throughput and plugin/general ratios; writes results.json, results.md "
                    "and results.png.")
    p.add_argument("--url", default=None, help="measure this running server (e.g. http://127.0.0.1:8000) instead "
                                               "of starting one per path")
    p.add_argument("--label", default="server", help="name of the --url server's path in the results")
    p.add_argument("--paths", default=None,
                   help="comma-separated: general, a plugin name, plugins (every installed plugin); "
                        "default general,plugins on a GPU, general on a CPU")
    p.add_argument("--model", default=None, help="preset, checkpoint dir or cached HF repo id (default llama-3.2-1b "
                                                 "on a GPU, tiny-llama on a CPU)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="default auto")
    p.add_argument("--dtype", type=dtype_name, choices=("auto", *DTYPES), default="auto",
                   help="default auto (the checkpoint's dtype on a GPU, float32 on a CPU); aliases bf16, fp16, "
                        "half, fp32, float")
    p.add_argument("--input-len", type=int, default=None, help="prompt tokens per request (default 8192; CPU 32)")
    p.add_argument("--output-len", type=int, default=None, help="tokens generated per request (default 1024; CPU 16)")
    p.add_argument("--concurrency", default=None, help="comma-separated levels (default 1,2,4,8; CPU 1,2)")
    p.add_argument("--requests", type=int, default=None,
                   help="measured requests per concurrency level (default max(4 x concurrency, 8)); lower it to fit "
                        "a time budget")
    p.add_argument("--warmup", type=int, default=None,
                   help="warm-up requests per level, excluded (default: one per concurrent user)")
    p.add_argument("--seed", type=int, default=0, help="preset weights and prompt token ids (default 0)")
    p.add_argument("--start-timeout", type=float, default=1200.0,
                   help="seconds a started server may take to become ready (default 1200)")
    p.add_argument("--serve-arg", action="append", default=[], metavar="FLAG",
                   help="extra flag for each started lowlat serve, repeatable (e.g. --serve-arg=--no-cuda-graph)")
    p.add_argument("--speculative", metavar="METHOD", default=None,
                   help="also serve each path with this drafter (ngram, draft:PATH, simulated:MEAN; simulated is "
                        "for benchmarks only): per-user speed with speculation on and off, and the acceptance")
    p.add_argument("--num-draft-tokens", metavar="K", type=int, default=None,
                   help="draft tokens per VERIFY step of the speculative servers (default: lowlat serve's)")
    p.add_argument("--speculative-only", action="store_true",
                   help="with --speculative: skip the plain servers (their figures come from another run)")
    p.add_argument("--out", default=None, help="output directory (default ./lowlat-bench-serve-<UTC timestamp>, "
                                               "or ./<--name>, in the current directory)")
    p.add_argument("--name", default=None, help="name of the default output directory (in the current directory)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.set_defaults(func=run)
    return p


def config_from_args(args: argparse.Namespace) -> Any:
    import torch

    from lowlat.bench.config import ALL_PLUGINS, parse_int_list
    from lowlat.bench.harness import expand_paths
    from lowlat.bench.serve_bench import CPU_DEFAULTS, GENERAL, GPU_DEFAULTS, ServeBenchConfig

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    d = GPU_DEFAULTS if device == "cuda" else CPU_DEFAULTS
    names = (args.paths or (f"{GENERAL},{ALL_PLUGINS}" if device == "cuda" else GENERAL)).split(",")
    paths = tuple(expand_paths(tuple(n.strip() for n in names if n.strip())))
    conc = parse_int_list(args.concurrency, "--concurrency") if args.concurrency else d["concurrency"]
    return ServeBenchConfig(
        model=args.model or d["model"], device=device, input_len=args.input_len or d["input_len"],
        output_len=args.output_len or d["output_len"], concurrency=tuple(conc), paths=paths, url=args.url,
        label=args.label, requests=args.requests, warmup=args.warmup, dtype=args.dtype, seed=args.seed,
        start_timeout_s=args.start_timeout, serve_args=tuple(args.serve_arg), speculative=args.speculative,
        num_draft_tokens=args.num_draft_tokens, speculative_only=args.speculative_only,
    )


@one_line_errors("bench serve")
def run(args: argparse.Namespace) -> int:
    """Run ``lowlat bench serve``; prints the markdown table. Returns 0 (2 after one error line)."""
    from lowlat.bench.harness import default_out_dir
    from lowlat.bench.serve_bench import run_serve_bench

    try:
        import httpx  # noqa: F401
    except ImportError:
        raise RuntimeError("lowlat bench serve needs httpx: pip install 'lowlat[serve,bench]' (from a lowlat "
                           "checkout's root: pip install -e 'core[serve,bench]')") from None
    cfg = config_from_args(args)
    out = Path(args.out) if args.out else default_out_dir(args.name, "lowlat-bench-serve")

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    results = run_serve_bench(cfg, out_dir=out, command=["lowlat", "bench", "serve", *sys.argv[3:]]
                              if sys.argv[1:3] == ["bench", "serve"] else None, plot=not args.no_plot, log=log)
    from lowlat.bench.serve_report import render_serve_markdown

    print(render_serve_markdown(results), end="")
    return 0 if not results["skipped"] and not any(lv["errors"] for lv in results["levels"]) else 1
