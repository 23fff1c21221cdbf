"""Prompt and draft token checks the Engine runs on the calling rank, before anything is mirrored or queued
(``prepare_prompts``: the whole of ``generate``/``add_request``'s input check)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from lowlat.runtime.sampling import SamplingParams
from lowlat.runtime.step_guard import check_text


def as_token_ids(p: object, i: int) -> list[int]:
    """Prompt ``i`` given as token ids (a sequence of ints or a tensor) as a list. Raises TypeError otherwise."""
    if isinstance(p, torch.Tensor):
        p = p.tolist()
    if not isinstance(p, Sequence) or not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        raise TypeError(f"prompt {i} must be a string or a list of int token ids")
    return list(p)


def check_token_ids(toks: list[int], what: str, vocab: int, model: str) -> None:
    """Raise ValueError when ``toks`` is empty or holds an id outside ``[0, vocab)`` (``what`` names them)."""
    if not toks:
        raise ValueError(f"{what} is empty; give at least one token")
    bad = [t for t in toks if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"{what} has token id {bad[0]} outside the vocabulary [0, {vocab}) of {model}")



def prepare_prompts(prompts: object, params: object, tokenizer: Any, vocab: int, config: Any,
                    check_fits: Callable[[int, int], None]) -> tuple[list[list[int]], list[SamplingParams]]:
    """Tokenize and validate the Engine's ``generate``/``add_request`` input (on the calling rank).

    Args:
        prompts: strings or token-id sequences. params: one SamplingParams, one per prompt, or None (defaults).
        tokenizer: has ``encode(str) -> list[int]``. vocab: the model's vocabulary size.
        config: the EngineConfig (``model``, ``max_context_len``).
        check_fits: ``fn(i, tokens)`` raising when prompt i's request of that many KV tokens can never fit.
    Returns:
        (token ids per prompt, SamplingParams per prompt).
    Raises:
        TypeError: prompts or params of the wrong type. ValueError: no prompts, bad text or token ids, or a
            prompt that with its max_new_tokens exceeds max_context_len (names it and the fix).
    """
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise TypeError("prompts must be a list of strings or a list of token-id lists")
    if not prompts:
        raise ValueError("no prompts given")
    if params is None:
        params = SamplingParams()
    plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)  # type: ignore[call-overload]
    if len(plist) != len(prompts) or not all(isinstance(p, SamplingParams) for p in plist):
        raise TypeError(f"params must be one SamplingParams or one per prompt ({len(prompts)})")
    ids = []
    for i, (p, sp) in enumerate(zip(prompts, plist)):
        toks = tokenizer.encode(check_text(p, i)) if isinstance(p, str) else as_token_ids(p, i)
        check_token_ids(toks, f"prompt {i}", vocab, config.model)
        if len(toks) + sp.max_new_tokens > config.max_context_len:
            raise ValueError(f"prompt {i} has {len(toks)} tokens; with max_new_tokens={sp.max_new_tokens} that "
                             f"exceeds max_context_len={config.max_context_len}; shorten the prompt, "
                             "lower max_new_tokens or raise max_context_len")
        check_fits(i, len(toks) + sp.max_new_tokens - 1)
        ids.append(toks)
    return ids, plist
