"""``lowlat run``: generate completions for prompts, streaming the text as it comes, with a timing summary.

Argument handling lives in ``add_engine_arguments`` (the engine flags, shared with ``lowlat serve``),
``add_arguments`` (the rest) and ``configs_from_args`` (flags -> EngineConfig, SamplingParams, prompts), so new
flags touch those functions only. The generation loop is ``lowlat.cli.streaming.stream_generate``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from lowlat.cli.errors import one_line_errors
from lowlat.cli.spec_args import add_speculative_args, speculative_config
from lowlat.config import ALL_REDUCES, DTYPES, EngineConfig, dtype_name

DEFAULT_PROMPT = "The quick brown fox"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``run`` subcommand to ``subparsers`` (from ``ArgumentParser.add_subparsers``); sets ``func=run``."""
    p = subparsers.add_parser("run", help="generate completions for prompts and print timings",
                              description="Generate completions with the lowlat engine, streaming each token as it "
                                          "comes, and print a timing summary (or JSON with --json).")
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def add_engine_arguments(p: argparse.ArgumentParser, *, default_model: str = "tiny-llama") -> None:
    """The flags that make an EngineConfig (``lowlat run`` and ``lowlat serve``)."""
    d = EngineConfig()
    p.add_argument("--model", default=default_model,
                   help=f"HF checkpoint directory, preset name, or HF repo id in the local HF cache "
                        f"(default {default_model})")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of preset weights and sampling (default 0)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default=d.device, help="default auto")
    p.add_argument("--dtype", type=dtype_name, choices=("auto", *DTYPES), default=d.dtype,
                   help="auto (the default: the checkpoint's dtype on a GPU, always float32 on a CPU), bfloat16 "
                        "(bf16), float16 (fp16, half) or float32 (fp32, float)")
    p.add_argument("--tp", type=int, default=d.tp_size, help="tensor-parallel ranks (default 1)")
    p.add_argument("--max-batch-size", type=int, default=d.max_batch_size, help=f"default {d.max_batch_size}")
    p.add_argument("--max-context-len", type=int, default=d.max_context_len, help=f"default {d.max_context_len}")
    p.add_argument("--page-size", type=int, default=d.page_size, help=f"KV page size (default {d.page_size})")
    p.add_argument("--no-cuda-graph", action="store_true", help="run every step eagerly")
    p.add_argument("--no-overlap", action="store_true",
                   help="run DECODE steps one after another, reading each step's tokens before scheduling the "
                        "next (default: overlapped on CUDA, lowlat.runtime.overlap)")
    p.add_argument("--plugin", default="auto",
                   help="auto (the plugins made for this platform whose guard passes, tried by name), "
                        "none (general path only) or a plugin name "
                        "(fails before loading weights if it cannot run here); default auto")
    p.add_argument("--all-reduce", choices=ALL_REDUCES, default=d.all_reduce,
                   help="how the general path sums row-parallel outputs over --tp ranks: nccl (the default; gloo "
                        "on CPU) or peer (a one-shot all-reduce over peer buffers for DECODE/VERIFY steps; not "
                        "measured on two GPUs yet)")
    p.add_argument("--step-timeout", type=float, default=None, metavar="S",
                   help="deadline of one step in seconds; a step that misses it stops the engine with an error "
                        "naming the step and the plugin or rank (default: LOWLAT_STEP_TIMEOUT, else 60)")
    add_speculative_args(p)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``lowlat run``."""
    add_engine_arguments(p)
    p.add_argument("--prompt", action="append", default=None,
                   help=f"a prompt; repeat for a batch (default: {DEFAULT_PROMPT!r})")
    p.add_argument("--prompt-file", default=None, metavar="PATH",
                   help="read prompts from PATH, one per line (blank lines skipped); '-' reads stdin")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate per prompt (default 32)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 keeps all (default 0)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop a completion at TEXT (not included); repeat for several")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object per completion (text, token_ids, finish_reason, timings), then "
                        "one with the run's step stats, instead of the streamed text and tables")
    p.add_argument("--compare", action="store_true",
                   help="run the prompts greedily on the general path and with the plugin, and compare tokens, "
                        "logits and decode speed; exits 0 when the tokens are identical or each request's first "
                        "differing token is a near-tie of the general path's logits within the contract's bound "
                        "(docs/contract.md), 1 on any other difference")
    p.add_argument("--compare-strict", action="store_true",
                   help="--compare, but exit 1 on any differing token, near-ties included")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of the engine flags; ``--model`` as an HF repo id resolves to its cached snapshot."""
    from lowlat.serve.hf_cache import resolve_model_path

    return EngineConfig(
        model=resolve_model_path(args.model), device=args.device, dtype=args.dtype, tp_size=args.tp,
        page_size=args.page_size, max_batch_size=args.max_batch_size, max_context_len=args.max_context_len,
        cuda_graph=not args.no_cuda_graph, overlap=False if args.no_overlap else None, seed=args.seed,
        plugin=args.plugin, step_timeout_s=getattr(args, "step_timeout", None),
        all_reduce=getattr(args, "all_reduce", "nccl"), **speculative_config(args),
    )


