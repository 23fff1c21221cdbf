"""nvidia_mega at tp_size > 1: one rank's shards, its peer buffers, and the steps that cross ranks.

Shards are the general model's (``binding.params`` per rank, docs/writing-a-plugin.md): QKV column-parallel by
heads, o_proj and down row-parallel, gate_up column-parallel, embedding and LM head vocabulary-parallel
(``ceil(V / tp)`` rows per rank, the last rank's padding zero), every expert's intermediate dim split (w13 rows,
w2 columns) with the router replicated. Per decoder layer at TP the chain is::

    qkv_rope (prologue norm at layer 0, else h) -> attention -> o_proj "publish" -> reduce_rows(+post norm -> h)
    -> gate_up(h) -> down "publish" -> reduce_rows(+next layer's input norm -> h)
    (a MoE layer: reduce_rows without a norm -> moe_forward(peer=...): route, gate/up, down "publish" -> reduce_rows)

so the two all-reduces of a layer are the GEMMs' own epilogues plus one launch each that also adds the residual
and the next norm (``kernels.tp_epilogue``, ``kernels.tp_reduce``), instead of a store, an NCCL all-reduce, and a
residual add. The embedding's partial rows are summed by core's one-launch ``peer_all_reduce`` over the same
buffers; the LM head's logits are gathered over the vocabulary (``all_gather_last_dim``). Call sites in the error
record: ``2 * layer`` (o_proj), ``2 * layer + 1`` (down), as the general path's; ``2 * num_layers``: the embedding.
Sampled ids stay with the engine at TP (core's Dispatcher asks plugins for ids at tp_size 1 only).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from lowlat_nvidia_mega.kernels.tp_epilogue import PeerTarget

PEER_BLOCK = 16  # elements per flag tile: 8 x H elements then give H / 2 tiles, the one-row GEMV's narrowest grid
# Fault injection (tests): the row-parallel GEMMs of this rank store their tiles but never release the flags, so every
# rank's reduce gives up at its deadline and the engine raises PeerWaitTimeout naming this rank.
FAULT_ENV = "LOWLAT_MEGA_FAULT_NO_PUBLISH"


@dataclass
class MegaTP:
    """One rank's TP state (``build`` makes it at tp_size > 1).

    Attributes:
        tp: ``lowlat.plugin.peer.TPInfo`` (rank, size, group). target: the PeerTarget of the row-parallel GEMMs
        (``binding.peer_buffers``: capacity 8 x hidden_size, the model dtype). vocab_size: V; vocab_start: this
        rank's first vocabulary row.
    """

    tp: Any
    target: PeerTarget
    vocab_size: int
    vocab_start: int

    def embed(self, embed: torch.Tensor, ids: torch.Tensor, x: torch.Tensor, site: int) -> None:
        """x [T, H] = the embedding rows of ``ids`` [T] (int64): this rank's rows, zero for ids it does not hold,
        summed over the ranks (one rank holds each id, so the fp32 sum is exact). Graph-capturable."""
        from lowlat.plugin.peer import peer_all_reduce

        v_l = embed.shape[0]
        local = ids - self.vocab_start
        mine = (local >= 0) & (local < v_l)
        torch.index_select(embed, 0, local.clamp(0, v_l - 1), out=x)
        x.mul_(mine.unsqueeze(1).to(x.dtype))
        peer_all_reduce(x, self.target.bufs, out=x, site=site)

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        """float32 [T, V] from every rank's [T, ceil(V / tp)] (rank order; the padding columns dropped)."""
        from lowlat.plugin.peer import all_gather_last_dim

        full = all_gather_last_dim(local, self.tp)
        return full if full.shape[1] == self.vocab_size else full[:, :self.vocab_size].contiguous()


def open_tp(binding: Any, hidden: int, max_rows: int, dtype: torch.dtype) -> MegaTP:
    """This rank's MegaTP: its peer buffers (a collective of the TP group, ``binding.peer_buffers``) and vocabulary
    range.

    Raises:
        PluginBuildError: as ``binding.peer_buffers`` (named), a core without plugin API 4, or a ``FAULT_ENV`` value
            that names no rank.
    """
    from lowlat.plugin import PluginBuildError

    if not hasattr(binding, "peer_buffers"):
        raise PluginBuildError("nvidia_mega at tp_size > 1 needs lowlat's plugin API 4 (binding.peer_buffers); "
                               "upgrade lowlat or run --tp 1")
    silent = os.environ.get(FAULT_ENV)
    if silent is not None and silent not in {str(r) for r in range(binding.tp_size)}:
        raise PluginBuildError(f"{FAULT_ENV}={silent!r} must name a rank in [0, {binding.tp_size}); unset it")
    bufs = binding.peer_buffers(max_rows * hidden, dtype, block=PEER_BLOCK)
    v = binding.model_config.vocab_size
    v_l = -(-v // binding.tp_size)
    return MegaTP(tp=binding.tp, target=PeerTarget(bufs, publish=silent != str(binding.tp_rank)), vocab_size=v,
                  vocab_start=binding.tp_rank * v_l)
