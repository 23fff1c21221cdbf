"""Kinds 11 and 4 again, from the second audit (of suite 0.3.1's two new checks): defects aimed at the bfloat16
large-score bound that ``conditioning.py`` widens, and at the covering form of weight_binding (every parameter
perturbed at once, one oracle check).

- softmax defects that stay finite (the NaN check does not see them) and are exact at the tiny presets' small
  scores: a stale running maximum with a saturating exp, a running maximum initialised to 0, scores and exp
  sums in bfloat16, a saturating exp without any maximum;
- weight defects: one norm weight or q/k-norm ignored or read from another layer, one expert's down projection
  missing, one layer's router read from another layer, expert ids off by one.

What each showed is in ``tests/mutants/ESCAPES.md`` ("The second audit").
"""

from __future__ import annotations

from typing import Any

import torch
from lowlat.forward_batch import ForwardBatch

from lowlat_contract.plugins.mutants._base import HookedReference
from lowlat_contract.plugins.reference import LayerWeights

NEG = float("-inf")


class _Softmax(HookedReference):
    """An ``_attend`` written out as a kernel does it: scores, masked, ``_probs`` (subclasses), weighted sum."""

    def _attend(self, layer: int, queries: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor,
                mask: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        s = ((queries @ keys.transpose(-1, -2)) * self.head_dim ** -0.5).masked_fill(~mask, NEG)
        p = self._probs(s)
        return (p @ vals) / p.sum(dim=-1, keepdim=True)

    def _probs(self, s: torch.Tensor) -> torch.Tensor:
        return torch.exp(s - s.amax(dim=-1, keepdim=True))


class SoftmaxFirstTileMax(_Softmax):
    """softmax_first_tile_max: the online softmax takes its maximum from the first 16-key tile only (the
    rescale for later tiles is missing); exact while no later score exceeds the first tile's maximum by ~88
    (float32 exp overflows: inf / inf = NaN). Trigger: scaled attention scores, contexts over 16 keys."""

    TILE = 16

    def _probs(self, s: torch.Tensor) -> torch.Tensor:
        m = s[..., :self.TILE].amax(dim=-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, s.amax(dim=-1, keepdim=True))  # a fully masked first tile
        return torch.exp(s - m)


class SoftmaxFirstTileMaxClamped(SoftmaxFirstTileMax):
    """softmax_first_tile_max_clamped: softmax_first_tile_max whose exp argument is clamped at 80 (a guard
    against inf): finite at any score, exact while no later key's score exceeds the first tile's maximum by
    80, else every such key weighs e^80 alike. Trigger: scaled attention scores, contexts over 16 keys."""

    def _probs(self, s: torch.Tensor) -> torch.Tensor:
        m = s[..., :self.TILE].amax(dim=-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, s.amax(dim=-1, keepdim=True))
        return torch.exp((s - m).clamp_max(80.0))


class SoftmaxSaturatingExp(_Softmax):
    """softmax_saturating_exp: no running maximum, the exp argument clamped at 80 so nothing overflows:
    exact below scores of 80, above it every key scoring over 80 weighs the same. Trigger: scaled scores."""

    def _probs(self, s: torch.Tensor) -> torch.Tensor:
        return torch.exp(s.clamp_max(80.0))


class SoftmaxMaxInitZero(_Softmax):
    """softmax_max_init_zero: the running maximum starts at 0, not -inf, and the row sum is guarded against 0
    (``l == 0 -> 1``): exact while a row's largest score is above about -80; a row whose scores are all
    below about -100 underflows to an all-zero attention output. Trigger: scaled scores (a row whose
    visible keys all score very negative)."""

    def _attend(self, layer: int, queries: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor,
                mask: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        s = ((queries @ keys.transpose(-1, -2)) * self.head_dim ** -0.5).masked_fill(~mask, NEG)
        p = torch.exp(s - s.amax(dim=-1, keepdim=True).clamp_min(0.0))
        total = p.sum(dim=-1, keepdim=True)
        return (p @ vals) / torch.where(total == 0, torch.ones_like(total), total)


class SoftmaxBf16Accumulate(_Softmax):
    """softmax_bf16_accumulate: the bfloat16 attention kernel keeps scores, exp and both accumulators (the
    row sum and P @ V, key by key) in bfloat16; float32 engines run the float32 kernel (exact). At small
    scores the bfloat16 errors stay inside the dtype bound. Trigger: bfloat16, scaled scores."""

    def _attend(self, layer: int, queries: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor,
                mask: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if self.dtype != torch.bfloat16:
            return super()._attend(layer, queries, keys, vals, mask, batch)
        bf = torch.bfloat16
        q, k, v = queries.to(bf), keys.to(bf), vals.to(bf)
        s = ((q @ k.transpose(-1, -2)) * self.head_dim ** -0.5).masked_fill(~mask, NEG)  # bf16 scores
        p = torch.exp(s - s.amax(dim=-1, keepdim=True))  # bf16 exp
        acc = torch.zeros(*p.shape[:-1], v.shape[-1], dtype=bf, device=p.device)
        total = torch.zeros(*p.shape[:-1], 1, dtype=bf, device=p.device)
        last = int(mask.reshape(-1, mask.shape[-1]).any(dim=0).nonzero().max())  # keys past it are masked
        for j in range(last + 1):  # key by key, rounded to bf16 after each add
            pj = p[..., j:j + 1]
            total = total + pj
            acc = acc + pj * v[:, :, j:j + 1, :]
        return acc.float() / total.float()


# -- weight defects --------------------------------------------------------------------------------------------


class IgnoresFinalNorm(HookedReference):
    """ignores_final_norm_weight: the fused residual + final RMSNorm kernel normalises but never multiplies by
    the norm's weight. Trigger: any step (the weight is 1 + N(0, 0.05), not 1)."""

    def __init__(self, binding: Any) -> None:
        super().__init__(binding)
        self.final_norm = torch.ones_like(self.final_norm)


class IgnoresLayer1PostNorm(HookedReference):
    """ignores_layer1_post_norm: layer 1's post_attention_layernorm weight is never multiplied in (its pointer
    is null and the kernel skips the scale). Trigger: any step."""

    def __init__(self, binding: Any) -> None:
        super().__init__(binding)
        self.layers[1].ln_post = torch.ones_like(self.layers[1].ln_post)


class IgnoresLayer1QNorm(HookedReference):
    """ignores_layer1_q_norm (Qwen3): layer 1 normalises q but never multiplies by its q_norm weight.
    Trigger: any step of a q/k-norm model."""

    def __init__(self, binding: Any) -> None:
        super().__init__(binding)
        w = self.layers[1]
        if w.q_norm is not None:
            w.q_norm = torch.ones_like(w.q_norm)


class Layer1KNormFromLayer0(HookedReference):
    """layer1_k_norm_from_layer0 (Qwen3): the k_norm pointer table has a stride of 0, so layer 1 scales K by
    layer 0's k_norm weight. Trigger: any step of a q/k-norm model."""

    def __init__(self, binding: Any) -> None:
        super().__init__(binding)
        if self.layers[0].k_norm is not None:
            self.layers[1].k_norm = self.layers[0].k_norm


class MoeIgnoresOneExpertDown(HookedReference):
    """moe_ignores_expert3_down (MoE): layer 1's expert-3 down projection is never packed (the pointer table
    skips it): the zero-filled workspace stands in, so tokens routed to expert 3 in layer 1 lose that
    expert's share. Trigger: a token routed to expert 3 in layer 1."""

    EXPERT, LAYER = 3, 1

    def __init__(self, binding: Any) -> None:
        super().__init__(binding)
        w = self.layers[self.LAYER]
        if w.experts_w2_t is not None:
            w2 = w.experts_w2_t.clone()
            w2[self.EXPERT] = 0
            w.experts_w2_t = w2


class MoeLayer0IgnoresExpert1Down(MoeIgnoresOneExpertDown):
    """moe_layer0_ignores_expert1_down (MoE): moe_ignores_expert3_down in layer 0, expert 1. Its error changes
    the hidden states layer 1 routes on, so the rows it damages most also pick other experts in layer 1.
    Trigger: a token routed to expert 1 in layer 0."""

    EXPERT, LAYER = 1, 0


class MoeExpertIdsOffByOne(HookedReference):
    """moe_expert_ids_off_by_one (MoE): the grouped-GEMM launch indexes experts from 1, so a token routed to
    expert e runs expert (e + 1) mod E with e's weight; ``last_routing()`` reports the experts it ran.
    Trigger: any MoE step."""

    def _moe(self, w: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        c = self.config
        probs = torch.softmax((h @ w.router_t).float(), dim=-1)
        top_w, top_ids = probs.topk(c.num_experts_per_tok, dim=-1)
        if c.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        ran = (top_ids + 1) % probs.shape[-1]
        self._routing.append(ran)
        combine = torch.zeros_like(probs, dtype=self.dtype).scatter(1, ran, top_w.to(self.dtype))
        gate, up = torch.matmul(h[None], w.experts_w13_t).chunk(2, dim=-1)
        y = torch.matmul(torch.nn.functional.silu(gate) * up, w.experts_w2_t)
        return self._sum_ranks((y * combine.t()[:, :, None]).sum(dim=0))


class MoeLayer1RouterFromLayer0(HookedReference):
    """moe_layer1_router_from_layer0 (MoE): the router pointer table has a stride of 0, so layer 1 routes with
    layer 0's router; it exposes its (wrong) routing through ``last_routing()`` as the reference does.
    Trigger: any MoE step (most tokens pick other experts in layer 1)."""

    def __init__(self, binding: Any) -> None:
        super().__init__(binding)
        if self.layers[0].router_t is not None:
            self.layers[1].router_t = self.layers[0].router_t


__all__ = ["IgnoresFinalNorm", "IgnoresLayer1PostNorm", "IgnoresLayer1QNorm", "Layer1KNormFromLayer0",
           "MoeExpertIdsOffByOne", "MoeIgnoresOneExpertDown", "MoeLayer0IgnoresExpert1Down",
           "MoeLayer1RouterFromLayer0", "SoftmaxBf16Accumulate", "SoftmaxFirstTileMax", "SoftmaxFirstTileMaxClamped",
           "SoftmaxMaxInitZero", "SoftmaxSaturatingExp"]
