"""``lowlat run``: generate completions for prompts and print them with a timing summary.

Argument handling lives in ``add_arguments`` (flags) and ``configs_from_args`` (flags -> EngineConfig,
SamplingParams, prompts), so new flags touch those two functions only.
"""

from __future__ import annotations

import argparse
from typing import Any

from lowlat.cli.errors import one_line_errors
from lowlat.config import DTYPES, EngineConfig

DEFAULT_PROMPT = "The quick brown fox"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``run`` subcommand to ``subparsers`` (from ``ArgumentParser.add_subparsers``); sets ``func=run``."""
    p = subparsers.add_parser("run", help="generate completions for prompts and print timings",
                              description="Generate completions with the lowlat engine and print a timing summary.")
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``lowlat run``."""
    d = EngineConfig()
    p.add_argument("--model", default="tiny-llama", help="HF checkpoint directory or preset name (default tiny-llama)")
    p.add_argument("--prompt", action="append", default=None,
                   help=f"a prompt; repeat for a batch (default: {DEFAULT_PROMPT!r})")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate per prompt (default 32)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 keeps all (default 0)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of preset weights and sampling (default 0)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default=d.device, help="default auto")
    p.add_argument("--dtype", choices=("auto", *DTYPES), default=d.dtype, help="default auto")
    p.add_argument("--tp", type=int, default=d.tp_size, help="tensor-parallel ranks (default 1)")
    p.add_argument("--max-batch-size", type=int, default=d.max_batch_size, help=f"default {d.max_batch_size}")
    p.add_argument("--max-context-len", type=int, default=d.max_context_len, help=f"default {d.max_context_len}")
    p.add_argument("--page-size", type=int, default=d.page_size, help=f"KV page size (default {d.page_size})")
    p.add_argument("--no-cuda-graph", action="store_true", help="run every step eagerly")
    p.add_argument("--plugin", default="auto",
                   help="auto (first plugin whose guard passes), none (general path only) or a plugin name "
                        "(fails before loading weights if it cannot run here); default auto")
    p.add_argument("--step-timeout", type=float, default=None, metavar="S",
                   help="deadline of one step in seconds; a step that misses it stops the engine with an error "
                        "naming the step and the plugin or rank (default: LOWLAT_STEP_TIMEOUT, else 60)")
    p.add_argument("--compare", action="store_true",
                   help="run the prompts greedily on the general path and with the plugin, and compare tokens, "
                        "logits and decode speed")


def configs_from_args(args: argparse.Namespace) -> tuple[EngineConfig, Any, list[str]]:
    """(EngineConfig, SamplingParams, prompts) from parsed flags. Raises ConfigError/ValueError on bad values."""
    from lowlat.runtime.sampling import SamplingParams

    config = EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, tp_size=args.tp, page_size=args.page_size,
        max_batch_size=args.max_batch_size, max_context_len=args.max_context_len,
        cuda_graph=not args.no_cuda_graph, seed=args.seed, plugin=args.plugin,
        step_timeout_s=getattr(args, "step_timeout", None),
    )
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k)
    return config, params, list(args.prompt or [DEFAULT_PROMPT])


@one_line_errors("run")
def run(args: argparse.Namespace) -> int:
    """Run ``lowlat run``. Returns 0, or 2 after printing one error line (LOWLAT_DEBUG=1 re-raises)."""
    from lowlat.runtime.engine import Engine

    config, params, prompts = configs_from_args(args)
    if args.compare:
        return _compare(config, params, prompts)
    with Engine(config) as engine:
        completions = engine.generate(prompts, params)
        if engine.rank == 0:
            _print_results(engine, prompts, completions)
    return 0


def _compare(config: EngineConfig, params: Any, prompts: list[str]) -> int:
    """``--compare``: print the report; exit 0 when the greedy tokens are identical, 1 when not."""
    from lowlat.cli.compare import compare

    report = compare(config, params, prompts)
    for line in report.lines():
        print(line)
    return 0 if report.identical else 1


def _printable(text: str) -> str:
    """``text`` with control characters (other than newline and tab) shown as escapes."""
    return "".join(c if c.isprintable() or c in "\n\t" else c.encode("unicode_escape").decode() for c in text)


def _print_results(engine: Any, prompts: list[str], completions: list[Any]) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console()
    runner = engine.runner
    console.print(Text(f"model {engine.config.model} ({engine.model_config.architecture}) on {runner.device}, "
                       f"{str(runner.dtype).removeprefix('torch.')}, tp={engine.config.tp_size}, "
                       f"CUDA graphs {'on' if runner.graph_runner is not None else 'off'}"))
    sel = runner.plugin_host.selection
    console.print(Text(f"plugin {sel.plugin.name} ({sel.plugin.distribution} {sel.plugin.version}): {sel.reason}"
                       if sel else f"plugin: none ({engine.config.plugin}: every step on the general path)"))
    for line in runner.plugin_host.rejections:
        console.print(Text(f"  auto skipped {line}", style="dim"))
    for prompt, c in zip(prompts, completions):
        console.print(Text(f"\n[{c.request_id}] ", style="bold") + Text(_printable(prompt), style="cyan")
                      + Text(_printable(c.text)))
    table = Table(title="requests")
    for col in ("id", "prompt tok", "new tok", "finish", "prefill ms", "decode ms", "decode tok/s"):
        table.add_column(col, justify="right")
    for c in completions:
        table.add_row(str(c.request_id), str(len(c.prompt_token_ids)), str(len(c.token_ids)), c.finish_reason,
                      f"{1e3 * c.prefill_s:.2f}", f"{1e3 * c.decode_s:.2f}", f"{c.decode_tokens_per_s:.1f}")
    console.print(table)
    steps = Table(title="steps by forward mode and path")
    for col in ("mode", "path", "steps", "graph replays", "tokens", "ms/step"):
        steps.add_column(col, justify="right")
    for (path, mode), row in sorted(engine.stats.by_path.items(), key=lambda kv: (kv[0][1].name, kv[0][0])):
        steps.add_row(mode.name, path, str(row.steps), str(row.graph_steps), str(row.tokens), f"{row.ms_per_step:.3f}")
    console.print(steps)
