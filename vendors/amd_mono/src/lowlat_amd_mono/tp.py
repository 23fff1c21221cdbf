"""amd_mono at tp_size > 1: one rank's peer buffers, the K2 launches whose stages publish and reduce across ranks
(``kernels.k2_tp`` for dense layers, ``kernels.k2_moe_tp`` for sparse-MoE layers), the vocabulary-parallel embedding
and the gathered logits.

Shards are the general model's (``binding.params`` per rank): QKV column-parallel by heads (KV heads split, or one
replicated per rank), o_proj and down row-parallel, gate_up column-parallel, every expert's intermediate dim split
(w13 rows, w2 columns; the router replicated), embedding and LM head vocabulary-parallel (``ceil(V / tp)`` rows per
rank, the last rank's padding zero). A step at TP::

    embed_kernel (this rank's rows, zero for other ids) -> peer_all_reduce (site 2 * layers)
    per layer: K1 (unchanged, this rank's heads) -> K2 at TP (o_proj publish, reduce, gate/up or router and expert
               gate/up, down or expert down publish, reduce)
    head_kernel over this rank's ceil(V / tp) rows -> all_gather_last_dim -> the first V columns

Call sites in the error record (``PeerWaitTimeout``): ``2 * layer`` (layer's o_proj reduce, stage k2.o_proj_reduce),
``2 * layer + 1`` (its down or MoE reduce, k2.down_reduce / k2.moe_reduce), ``2 * layers`` (the embedding). Sampled
ids stay with the engine at TP (core's Dispatcher asks plugins for ids at tp_size 1 only).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from lowlat_amd_mono.kernels import plan as P

PEER_BLOCK = 16  # elements per flag tile of the embedding's peer_all_reduce; cap_tiles = 8 * H / 16 >= every tile count
# Fault injection (tests only): this rank's o_proj and down store their tiles but never release the flags, so every
# rank's reduce gives up at its deadline and the engine raises PeerWaitTimeout naming this rank. Read at build; an
# amd_mono variable, so MonoOptions.resolve knows it (TEST_VARIABLES) and refuses misspellings.
FAULT_ENV = "LOWLAT_MONO_FAULT_NO_PUBLISH"


@dataclass
class MonoTP:
    """One rank's TP state (``open_tp`` makes it at tp_size > 1).

    Attributes:
        tp: ``lowlat.plugin.peer.TPInfo``. bufs: this rank's ``PeerBuffers`` (capacity 8 x hidden_size elements of
        the model dtype, 16-element flag tiles). publish: False under fault injection. vocab_size: V; vocab_start:
        this rank's first vocabulary row; vocab_rows: ``ceil(V / tp)``.
    """

    tp: Any
    bufs: Any
    publish: bool
    vocab_size: int
    vocab_start: int
    vocab_rows: int

    @property
    def cap_tiles(self) -> int:
        """Flag tiles per parity: the most column tiles one call may publish."""
        return -(-self.bufs.capacity // self.bufs.block)

    def check_tiles(self, plan: P.MonoPlan) -> None:
        """Raise ValueError when o_proj's, down's or the expert down's column tiles outnumber the peer buffers'
        flag tiles."""
        n = max([plan.o.n_tiles] + [t.n_tiles for t in (plan.down, plan.edown) if t is not None])
        if n > self.cap_tiles:
            raise ValueError(f"amd_mono at TP publishes {n} column tiles per call; the peer buffers hold "
                             f"{self.cap_tiles} flag tiles (capacity {self.bufs.capacity} / block {self.bufs.block})")

    def all_reduce_embedding(self, x: torch.Tensor, site: int) -> None:
        """x ``[T, H]`` (model dtype, contiguous, rows of this rank's ids, zero for the others) summed over the ranks
        in place (one rank holds each id, so the sum is exact). Graph-capturable."""
        from lowlat.plugin.peer import peer_all_reduce

        peer_all_reduce(x, self.bufs, out=x, site=site)

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        """float32 ``[T, V]`` from every rank's ``[T, ceil(V / tp)]`` (rank order; the padding columns dropped)."""
        from lowlat.plugin.peer import all_gather_last_dim

        full = all_gather_last_dim(local, self.tp)
        return full if full.shape[1] == self.vocab_size else full[:, :self.vocab_size].contiguous()

    def peer_args(self) -> tuple[tuple[Any, ...], tuple[Any, ...], dict[str, Any]]:
        """``(tensors, scalars, meta)`` of ``k2_dense_tp_kernel`` / ``k2_moe_tp_kernel``: the pointer tables, error
        record and device tag; rank, capacity, flag tiles, deadline and the publish switch; WORLD, WPAD and the peer
        timer."""
        b = self.bufs
        return ((b.data_ptrs, b.flag_ptrs, b.ctl, b.tag_state),
                (b.rank, b.capacity, self.cap_tiles, b.deadline, int(self.publish)),
                {"WORLD": b.world, "WPAD": 1 << (b.world - 1).bit_length(), "PTIMER": b.timer})


def fault_rank() -> int | None:
    """The rank ``LOWLAT_MONO_FAULT_NO_PUBLISH`` names, or None when unset. Raises ValueError for a non-integer."""
    raw = os.environ.get(FAULT_ENV)
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{FAULT_ENV}={raw!r} must be a rank number (test-only fault injection); unset it") from None


def open_tp(binding: Any, hidden: int, dtype: torch.dtype) -> MonoTP:
    """This rank's MonoTP: its peer buffers (a collective of the TP group, ``binding.peer_buffers``) and vocabulary
    range.

    Raises:
        PluginBuildError: a core without plugin API 4, a ``LOWLAT_MONO_FAULT_NO_PUBLISH`` that names no rank of the
            group, or as ``binding.peer_buffers`` (named).
    """
    from lowlat.plugin import PluginBuildError

    if not hasattr(binding, "peer_buffers"):
        raise PluginBuildError("amd_mono at tp_size > 1 needs lowlat's plugin API 4 (binding.peer_buffers); "
                               "upgrade lowlat or run --tp 1")
    try:
        silent = fault_rank()
    except ValueError as e:
        raise PluginBuildError(str(e)) from None
    if silent is not None and not 0 <= silent < binding.tp_size:
        raise PluginBuildError(f"{FAULT_ENV}={silent} must name a rank in [0, {binding.tp_size}); unset it")
    bufs = binding.peer_buffers(P.MAX_ROWS * hidden, dtype, block=PEER_BLOCK)
    v = binding.model_config.vocab_size
    v_l = -(-v // binding.tp_size)
    return MonoTP(tp=binding.tp, bufs=bufs, publish=silent != binding.tp_rank, vocab_size=v,
                  vocab_start=binding.tp_rank * v_l, vocab_rows=v_l)
