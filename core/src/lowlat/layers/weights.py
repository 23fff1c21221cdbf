"""Loading HF-named checkpoint tensors into a model's (fused, TP-sharded) parameters.

Each layer declares ``hf_targets(prefix) -> dict[str, WeightTarget]``: for every tensor name an HF checkpoint
stores, the full (unsharded) shape it must have and a ``load`` function that writes this rank's shard into the
layer's parameters (fusing q/k/v and gate/up as it goes). ``load_hf_weights`` streams ``(name, tensor)`` pairs
through those targets, one tensor at a time, so a checkpoint is never held twice, and raises on anything
missing, unexpected, duplicated, mis-shaped or of a dtype that cannot be cast. The pop-every-key-and-raise-on-
leftovers discipline follows mini-sglang's loader.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some older Llama checkpoints saved; recomputed here
_MAX_LISTED = 20


class WeightLoadError(ValueError):
    """A checkpoint does not match the model: the message names every offending tensor and the fix."""


@dataclass(frozen=True)
class WeightTarget:
    """Where one checkpoint tensor goes.

    Attributes:
        shape: the full, unsharded shape the checkpoint must store.
        load: writes this rank's shard of the (shape-checked) checkpoint tensor into parameters, casting
            to the parameter dtype and moving to its device.
        covers: the pieces of the model this tensor provides; None means the tensor's own name. Fused
            checkpoint layouts cover many pieces (e.g. all experts' gate and up projections).
        required: whether the pieces are required (False for alternative layouts and for a tied lm_head).
    """

    shape: tuple[int, ...]
    load: Callable[[torch.Tensor], object]
    covers: tuple[str, ...] | None = None
    required: bool = True

    def pieces(self, name: str) -> tuple[str, ...]:
        return (name,) if self.covers is None else self.covers


def copy_target(dest: torch.Tensor, shape: tuple[int, ...],
                shard: Callable[[torch.Tensor], torch.Tensor] = lambda t: t, **kw: object) -> WeightTarget:
    """A target whose shard (``shard(tensor)``) is copied into ``dest`` (a parameter or a view of one)."""

    def load(t: torch.Tensor) -> None:
        part = shard(t)
        if part.shape != dest.shape:  # an internal inconsistency of the layer, not of the checkpoint
            raise AssertionError(f"shard of shape {tuple(part.shape)} does not fit parameter {tuple(dest.shape)}")
        dest.copy_(part)

    return WeightTarget(tuple(shape), load, **kw)  # type: ignore[arg-type]


def shard_dim(t: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    """The ``rank``-th of ``size`` equal slices of ``t`` along ``dim`` (sizes checked divisible at build)."""
    n = t.shape[dim] // size
    return t.narrow(dim, rank * n, n)


def _listing(names: Iterable[str]) -> str:
    names = sorted(names)
    shown = ", ".join(names[:_MAX_LISTED])
    return shown + (f", ... ({len(names) - _MAX_LISTED} more)" if len(names) > _MAX_LISTED else "")


def load_hf_weights(targets: dict[str, WeightTarget], weights: Iterable[tuple[str, torch.Tensor]],
                    *, model_name: str) -> None:
    """Stream checkpoint tensors into the model.

    Args:
        targets: HF tensor name -> WeightTarget, from the model's layers.
        weights: ``(name, tensor)`` pairs as an HF checkpoint stores them (any float dtype, any device).
        model_name: the architecture, for messages.

    Raises:
        WeightLoadError: a tensor has the wrong shape, a non-float dtype, is supplied twice, is unexpected,
            or a required tensor is missing (all unexpected and missing names are listed together).
    """
    required = {p for name, t in targets.items() if t.required for p in t.pieces(name)}
    covered: dict[str, str] = {}
    unexpected: list[str] = []
    with torch.no_grad():
        for name, tensor in weights:
            target = targets.get(name)
            if target is None:
                if not name.endswith(_IGNORED_SUFFIXES):
                    unexpected.append(name)
                continue
            if tuple(tensor.shape) != target.shape:
                raise WeightLoadError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, but {model_name} with this "
                    f"config.json expects {target.shape}; does the checkpoint match its config.json?"
                )
            if tensor.dtype not in _FLOAT_DTYPES:
                raise WeightLoadError(
                    f"checkpoint tensor {name!r} has dtype {tensor.dtype}; lowlat loads unquantized float "
                    "weights (float32, float16, bfloat16) and casts them to the model dtype"
                )
            for piece in target.pieces(name):
                if piece in covered:
                    raise WeightLoadError(
                        f"checkpoint tensor {name!r} supplies {piece!r}, already loaded from {covered[piece]!r}; "
                        "a checkpoint must store each weight once (per-expert or fused, not both)"
                    )
                covered[piece] = name
            target.load(tensor)
    missing = required - covered.keys()
    if unexpected or missing:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensor(s): {_listing(missing)}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} tensor(s): {_listing(unexpected)}")
        raise WeightLoadError(
            f"checkpoint does not match {model_name}: " + "; ".join(parts)
            + ". Check that the checkpoint's architecture and config.json are the ones being loaded."
        )
