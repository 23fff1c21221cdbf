"""``make_drafter``: the drafter ``EngineConfig.speculative_method`` names (ngram, simulated or a draft model).

Apart from ``drafter.py`` (the interface the drafters implement), so the interface never imports them.
"""

from __future__ import annotations

from typing import Any

from lowlat.config import ConfigError, EngineConfig, parse_method
from lowlat.runtime.speculative.drafter import Drafter


def make_drafter(config: EngineConfig, ctx: Any = None) -> Drafter:
    """The drafter ``config.speculative_method`` names.

    Args:
        config: the engine's configuration (speculative on).
        ctx: the engine's ``tp_launch.TPContext`` (None without tensor parallelism); a draft model shards with it.

    Raises:
        ConfigError: a bad method string, or a draft model whose vocabulary differs from the target's.
    """
    from lowlat.loader import resolve_model

    spec = parse_method(config.speculative_method or "ngram")
    vocab = resolve_model(config.model).vocab_size
    k = config.draft_tokens
    if spec.kind == "ngram":
        from lowlat.runtime.speculative.ngram import NgramDrafter

        return NgramDrafter(n=config.ngram_n, window=config.ngram_window, max_len=config.max_context_len)
    if spec.kind == "simulated":
        from lowlat.runtime.speculative.simulated import SimulatedDrafter

        return SimulatedDrafter(spec.mean, k=k, vocab_size=vocab, seed=config.seed)
    if spec.kind == "draft":
        from lowlat.runtime.speculative.draft_model import DraftModelDrafter

        draft_vocab = resolve_model(spec.path).vocab_size
        if draft_vocab != vocab:
            raise ConfigError(f"draft model {spec.path} has vocab_size={draft_vocab} but {config.model} has {vocab}; "
                              "a draft model needs the target's tokenizer (the same vocabulary)")
        return DraftModelDrafter(config, spec.path, ctx)
    raise ConfigError(f"unknown speculative method {spec.kind!r}")
