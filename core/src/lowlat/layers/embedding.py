"""Vocab-parallel token embedding and LM head (Megatron-LM's VocabParallelEmbedding).

Each rank holds ``V_l = ceil(V / tp)`` rows: rank ``r`` owns token ids ``[r * V_l, (r + 1) * V_l)``; rows past
``V`` (the last rank's padding) are zero. The embedding looks up the ids it owns, zeroes the rest and
all-reduces; the LM head's logits are all-gathered and trimmed to ``V`` (``lowlat.layers.logits``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lowlat.distributed import TPInfo, all_reduce
from lowlat.layers.weights import WeightTarget


def local_vocab(vocab_size: int, tp: TPInfo) -> int:
    """Rows of the vocab each rank holds: ceil(vocab_size / tp.size)."""
    return -(-vocab_size // tp.size)


def vocab_target(weight: torch.Tensor, vocab_size: int, tp: TPInfo, **kw: object) -> WeightTarget:
    """Target that loads rank ``tp.rank``'s rows of a [vocab_size, H] checkpoint tensor into ``weight`` [V_l, H]."""
    v_l = weight.shape[0]
    start = tp.rank * v_l
    n = max(0, min(vocab_size, start + v_l) - start)

    def load(t: torch.Tensor) -> None:
        weight[:n].copy_(t[start:start + n])
        weight[n:].zero_()

    return WeightTarget((vocab_size, weight.shape[1]), load, **kw)  # type: ignore[arg-type]


class VocabParallelEmbedding(nn.Module):
    """ids [T] int64 -> hidden [T, H]. ``weight`` [V_l, H]."""

    def __init__(self, vocab_size: int, hidden: int, *, tp: TPInfo, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.vocab_size, self.tp = vocab_size, tp
        v_l = local_vocab(vocab_size, tp)
        self.start = tp.rank * v_l
        self.weight = nn.Parameter(torch.empty(v_l, hidden, dtype=dtype, device=device), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        owned = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(torch.where(owned, local, 0), self.weight)
        out = out * owned[:, None].to(out.dtype)
        return all_reduce(out, self.tp)

    def hf_targets(self, prefix: str) -> dict[str, WeightTarget]:
        return {prefix + "weight": vocab_target(self.weight, self.vocab_size, self.tp)}


class ParallelLMHead(nn.Module):
    """The output projection ``weight`` [V_l, H]; with ``tied`` it is the embedding's Parameter itself.

    A tied checkpoint may still store ``lm_head.weight``: it is accepted when its shape is right and ignored
    (the tied tensor is the embedding), as HF does.
    """

    def __init__(self, vocab_size: int, hidden: int, *, tp: TPInfo, dtype: torch.dtype, device: torch.device,
                 tied_to: VocabParallelEmbedding | None = None) -> None:
        super().__init__()
        self.vocab_size, self.tp, self.tied = vocab_size, tp, tied_to is not None
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            v_l = local_vocab(vocab_size, tp)
            self.weight = nn.Parameter(torch.empty(v_l, hidden, dtype=dtype, device=device), requires_grad=False)

    def hf_targets(self, prefix: str) -> dict[str, WeightTarget]:
        if self.tied:
            return {prefix + "weight": WeightTarget((self.vocab_size, self.weight.shape[1]), lambda t: None,
                                                    required=False)}
        return {prefix + "weight": vocab_target(self.weight, self.vocab_size, self.tp)}
