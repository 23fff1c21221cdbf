"""The checkpoint variants the general path supports, as tiny configs: one list that tests and the contract share.

Each ``Variant`` is a tiny preset with some ModelConfig fields replaced. The differential tests against HF
transformers (core/tests) check the general forward on each; the contract suite (lowlat_contract) asks every
plugin to either refuse each variant in its guard, with a reason, or match the general path on it. A variant
added here is therefore checked everywhere at once. A variant is listed only when
core/tests/test_hf_differential*.py prove the general path equals transformers on it; ``UNSUPPORTED`` lists
config.json values the loader refuses by name (core/tests/test_config_audit.py), see docs/checkpoint-support.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from lowlat.config import ModelConfig
from lowlat.loader.presets import get_preset


@dataclass(frozen=True)
class Variant:
    """``preset`` (a tiny preset name) with ``overrides`` (ModelConfig field -> value) applied."""

    name: str
    preset: str
    overrides: dict[str, Any] = field(default_factory=dict)

    def config(self) -> ModelConfig:
        """The variant's ModelConfig. Raises ConfigError when the overrides make an invalid config."""
        return dataclasses.replace(get_preset(self.preset), **self.overrides)


SUPPORTED_VARIANTS: tuple[Variant, ...] = (
    Variant("llama-base", "tiny-llama"),  # GQA 4:2, llama3 rope, head_dim 32 != 64 / 4, untied
    Variant("llama-attention-bias", "tiny-llama", {"attention_bias": True}),
    Variant("llama-mlp-bias", "tiny-llama", {"mlp_bias": True}),
    Variant("llama-tied", "tiny-llama", {"tie_word_embeddings": True}),
    Variant("llama-mha", "tiny-llama", {"num_key_value_heads": 4}),
    Variant("llama-mqa", "tiny-llama", {"num_key_value_heads": 1}),
    Variant("llama-head-dim-implied", "tiny-llama", {"hidden_size": 128}),  # head_dim = hidden / heads
    Variant("llama-rope-default", "tiny-llama", {"rope_scaling": None}),
    Variant("llama-rope-linear", "tiny-llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    Variant("llama-eos-list", "tiny-llama", {"eos_token_id": (257, 3)}),
    Variant("qwen3-base", "tiny-qwen3"),  # tied, q/k norm, GQA 8:4, 8 * 32 != 64
    Variant("qwen3-untied", "tiny-qwen3", {"tie_word_embeddings": False}),
    Variant("qwen3-mha", "tiny-qwen3", {"num_key_value_heads": 8}),
    Variant("qwen3-mqa", "tiny-qwen3", {"num_key_value_heads": 1}),
    Variant("qwen3-attention-bias", "tiny-qwen3", {"attention_bias": True}),
    Variant("qwen3-rope-linear", "tiny-qwen3", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    Variant("moe-base", "tiny-qwen3-moe"),  # every layer sparse, norm_topk_prob true
    Variant("moe-no-norm-topk", "tiny-qwen3-moe", {"norm_topk_prob": False}),
    Variant("moe-dense-layer-0", "tiny-qwen3-moe", {"mlp_only_layers": (0,)}),
    Variant("moe-sparse-step-2", "tiny-qwen3-moe", {"decoder_sparse_step": 2}),
    Variant("moe-tied", "tiny-qwen3-moe", {"tie_word_embeddings": True}),
    Variant("moe-attention-bias", "tiny-qwen3-moe", {"attention_bias": True}),
    Variant("moe-rope-llama3", "tiny-qwen3-moe", {"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256}}),
)


@dataclass(frozen=True)
class Unsupported:
    """A config.json field value the loader refuses: ``preset``'s config.json with ``field`` set to ``value``."""

    name: str
    preset: str
    field: str
    value: Any

    def hf_dict(self) -> dict[str, Any]:
        """The refused config.json (a dict): the preset's, with the field replaced."""
        return {**get_preset(self.preset).to_hf_dict(), "rope_scaling": None, self.field: self.value}


_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256}
UNSUPPORTED: tuple[Unsupported, ...] = (
    Unsupported("llama-gelu", "tiny-llama", "hidden_act", "gelu"),
    Unsupported("qwen3-relu", "tiny-qwen3", "hidden_act", "relu"),
    Unsupported("llama-rope-yarn", "tiny-llama", "rope_parameters", _YARN),
    Unsupported("llama-rope-dynamic", "tiny-llama", "rope_parameters",
                {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
    Unsupported("qwen3-rope-longrope", "tiny-qwen3", "rope_parameters",
                {"rope_type": "longrope", "rope_theta": 1e6, "short_factor": [1.0] * 16, "long_factor": [2.0] * 16,
                 "original_max_position_embeddings": 256}),
    Unsupported("llama-partial-rotary", "tiny-llama", "partial_rotary_factor", 0.5),
    Unsupported("qwen3-sliding-window", "tiny-qwen3", "layer_types", ["full_attention", "sliding_attention"]),
    Unsupported("moe-sliding-window", "tiny-qwen3-moe", "use_sliding_window", True),
    Unsupported("llama-fp8", "tiny-llama", "quantization_config",
                {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}),
    Unsupported("qwen3-model-type", "tiny-qwen3", "model_type", "qwen2"),
)


def variant(name: str) -> Variant:
    """The supported variant called ``name``. Raises KeyError listing the names."""
    for v in SUPPORTED_VARIANTS:
        if v.name == name:
            return v
    raise KeyError(f"no variant {name!r}; known: {', '.join(v.name for v in SUPPORTED_VARIANTS)}")
