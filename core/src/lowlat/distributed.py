"""Tensor parallelism: who this rank is, and the two collectives the general forward needs.

The collectives are thin wrappers over ``torch.distributed`` (NCCL on GPUs, gloo on CPU) and are no-ops
at ``size == 1``, so a single-device model never touches ``torch.distributed``. Both are CUDA-graph
capturable under NCCL (no host syncs, static shapes). Layout follows Megatron-LM's column/row parallel
linears: a row-parallel output is summed with ``all_reduce``; vocab-parallel logits are concatenated
along the last dim with ``all_gather_last_dim``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPInfo:
    """This process's place in the tensor-parallel group.

    Attributes:
        rank: this rank, ``0 <= rank < size``.
        size: ranks in the group (1 = no tensor parallelism).
        group: the ``torch.distributed`` ProcessGroup; None means the default (world) group.
        peer: the group's peer all-reduce, or None (every sum through ``torch.distributed``): a callable
            ``peer(x, site) -> x summed in place, or None`` (None: ``x`` does not fit, use torch.distributed), e.g.
            ``lowlat.runtime.peer_reduce.PeerAllReduce``; ``all_reduce`` calls it for the call sites that pass a
            ``site``. Not part of equality.

    Raises:
        ValueError: when size < 1 or rank is outside ``[0, size)``.
    """

    rank: int = 0
    size: int = 1
    group: Any = None
    peer: Callable[[torch.Tensor, int], torch.Tensor | None] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"TP size must be >= 1, got {self.size}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"TP rank {self.rank} is outside [0, {self.size})")


SINGLE = TPInfo()
"""The TPInfo of an unsharded model."""


# torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns); 2.11 has only the old one.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _check_initialized(tp: TPInfo) -> None:
    if not dist.is_initialized():
        raise RuntimeError(
            f"TP size is {tp.size} but torch.distributed is not initialized; call "
            "torch.distributed.init_process_group (nccl on GPUs, gloo on CPU) in every rank first"
        )


def all_reduce(x: torch.Tensor, tp: TPInfo, site: int | None = None) -> torch.Tensor:
    """Sum ``x`` over the TP group, in place. Returns ``x`` (unchanged at size 1).

    Args:
        x: any shape and dtype the backend supports; must be contiguous.
        site: this call site's id (``2 * layer + k``: k = 0 after attention, 1 after the MLP), for the sites that
            may take the group's peer all-reduce (``TPInfo.peer``; it names the site in its error record); None:
            always torch.distributed. Every rank must pass the same sites in the same order.
    """
    if tp.size == 1:
        return x
    if site is not None and tp.peer is not None:
        y = tp.peer(x, site)
        if y is not None:
            return y
    _check_initialized(tp)
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=tp.group)
    return x


def all_gather_last_dim(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    """Concatenate every rank's ``x`` along the last dim, in rank order.

    Args:
        x: ``[..., N]``, the same shape on every rank.
    Returns:
        ``[..., size * N]`` (``x`` itself at size 1).
    """
    if tp.size == 1:
        return x
    _check_initialized(tp)
    x = x.contiguous()
    out = torch.empty((tp.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)  # concatenated form
    _all_gather_single(out, x, group=tp.group)
    return out.view(tp.size, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], tp.size * x.shape[-1])


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads each rank holds: split evenly, or one replicated head per rank when tp_size > num_kv_heads.

    Raises:
        ValueError: neither divides the other.
    """
    if num_kv_heads % tp_size == 0:
        return num_kv_heads // tp_size
    if tp_size % num_kv_heads == 0:
        return 1
    raise ValueError(f"num_key_value_heads={num_kv_heads} and tp_size={tp_size} must divide one another")