def read_prompts(args: argparse.Namespace) -> list[str]:
    """--prompt values, then --prompt-file lines; the default prompt when neither is given."""
    prompts = list(args.prompt or [])
    if getattr(args, "prompt_file", None):
        if args.prompt_file == "-":
            text = sys.stdin.read()
        else:
            try:
                with open(args.prompt_file, encoding="utf-8") as f:
                    text = f.read()
            except OSError as e:
                raise ValueError(f"--prompt-file {args.prompt_file}: {e.strerror}") from None
        prompts += [line for line in text.splitlines() if line.strip()]
        if not prompts:
            raise ValueError(f"--prompt-file {args.prompt_file} holds no prompts (blank lines are skipped)")
    return prompts or [DEFAULT_PROMPT]


def configs_from_args(args: argparse.Namespace) -> tuple[EngineConfig, Any, list[str]]:
    """(EngineConfig, SamplingParams, prompts) from parsed flags. Raises ConfigError/ValueError on bad values."""
    from lowlat.runtime.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, stop_at_eos=not getattr(args, "ignore_eos", False))
    return engine_config_from_args(args), params, read_prompts(args)


@one_line_errors("run")
def run(args: argparse.Namespace) -> int:
    """Run ``lowlat run``. Returns 0, or 2 after printing one error line (LOWLAT_DEBUG=1 re-raises)."""
    from lowlat.cli.streaming import stream_generate
    from lowlat.runtime.engine import Engine

    config, params, prompts = configs_from_args(args)
    if args.compare or args.compare_strict:
        return _compare(config, params, prompts, strict=args.compare_strict)
    stop = [s for s in (args.stop or []) if s]
    with Engine(config) as engine:
        show = engine.rank == 0 and not args.json
        if show and len(prompts) == 1:  # one prompt: its tokens go straight to stdout
            sys.stdout.write(f"\n[0] {_printable(prompts[0])}")
            sys.stdout.flush()

            def on_text(index: int, text: str) -> None:
                sys.stdout.write(_printable(text))
                sys.stdout.flush()

            completions = stream_generate(engine, prompts, params, stop=stop, on_text=on_text)
            sys.stdout.write("\n")
            streamed = True
        elif show and sys.stdout.isatty():  # several on a terminal: one live line per prompt
            completions, streamed = _live(engine, prompts, params, stop), True
        else:
            completions, streamed = stream_generate(engine, prompts, params, stop=stop), False
        if engine.rank == 0:
            if args.json:
                _print_json(engine, prompts, completions)
            else:
                _print_results(engine, prompts, completions, texts=not streamed)
    return 0


def _live(engine: Any, prompts: list[str], params: Any, stop: list[str]) -> list[Any]:
    """Generate with a rich Live view: each prompt's line grows as its tokens come."""
    from rich.console import Group
    from rich.live import Live
    from rich.text import Text

    from lowlat.cli.streaming import stream_generate

    texts = [""] * len(prompts)

    def view() -> Group:
        return Group(*(Text(f"[{i}] ", style="bold") + Text(_printable(p), style="cyan") + Text(_printable(t))
                       for i, (p, t) in enumerate(zip(prompts, texts))))

    with Live(view(), refresh_per_second=12) as live:
        def on_text(index: int, text: str) -> None:
            texts[index] += text
            live.update(view())

        return stream_generate(engine, prompts, params, stop=stop, on_text=on_text)


def _compare(config: EngineConfig, params: Any, prompts: list[str], *, strict: bool = False) -> int:
    """``--compare``: print the report and its verdict; exit 0 when the greedy tokens are identical or (unless
    ``strict``) differ first at near-ties within the bound, 1 otherwise (``CompareReport.exit_status``)."""
    from lowlat.cli.compare import compare

    report = compare(config, params, prompts)
    for line in report.lines():
        print(line)
    print(report.verdict(strict))
    return report.exit_status(strict)


def _printable(text: str) -> str:
    """``text`` with control characters (other than newline and tab) shown as escapes."""
    return "".join(c if c.isprintable() or c in "\n\t" else c.encode("unicode_escape").decode() for c in text)


