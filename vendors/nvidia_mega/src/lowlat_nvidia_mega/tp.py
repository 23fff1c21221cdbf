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
import torch.distributed as dist

from lowlat_nvidia_mega.kernels.norm_rows import norm_rows
from lowlat_nvidia_mega.kernels.tp_epilogue import PeerTarget
from lowlat_nvidia_mega.kernels.tp_reduce import reduce_rows

PEER_BLOCK = 16  # elements per flag tile: 8 x H elements then give H / 2 tiles, the one-row GEMV's narrowest grid
# Fault injection (tests): the row-parallel GEMMs of this rank store their tiles but never release the flags, so every
# rank's reduce gives up at its deadline and the engine raises PeerWaitTimeout naming this rank.
FAULT_ENV = "LOWLAT_MEGA_FAULT_NO_PUBLISH"
# How the row-parallel outputs are summed: "publish" (default: the epilogues publish, reduce_rows sums) or "nccl"
# (the GEMMs store this rank's partial, torch.distributed sums it, then the residual add and the next norm run as
# their own launches): the comparison the issue asks for. Read at each step; a CUDA graph keeps its variant.
TP_REDUCE_ENV = "LOWLAT_MEGA_TP_REDUCE"
TP_REDUCE_MODES = ("publish", "nccl")


def tp_reduce_mode() -> str:
    """``LOWLAT_MEGA_TP_REDUCE`` read now: "publish" (unset, empty or "default") or "nccl".

    Raises:
        ValueError: any other value, naming the variable and the modes.
    """
    v = os.environ.get(TP_REDUCE_ENV, "").strip().lower()
    if v in ("", "default"):
        return "publish"
    if v not in TP_REDUCE_MODES:
        raise ValueError(f"{TP_REDUCE_ENV}={v!r}: use one of {', '.join(TP_REDUCE_MODES)} (or unset it for publish)")
    return v


@dataclass
class MegaTP:
    """One rank's TP state (``build`` makes it at tp_size > 1).

    Attributes:
        tp: ``lowlat.plugin.peer.TPInfo`` (rank, size, group). target: the PeerTarget of the row-parallel GEMMs
        (``binding.peer_buffers``: capacity 8 x hidden_size, the model dtype). vocab_size: V; vocab_start: this
        rank's first vocabulary row. part: [8, H] this rank's partial of a row-parallel output ("nccl" mode).
    """

    tp: Any
    target: PeerTarget
    vocab_size: int
    vocab_start: int
    part: torch.Tensor | None = None

    def finish(self, x: torch.Tensor, part: torch.Tensor | None, *, tile_n: int, site: int,
               norm_weight: torch.Tensor | None, h: torch.Tensor, eps: float, use_pdl: bool) -> None:
        """End a row-parallel projection: ``x += sum over ranks`` of its partials, then ``h = RMSNorm(x)`` with a
        norm weight. ``part`` None: the GEMM published its tiles (``reduce_rows``, tiles of ``tile_n`` columns,
        error record ``site``); else ``part`` [T, H] holds this rank's partial, summed by ``torch.distributed``
        ("nccl" mode), then added and normalized in their own launches (the same roundings)."""
        if part is None:
            reduce_rows(self.target, x, tile_n=tile_n, site=site, norm_weight=norm_weight,
                        h=h if norm_weight is not None else None, eps=eps, use_pdl=use_pdl)
            return
        dist.all_reduce(part, group=self.tp.group)
        x.add_(part)
        if norm_weight is not None:
            norm_rows(x, norm_weight, eps, h, use_pdl=use_pdl)

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
    part = binding.alloc_workspace("nvidia_mega.tp_part", (max_rows, hidden), dtype)
    return MegaTP(tp=binding.tp, target=PeerTarget(bufs, publish=silent != str(binding.tp_rank)), vocab_size=v,
                  vocab_start=binding.tp_rank * v_l, part=part)
