"""The checkpoint variants the general path supports, as tiny configs: one list that tests and the contract share.

Each ``Variant`` is a tiny preset with some ModelConfig fields replaced. The differential tests against HF
transformers (core/tests) check the general forward on each; the contract suite (lowlat_contract) asks every
plugin to either refuse each variant in its guard, with a reason, or match the general path on it. A variant
added here is therefore checked everywhere at once.
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
    Variant("llama-base", "tiny-llama"),
    Variant("llama-attention-bias", "tiny-llama", {"attention_bias": True}),
    Variant("llama-tied", "tiny-llama", {"tie_word_embeddings": True}),
    Variant("llama-mha", "tiny-llama", {"num_key_value_heads": 4}),
    Variant("llama-mqa", "tiny-llama", {"num_key_value_heads": 1}),
    Variant("llama-rope-default", "tiny-llama", {"rope_scaling": None}),
    Variant("llama-rope-linear", "tiny-llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    Variant("qwen3-base", "tiny-qwen3"),
    Variant("qwen3-untied", "tiny-qwen3", {"tie_word_embeddings": False}),
    Variant("qwen3-mqa", "tiny-qwen3", {"num_key_value_heads": 1}),
    Variant("moe-base", "tiny-qwen3-moe"),
    Variant("moe-no-norm-topk", "tiny-qwen3-moe", {"norm_topk_prob": False}),
    Variant("moe-dense-layer-0", "tiny-qwen3-moe", {"mlp_only_layers": (0,)}),
    Variant("moe-sparse-step-2", "tiny-qwen3-moe", {"decoder_sparse_step": 2}),
)


def variant(name: str) -> Variant:
    """The supported variant called ``name``. Raises KeyError listing the names."""
    for v in SUPPORTED_VARIANTS:
        if v.name == name:
            return v
    raise KeyError(f"no variant {name!r}; known: {', '.join(v.name for v in SUPPORTED_VARIANTS)}")