def _print_json(engine: Any, prompts: list[str], completions: list[Any]) -> None:
    for i, (prompt, c) in enumerate(zip(prompts, completions)):
        print(json.dumps({
            "type": "completion", "index": i, "request_id": c.request_id, "prompt": prompt, "text": c.text,
            "prompt_token_ids": c.prompt_token_ids, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
            "timings": {"queue_s": c.queue_s, "prefill_s": c.prefill_s, "decode_s": c.decode_s,
                        "decode_tokens": c.decode_tokens, "decode_tokens_per_s": c.decode_tokens_per_s},
        }, ensure_ascii=False))
    spec = getattr(engine, "speculator", None)  # acceptance, VERIFY steps per path, the off-switch (or null)
    print(json.dumps({"type": "stats", "model": engine.config.model, "by_mode": engine.stats.as_dict(),
                      "by_path": engine.stats.paths_as_dict(),
                      "overlap": getattr(engine, "overlap", None) is not None,
                      "all_reduce": _all_reduce_stats(engine),
                      "speculative": spec.as_dict(engine) if spec is not None else None}))


def _all_reduce_stats(engine: Any) -> dict[str, Any]:
    """The all-reduce the general path uses, and how many of this rank's sums took the peer buffers."""
    peer = getattr(engine.runner, "peer", None)
    return {"mode": engine.config.all_reduce, "peer_sums": peer.calls if peer is not None else 0}


def _print_results(engine: Any, prompts: list[str], completions: list[Any], *, texts: bool = True) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console()
    runner = engine.runner
    dtype, ckpt = str(runner.dtype).removeprefix("torch."), engine.model_config.torch_dtype
    if engine.config.dtype == "auto" and ckpt and ckpt != dtype:  # e.g. a bf16 checkpoint on a CPU
        dtype += f" (the checkpoint's {ckpt}" + (f"; --dtype {ckpt} keeps it)" if ckpt in DTYPES else ")")
    tp = engine.config.tp_size
    way = engine.config.all_reduce  # "nccl" is torch.distributed, whose backend on a CPU is gloo
    way = f"torch.distributed over {'gloo' if runner.device.type == 'cpu' else 'nccl'}" if way == "nccl" else way
    reduce = f" (general path all-reduce: {way})" if tp > 1 else ""
    console.print(Text(f"model {engine.config.model} ({engine.model_config.architecture}) on {runner.device}, "
                       f"{dtype}, tp={tp}{reduce}, "
                       f"CUDA graphs {'on' if runner.graph_runner is not None else 'off'}, "
                       f"overlapped loop {'on' if getattr(engine, 'overlap', None) is not None else 'off'}"))
    path = runner.plugin_host.describe(engine.config.plugin)  # lowlat serve prints the same at startup
    console.print(Text(path["summary"]))
    for line in path["skipped"]:
        console.print(Text(f"  auto skipped {line}", style="dim"))
    spec = engine.speculator
    if spec is not None:
        console.print(Text(spec.header(), style="bold yellow" if spec.stats.simulated else ""))
    if texts:
        for prompt, c in zip(prompts, completions):
            console.print(Text(f"\n[{c.request_id}] ", style="bold") + Text(_printable(prompt), style="cyan")
                          + Text(_printable(c.text)))
    # two tok/s figures when speculating: this one per request, the speculative summary's for the whole batch
    table = Table(title="requests", caption="decode tok/s: per request, its tokens after the first over its decode "
                                            "time" + (" (rejected drafts not counted)" if spec is not None else ""))
    for col in ("id", "prompt tok", "new tok", "finish", "prefill ms", "decode ms", "decode tok/s"):
        table.add_column(col, justify="right")
    for c in completions:
        table.add_row(str(c.request_id), str(len(c.prompt_token_ids)), str(len(c.token_ids)), c.finish_reason,
                      f"{1e3 * c.prefill_s:.2f}", f"{1e3 * c.decode_s:.2f}", f"{c.decode_tokens_per_s:.1f}")
    console.print(table)
    verify = any(mode.name == "VERIFY" for _, mode in engine.stats.by_path)
    steps = Table(title="steps by forward mode and path",
                  caption="tokens: rows the steps ran (VERIFY: every verified row, rejected drafts included)"
                  if verify else None)
    for col in ("mode", "path", "steps", "graph replays", "tokens", "ms/step"):
        steps.add_column(col, justify="right")
    for (path, mode), row in sorted(engine.stats.by_path.items(), key=lambda kv: (kv[0][1].name, kv[0][0])):
        steps.add_row(mode.name, path, str(row.steps), str(row.graph_steps), str(row.tokens), f"{row.ms_per_step:.3f}")
    console.print(steps)
    if spec is not None:
        for line in spec.summary(engine):
            console.print(Text(line, style="bold yellow" if "SIMULATED" in line else ""))
