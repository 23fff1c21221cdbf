"""ModelConfig: what the checkpoint is (its config.json, read the way transformers reads it: ``lowlat.hf_config``).

A frozen dataclass validated at construction, after mini-sglang's config style. ``lowlat.config`` re-exports it
beside EngineConfig (what the user asked for).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from lowlat.errors import ConfigError
from lowlat.hf_config import MAX_LAYERS, SUPPORTED_ROPE_TYPES, hf_config_fields

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


@dataclass(frozen=True)
class ModelConfig:
    """The model's shapes, from an HF ``config.json``.

    Sizes are in elements; ``head_dim`` defaults to hidden_size // num_attention_heads.
    MoE fields are zero / empty for dense models. ``mlp_bias`` (Llama only) adds biases to gate/up/down.
    ``from_hf_dict`` / ``from_dir`` read config.json as transformers does (``lowlat.hf_config``; the audit is
    docs/checkpoint-support.md). Construction validates every size (ints >= 1), eps and theta (> 0), the
    rope type, head_dim (even) and the special ids (< vocab_size).

    Raises:
        ConfigError: naming the field and the fix.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    torch_dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"unsupported architecture {self.architecture!r}; lowlat runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        sizes = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "max_position_embeddings"]
        if self.is_moe:
            sizes += ["num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"]
        for name in sizes:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"ModelConfig.{name}={v!r} must be an integer >= 1 (config.json field {name})")
        if self.num_hidden_layers > MAX_LAYERS:
            raise ConfigError(f"ModelConfig.num_hidden_layers={self.num_hidden_layers} exceeds {MAX_LAYERS}; "
                              "is config.json right?")
        for name in ("rms_norm_eps", "rope_theta"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ConfigError(f"ModelConfig.{name}={v!r} must be a finite number > 0 (config.json field {name})")
        if self.head_dim % 2:
            raise ConfigError(f"ModelConfig.head_dim={self.head_dim} must be even (RoPE rotates pairs)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.is_moe and self.num_experts_per_tok > self.num_experts:
            raise ConfigError(f"num_experts_per_tok={self.num_experts_per_tok} must be <= "
                              f"num_experts={self.num_experts}")
        if self.mlp_bias and self.architecture != "LlamaForCausalLM":
            raise ConfigError(f"mlp_bias=True is a LlamaForCausalLM field; {self.architecture} has no MLP biases")
        kind = (self.rope_scaling or {}).get("rope_type") or (self.rope_scaling or {}).get("type") or "default"
        if kind not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(f"rope_scaling rope_type={kind!r} is not supported; lowlat implements "
                              f"{', '.join(SUPPORTED_ROPE_TYPES)}")
        eos = self.eos_token_id if isinstance(self.eos_token_id, tuple) else (self.eos_token_id,)
        for name, ids in (("bos_token_id", (self.bos_token_id,)), ("eos_token_id", eos)):
            bad = [i for i in ids if i is not None and not 0 <= i < self.vocab_size]
            if bad:
                raise ConfigError(f"{name}={bad[0]} is outside the vocabulary (vocab_size={self.vocab_size}); "
                                  "fix config.json")

    @property
    def is_moe(self) -> bool:
        return self.architecture == "Qwen3MoeForCausalLM"

    @property
    def has_qk_norm(self) -> bool:
        """Qwen3 and Qwen3-MoE RMS-normalize q and k per head before RoPE."""
        return self.architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` has a sparse MoE block (HF Qwen3-MoE's rule)."""
        return (
            self.is_moe
            and layer not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a parsed HF config.json (``lowlat.hf_config``: transformers' defaults for absent fields).

        Raises:
            ConfigError: naming the field, its value and what is supported, for an unsupported architecture or
                feature, or an invalid value.
        """

        if not isinstance(d, dict):
            raise ConfigError(f"config.json must hold a JSON object, found {type(d).__name__}")
        return cls(**hf_config_fields(d))

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> ModelConfig:
        """Read ``path/config.json``. Raises ConfigError when it is missing or not JSON."""
        p = Path(path) / "config.json"
        if not p.is_file():
            raise ConfigError(f"{path} has no config.json; is it an HF checkpoint directory?")
        try:
            return cls.from_hf_dict(json.loads(p.read_text()))
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p} is not valid JSON: {e}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF config.json form of this config (round-trips through ``from_hf_dict``)."""
        d: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "architecture"}
        d["architectures"] = [self.architecture]
        d["model_type"] = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3",
                           "Qwen3MoeForCausalLM": "qwen3_moe"}[self.architecture]
        d["mlp_only_layers"] = list(self.mlp_only_layers)
        d["rope_scaling"] = dict(self.rope_scaling) if self.rope_scaling else None  # a copy: consumers mutate it
        if isinstance(self.eos_token_id, tuple):
            d["eos_token_id"] = list(self.eos_token_id)
        if self.architecture != "LlamaForCausalLM":
            d.pop("mlp_bias")
        if not self.is_moe:
            for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                      "decoder_sparse_step", "mlp_only_layers"):
                d.pop(k)
        return d
