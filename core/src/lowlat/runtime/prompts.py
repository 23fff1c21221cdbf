"""Prompt and draft token checks the Engine runs on the calling rank, before anything is mirrored or queued."""

from __future__ import annotations

from collections.abc import Sequence

import torch


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
