"""Sparse MoE block of Qwen3-MoE: a float32 softmax top-k router and SwiGLU experts run as grouped GEMMs.

Routing (HF ``Qwen3MoeTopKRouter``): ``probs = softmax(h @ Wg^T, float32)``, top-k, divided by their sum when
``norm_topk_prob``, cast to the activation dtype. Experts: ``y = sum_k w_k * down_e(silu(gate_e(h)) * up_e(h))``.

Batched path (``torch._grouped_mm``, after the "sort tokens by expert, one grouped GEMM per projection" design of
MegaBlocks / SGLang's fused MoE): the T*k (token, expert) pairs are sorted by expert (stable), the cumulative
per-expert counts are the grouped GEMM offsets (a device tensor), and the results are un-sorted and summed over k.
Shapes are static and nothing reads back to the host, so it is CUDA-graph capturable. Where ``_grouped_mm`` is
missing or rejects the dtype/device/shape (probed once per combination), a loop over the experts actually
selected runs instead; it syncs with the host and refuses to run inside a CUDA-graph capture. float32 inside a
capture runs every expert on every row instead (``_forward_dense``: ``_grouped_mm`` is not capturable there).

TP: every expert's intermediate dim is sharded (w13 rows, w2 columns); the output is all-reduced.
Parameters per rank: ``w13_weight`` [E, 2 * I_l, H] (gate rows then up rows), ``w2_weight`` [E, H, I_l].
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from lowlat.distributed import TPInfo, all_reduce
from lowlat.layers.linear import ReplicatedLinear
from lowlat.layers.weights import WeightTarget, copy_target, shard_dim


@functools.cache
def grouped_mm_supported(device: torch.device, dtype: torch.dtype, hidden: int, inter: int) -> bool:
    """Whether ``torch._grouped_mm`` runs and is correct for these operand shapes on ``device`` in ``dtype``.

    Probes both GEMMs of an expert (x @ w13^T with K=H, act @ w2^T with K=I) on a 3-expert problem with an empty
    group, in the weights' layout; runs at build time, never inside a graph capture.
    """
    if not hasattr(torch, "_grouped_mm"):
        return False
    gen = torch.Generator().manual_seed(0)
    offs = torch.tensor([3, 3, 8], dtype=torch.int32, device=device)
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    for k, n in ((hidden, inter), (inter, hidden)):
        a = torch.randn(8, k, generator=gen).to(device, dtype)
        w = torch.randn(3, n, k, generator=gen).to(device, dtype)  # [E, out, in], as w13 / w2 are stored
        try:
            got = torch._grouped_mm(a, w.transpose(1, 2), offs=offs).float()
        except (RuntimeError, NotImplementedError, TypeError, ValueError):
            return False
        want = torch.cat([a[:3].float() @ w[0].float().T, a[3:].float() @ w[2].float().T])
        if not torch.allclose(got, want, rtol=tol, atol=tol * k ** 0.5):
            return False
    return True


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] in ``dtype``, expert ids [T, k] int64), HF's order of operations."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), ids


class FusedExperts(nn.Module):
    """All experts' SwiGLU weights, sharded over the intermediate dim.

    HF checkpoints store either per-expert tensors ``experts.{e}.{gate,up,down}_proj.weight`` ([I, H], [I, H],
    [H, I]) or the fused layout transformers 5.x keeps in memory, ``experts.gate_up_proj`` [E, 2I, H] and
    ``experts.down_proj`` [E, H, I]; both load.
    """

    def __init__(self, num_experts: int, hidden: int, inter: int, *, tp: TPInfo, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        if inter % tp.size:
            raise ValueError(f"moe_intermediate_size={inter} is not divisible by tp_size={tp.size}")
        self.num_experts, self.hidden, self.inter, self.tp = num_experts, hidden, inter, tp
        self.inter_l = inter // tp.size
        e, i_l = num_experts, self.inter_l
        self.w13_weight = nn.Parameter(torch.empty(e, 2 * i_l, hidden, dtype=dtype, device=device),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(e, hidden, i_l, dtype=dtype, device=device), requires_grad=False)
        self.use_grouped_mm = grouped_mm_supported(torch.device(device), dtype, hidden, i_l)

    def hf_targets(self, prefix: str) -> dict[str, WeightTarget]:
        """``prefix`` ends with "experts."."""
        tp, h, i, i_l = self.tp, self.hidden, self.inter, self.inter_l
        out: dict[str, WeightTarget] = {}
        gate_up: list[str] = []
        down: list[str] = []
        for e in range(self.num_experts):
            for j, part in enumerate(("gate_proj", "up_proj")):
                name = f"{prefix}{e}.{part}.weight"
                out[name] = copy_target(self.w13_weight[e, j * i_l:(j + 1) * i_l], (i, h),
                                        lambda t: shard_dim(t, 0, tp.rank, tp.size))
                gate_up.append(name)
            name = f"{prefix}{e}.down_proj.weight"
            out[name] = copy_target(self.w2_weight[e], (h, i), lambda t: shard_dim(t, 1, tp.rank, tp.size))
            down.append(name)

        def load_gate_up(t: torch.Tensor) -> None:
            self.w13_weight[:, :i_l].copy_(shard_dim(t[:, :i], 1, tp.rank, tp.size))
            self.w13_weight[:, i_l:].copy_(shard_dim(t[:, i:], 1, tp.rank, tp.size))

        out[prefix + "gate_up_proj"] = WeightTarget((self.num_experts, 2 * i, h), load_gate_up,
                                                    covers=tuple(gate_up), required=False)
        out[prefix + "down_proj"] = copy_target(self.w2_weight, (self.num_experts, h, i),
                                                lambda t: shard_dim(t, 2, tp.rank, tp.size),
                                                covers=tuple(down), required=False)
        return out

    def forward(self, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """h [T, H], weights [T, k] (h's dtype), ids [T, k] int64 -> this rank's partial output [T, H]."""
        if h.is_cuda and h.dtype == torch.float32 and torch.cuda.is_current_stream_capturing():
            return self._forward_dense(h, weights, ids)
        if self.use_grouped_mm:
            return self._forward_grouped(h, weights, ids)
        return self._forward_loop(h, weights, ids)

    def _forward_dense(self, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Every expert on every row, zero-weighted where not chosen: E times the expert FLOPs, but no host read
        and no data-dependent shape, so it captures. Taken for float32 inside a CUDA-graph capture, where
        ``torch._grouped_mm`` (torch 2.11, sm90) copies to the host and fails ("Cannot copy between CPU and CUDA
        tensors during CUDA graph capture"; seen on an H100, 2026-12-06); bf16 keeps the grouped GEMM."""
        comb = torch.zeros(h.shape[0], self.num_experts, dtype=h.dtype, device=h.device).scatter_add_(1, ids, weights)
        gate_up = torch.matmul(h.unsqueeze(0), self.w13_weight.transpose(1, 2))  # [E, T, 2*I_l]
        act = F.silu(gate_up[..., :self.inter_l]) * gate_up[..., self.inter_l:]
        ys = torch.matmul(act, self.w2_weight.transpose(1, 2))  # [E, T, H]
        return (ys * comb.t().unsqueeze(-1)).sum(dim=0)

    def _forward_grouped(self, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        t, k = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=h.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        offs = counts.cumsum(0).to(torch.int32)
        xs = h.index_select(0, order // k)  # [T*k, H], grouped by expert
        gate_up = torch._grouped_mm(xs, self.w13_weight.transpose(1, 2), offs=offs)  # [T*k, 2*I_l]
        act = F.silu(gate_up[:, :self.inter_l]) * gate_up[:, self.inter_l:]
        ys = torch._grouped_mm(act, self.w2_weight.transpose(1, 2), offs=offs)  # [T*k, H]
        ys = ys * weights.reshape(-1).index_select(0, order)[:, None]
        unsorted = torch.empty_like(ys).index_copy_(0, order, ys)
        return unsorted.view(t, k, -1).sum(dim=1)

    def _forward_loop(self, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if h.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"torch._grouped_mm does not run for {h.dtype} on {h.device} with these shapes, and the fallback "
                "loop over experts cannot be captured in a CUDA graph; run with cuda_graph=False or dtype=bfloat16"
            )
        out = torch.zeros_like(h)
        for e in torch.unique(ids).tolist():
            tok, slot = torch.nonzero(ids == e, as_tuple=True)
            gate_up = F.linear(h[tok], self.w13_weight[e])
            act = F.silu(gate_up[:, :self.inter_l]) * gate_up[:, self.inter_l:]
            y = F.linear(act, self.w2_weight[e]) * weights[tok, slot, None]
            out.index_add_(0, tok, y)
        return out


class SparseMoeBlock(nn.Module):
    """Router ``gate`` (replicated [E, H]) plus ``experts``. h [T, H] -> [T, H], summed over TP ranks."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, inter: int, norm_topk_prob: bool, *,
                 tp: TPInfo, dtype: torch.dtype, device: torch.device, site: int | None = None) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
        self.top_k, self.norm_topk_prob, self.tp, self.site = top_k, norm_topk_prob, tp, site
        self.gate = ReplicatedLinear(hidden, num_experts, dtype=dtype, device=device)
        self.experts = FusedExperts(num_experts, hidden, inter, tp=tp, dtype=dtype, device=device)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(h), self.top_k, self.norm_topk_prob, h.dtype)
        return all_reduce(self.experts(h, weights, ids), self.tp, self.site)

    def hf_targets(self, prefix: str) -> dict[str, WeightTarget]:
        return {**self.gate.hf_targets(prefix + "gate."), **self.experts.hf_targets(prefix + "experts.")}
