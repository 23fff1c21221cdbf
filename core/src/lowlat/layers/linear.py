"""Linear layers with Megatron-LM tensor parallelism (column parallel, row parallel) and fused HF weights.

Per TP rank after sharding (``_l`` = local):
- ``QKVParallelLinear.weight``        [(Hq_l + 2*Hkv_l) * D, H]: rows are q heads, then k heads, then v heads.
  KV heads are sharded when ``tp <= Hkv`` and replicated (each rank holds the one kv head its q heads use)
  when ``tp > Hkv`` (SGLang's QKVParallelLinear rule).
- ``MergedColumnParallelLinear.weight`` [n * O_l, I]: the rank's slice of each part (gate rows then up rows).
- ``RowParallelLinear.weight``       [O, I_l]: the input dim is sharded; outputs are summed with all-reduce.
- ``ReplicatedLinear.weight``        [O, I]: the same on every rank.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from lowlat.distributed import TPInfo, all_reduce
from lowlat.layers.weights import WeightTarget, copy_target, shard_dim


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def kv_head_layout(num_kv_heads: int, tp: TPInfo) -> tuple[int, int]:
    """(local kv heads, first global kv head of this rank).

    Raises:
        ValueError: when neither ``num_kv_heads % tp.size == 0`` nor ``tp.size % num_kv_heads == 0``.
    """
    if num_kv_heads % tp.size == 0:
        local = num_kv_heads // tp.size
        return local, tp.rank * local
    if tp.size % num_kv_heads == 0:
        return 1, tp.rank // (tp.size // num_kv_heads)
    raise ValueError(
        f"num_key_value_heads={num_kv_heads} and tp_size={tp.size}: one must divide the other; pick another tp_size"
    )


class ReplicatedLinear(nn.Module):
    """y = x @ W^T with W [out, in] on every rank (the MoE router)."""

    def __init__(self, in_features: int, out_features: int, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = _param(out_features, in_features, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def hf_targets(self, prefix: str) -> dict[str, WeightTarget]:
        return {prefix + "weight": copy_target(self.weight, tuple(self.weight.shape))}


class QKVParallelLinear(nn.Module):
    """Fused q/k/v projection, column parallel over heads. x [T, H] -> [T, (Hq_l + 2*Hkv_l) * D]."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, *, bias: bool,
                 tp: TPInfo, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        if num_heads % tp.size:
            raise ValueError(f"num_attention_heads={num_heads} is not divisible by tp_size={tp.size}")
        self.hidden, self.head_dim, self.tp = hidden, head_dim, tp
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.local_heads = num_heads // tp.size
        self.local_kv_heads, self.kv_head_start = kv_head_layout(num_kv_heads, tp)
        rows = (self.local_heads + 2 * self.local_kv_heads) * head_dim
        self.weight = _param(rows, hidden, dtype=dtype, device=device)
        self.bias = _param(rows, dtype=dtype, device=device) if bias else None

    @property
    def split_sizes(self) -> tuple[int, int, int]:
        """Output columns of q, k and v on this rank."""
        d = self.head_dim
        return self.local_heads * d, self.local_kv_heads * d, self.local_kv_heads * d

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def hf_targets(self, prefix: str) -> dict[str, WeightTarget]:
        d, q_rows, kv_rows = self.head_dim, *self.split_sizes[:2]
        q_start = self.tp.rank * q_rows
        kv_start = self.kv_head_start * d
        parts = {  # name -> (rows in the checkpoint, our row offset, our rows, checkpoint row offset)
            "q_proj": (self.num_heads * d, 0, q_rows, q_start),
            "k_proj": (self.num_kv_heads * d, q_rows, kv_rows, kv_start),
            "v_proj": (self.num_kv_heads * d, q_rows + kv_rows, kv_rows, kv_start),
        }
        out: dict[str, WeightTarget] = {}
        for name, (full, ours, n, theirs) in parts.items():
            rows = functools.partial(torch.narrow, dim=0, start=theirs, length=n)
            out[f"{prefix}{name}.weight"] = copy_target(self.weight[ours:ours + n], (full, self.hidden), rows)
            if self.bias is not None:
                out[f"{prefix}{name}.bias"] = copy_target(self.bias[ours:ours + n], (full,), rows)
        return out


class MergedColumnParallelLinear(nn.Module):
    """Several column-parallel projections of the same input fused in one weight (gate_up_proj).

    x [T, in] -> [T, len(parts) * out_per_part / tp]; checkpoint tensors ``{part}.weight`` [out_per_part, in]
    and, with ``bias``, ``{part}.bias`` [out_per_part] (sharded the same way, in ``self.bias``).
    """

    def __init__(self, in_features: int, out_per_part: int, parts: tuple[str, ...], *, tp: TPInfo,
                 dtype: torch.dtype, device: torch.device, bias: bool = False) -> None:
        super().__init__()
        if out_per_part % tp.size:
            raise ValueError(f"intermediate_size={out_per_part} is not divisible by tp_size={tp.size}")
        self.in_features, self.out_per_part, self.parts, self.tp = in_features, out_per_part, parts, tp
        self.local_out = out_per_part // tp.size
        self.weight = _param(len(parts) * self.local_out, in_features, dtype=dtype, device=device)
        self.bias = _param(len(parts) * self.local_out, dtype=dtype, device=device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def hf_targets(self, prefix: str) -> dict[str, WeightTarget]:
        n, tp = self.local_out, self.tp
        out = {}
        for i, part in enumerate(self.parts):
            out[f"{prefix}{part}.weight"] = copy_target(self.weight[i * n:(i + 1) * n],
                                                        (self.out_per_part, self.in_features),
                                                        lambda t: shard_dim(t, 0, tp.rank, tp.size))
            if self.bias is not None:
                out[f"{prefix}{part}.bias"] = copy_target(self.bias[i * n:(i + 1) * n], (self.out_per_part,),
                                                          lambda t: shard_dim(t, 0, tp.rank, tp.size))
        return out


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_l @ W_l^T) + b, input dim sharded. x [T, in / tp] -> [T, out] (full on every rank).

    ``site``: the all-reduce's call-site id (``lowlat.distributed.all_reduce``), None for torch.distributed only.
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool, tp: TPInfo,
                 dtype: torch.dtype, device: torch.device, site: int | None = None) -> None:
        super().__init__()
        if in_features % tp.size:
            raise ValueError(f"row-parallel input dim {in_features} is not divisible by tp_size={tp.size}")
        self.in_features, self.out_features, self.tp, self.site = in_features, out_features, tp, site
        self.weight = _param(out_features, in_features // tp.size, dtype=dtype, device=device)
        self.bias = _param(out_features, dtype=dtype, device=device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce(F.linear(x, self.weight), self.tp, self.site)
        return y if self.bias is None else y + self.bias

    def hf_targets(self, prefix: str) -> dict[str, WeightTarget]:
        tp = self.tp
        out = {f"{prefix}weight": copy_target(self.weight, (self.out_features, self.in_features),
                                              lambda t: shard_dim(t, 1, tp.rank, tp.size))}
        if self.bias is not None:
            out[f"{prefix}bias"] = copy_target(self.bias, (self.out_features,))
        return out
