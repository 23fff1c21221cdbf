"""The general forward of Qwen3MoeForCausalLM: the Qwen3 decoder with sparse MoE blocks.

Layer ``i`` has a SparseMoeBlock when ``ModelConfig.is_moe_layer(i)`` (HF's rule: not in ``mlp_only_layers``
and ``(i + 1) % decoder_sparse_step == 0``), else a dense SwiGLU MLP of ``intermediate_size``
(HF ``modeling_qwen3_moe``).
"""

from __future__ import annotations

from torch import nn

from lowlat.layers.moe import SparseMoeBlock
from lowlat.models.llama import LlamaForCausalLM


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Same constructor, forward and ``load_weights`` as LlamaForCausalLM; MoE layers per the config.

    Raises:
        ValueError: when the config has no experts (``num_experts == 0``), or moe_intermediate_size does not
            divide by the TP size.
    """

    def make_mlp(self, layer_id: int) -> nn.Module:
        c = self.config
        if c.num_experts <= 0:
            raise ValueError(
                f"{c.architecture} config has num_experts={c.num_experts}; config.json must give num_experts "
                "(transformers 5.x writes it as num_local_experts)"
            )
        if not c.is_moe_layer(layer_id):
            return super().make_mlp(layer_id)
        return SparseMoeBlock(c.hidden_size, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
                              c.norm_topk_prob, tp=self.tp, dtype=self.dtype, device=self.device,
                              site=2 * layer_id + 1)
