"""The speculative-decoding flags, shared by ``lowlat run`` (and ``lowlat serve``, which can reuse them).

``add_speculative_args(parser)`` adds the flags; ``speculative_config(args)`` turns them into EngineConfig keyword
arguments (``EngineConfig(**base, **speculative_config(args))``).
"""

from __future__ import annotations

import argparse
from typing import Any

from lowlat.config import SPECULATIVE_FORMS, EngineConfig


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    """Add --speculative, --num-draft-tokens, --ngram-n, --ngram-window and --no-spec-adaptive to ``p``."""
    d = EngineConfig()
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--speculative", metavar="METHOD", default=None,
                   help=f"speculate with a drafter: {SPECULATIVE_FORMS}; simulated is for benchmarks only (its "
                        "text is not the model's); default off")
    g.add_argument("--num-draft-tokens", metavar="K", type=int, default=None,
                   help=f"draft tokens per request and VERIFY step, 1..{d.max_verify_tokens - 1} (K + 1 rows per "
                        f"request must fit max_verify_tokens={d.max_verify_tokens}); default {d.draft_tokens}")
    g.add_argument("--ngram-n", type=int, default=d.ngram_n,
                   help=f"n-gram drafter: longest suffix matched (default {d.ngram_n})")
    g.add_argument("--ngram-window", type=int, default=d.ngram_window,
                   help=f"n-gram drafter: tokens searched back from the last one (default {d.ngram_window})")
    g.add_argument("--no-spec-adaptive", action="store_true",
                   help="always speculate (no fallback to plain DECODE steps when speculation is measured slower)")


def speculative_config(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig keyword arguments from the flags of ``add_speculative_args`` (empty when --speculative is off).

    Raises:
        ConfigError (from EngineConfig) on bad values; here: --num-draft-tokens without --speculative.
    """
    if args.speculative is None:
        if args.num_draft_tokens is not None:
            from lowlat.config import ConfigError

            raise ConfigError("--num-draft-tokens needs --speculative (ngram, draft:PATH or simulated:MEAN)")
        return {}
    return {"speculative_method": args.speculative, "num_draft_tokens": args.num_draft_tokens,
            "ngram_n": args.ngram_n, "ngram_window": args.ngram_window,
            "speculative_adaptive": not args.no_spec_adaptive}
