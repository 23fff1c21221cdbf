"""Kind 4 (per-layer weight mix-ups, ignored norms) and kind 7 (claims a checkpoint variant it cannot serve:
the guard accepts it, the forward ignores what makes it different).
"""

from __future__ import annotations

from typing import Any

import torch
from lowlat.plugin import rope_tables

from lowlat_contract.plugins.mutants._base import HookedReference
from lowlat_contract.plugins.reference import LayerWeights


class Layer1OProjFromLayer0(HookedReference):
    """layer1_o_proj_from_layer0: the per-layer weight pointer table is filled with a stride of 0 for o_proj, so
    layer 1 uses layer 0's o_proj. Trigger: any step (layer 1's o_proj is never read)."""

    def __init__(self, binding: Any) -> None:
        super().__init__(binding)
        self.layers[1].o_t = self.layers[0].o_t


class QNormLayersSwapped(HookedReference):
    """q_norm_layers_swapped (Qwen3): the q_norm pointers of layers 0 and 1 are swapped; every weight is still
    read, so only the outputs show it. Trigger: any step of a q/k-norm model."""

    def __init__(self, binding: Any) -> None:
        super().__init__(binding)
        a, b = self.layers[0], self.layers[1]
        a.q_norm, b.q_norm = b.q_norm, a.q_norm


class IgnoresKNorm(HookedReference):
    """ignores_k_norm (Qwen3): only q is RMS-normalised; K goes to RoPE and the cache raw.
    Trigger: any step of a q/k-norm model."""

    def _qk_norm(self, layer: int, w: LayerWeights, q: torch.Tensor, k: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        qn, _ = super()._qk_norm(layer, w, q, k)
        return qn, k


class MoeLastExpertAliased(HookedReference):
    """moe_last_expert_aliased (MoE): the expert pointer table is built with ``E - 1`` entries and the last
    expert's down projection aliases the one before it. The w2 tensor as a whole is still read, so only
    outputs of tokens routed to the last expert show it. Trigger: a step with a token routed to expert E-1."""

    def __init__(self, binding: Any) -> None:
        super().__init__(binding)
        for w in self.layers:
            if w.experts_w2_t is not None:
                w2 = w.experts_w2_t.clone()
                w2[-1] = w2[-2]
                w.experts_w2_t = w2


class IgnoresQkvBias(HookedReference):
    """ignores_qkv_bias (variant): the guard accepts ``attention_bias=True`` but the fused QKV GEMM has no bias
    epilogue. The tiny presets have no bias, so it equals the reference there.
    Trigger: variant llama-attention-bias."""

    def __init__(self, binding: Any) -> None:
        super().__init__(binding)
        for w in self.layers:
            w.qkv_bias = None


class IgnoresOProjBias(HookedReference):
    """ignores_o_proj_bias: the o_proj GEMM (fused with the residual add) drops the bias; the QKV bias is kept.
    The tiny presets have no bias. Trigger: variant llama-attention-bias."""

    def __init__(self, binding: Any) -> None:
        super().__init__(binding)
        for w in self.layers:
            w.o_bias = None


class LlamaTiedSeparateHead(HookedReference):
    """llama_tied_separate_head (variant): the Llama path packs its own LM-head buffer, filled only from an
    untied ``lm_head``; with ``tie_word_embeddings`` it stays the zero-filled workspace.
    Trigger: variant llama-tied (Qwen3 ties are handled; tiny-llama is untied)."""

    def __init__(self, binding: Any) -> None:
        super().__init__(binding)
        c = binding.model_config
        if c.architecture == "LlamaForCausalLM" and c.tie_word_embeddings:
            self.lm_head_t = binding.alloc_workspace("lm_head", tuple(self.embed.shape), self.dtype).t()


class MoeAlwaysNormTopk(HookedReference):
    """moe_always_norm_topk (variant): the router kernel always renormalises the top-k weights, ignoring
    ``norm_topk_prob=False``. Trigger: variant moe-no-norm-topk (tiny-qwen3-moe normalises)."""

    def __init__(self, binding: Any) -> None:
        super().__init__(binding)
        import dataclasses

        self.config = dataclasses.replace(self.config, norm_topk_prob=True)


class RopeLinearIgnored(HookedReference):
    """rope_linear_ignored (variant): builds its own RoPE tables and knows only the llama3 rope type, treating
    any other scaling (linear) as none. Trigger: variant llama-rope-linear (tiny-llama uses llama3)."""

    def __init__(self, binding: Any) -> None:
        super().__init__(binding)
        c = binding.model_config
        scaling = c.rope_scaling if (c.rope_scaling or {}).get("rope_type") == "llama3" else None
        cos, sin = rope_tables(c.head_dim, c.rope_theta, scaling, binding.engine_config.max_context_len,
                               binding.device)
        self.cos_table, self.sin_table = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
