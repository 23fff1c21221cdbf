"""Named model presets: real architectures at real (or tiny) shapes, for seeded random weights.

Latency depends on shapes, not on weight values, so a preset at real shapes gives real timings without
downloading weights (DESIGN.md §8). The tiny presets run on CPU in tests. Every preset's vocabulary holds
the built-in byte tokenizer (``lowlat.loader.tokenizer``: 256 bytes, ``<|bos|>`` = 256, ``<|eos|>`` = 257),
and every preset names those two ids as its bos/eos.

Real shapes follow the published HF config.json files of meta-llama/Llama-3.2-1B, Qwen/Qwen3-8B and
Qwen/Qwen3-30B-A3B.
"""

from __future__ import annotations

import dataclasses
import difflib
import re

from lowlat.config import ConfigError, ModelConfig

BYTE_BOS_ID = 256
BYTE_EOS_ID = 257
MIN_VOCAB = 258  # the byte tokenizer's 256 bytes plus <|bos|> and <|eos|>

_COMMON = dict(bos_token_id=BYTE_BOS_ID, eos_token_id=BYTE_EOS_ID, torch_dtype="bfloat16")

PRESETS: dict[str, ModelConfig] = {
    # Tiny Llama with a Llama-3 rope_scaling whose original context (256) puts the 16 rotary frequencies of
    # head_dim 32 in all three bands of the Llama-3 rule (kept, smoothed, divided by factor).
    # Tiny presets use head_dim 32, the smallest the vendor kernels take, so the contract suite runs them on CPU.
    "tiny-llama": ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-5,
        rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 256},
        **_COMMON,
    ),
    # Tiny Qwen3: tied embeddings, q/k norm, and num_heads * head_dim (256) != hidden_size (64) as in Qwen3-30B-A3B.
    "tiny-qwen3": ModelConfig(
        architecture="Qwen3ForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=32, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=4096, tie_word_embeddings=True,
        **_COMMON,
    ),
    "tiny-qwen3-moe": ModelConfig(
        architecture="Qwen3MoeForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=4096, tie_word_embeddings=False,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        **_COMMON,
    ),
    "llama-3.2-1b": ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
        **_COMMON,
    ),
    "qwen3-8b": ModelConfig(
        architecture="Qwen3ForCausalLM", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=False,
        **_COMMON,
    ),
    "qwen3-30b-a3b": ModelConfig(
        architecture="Qwen3MoeForCausalLM", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=False,
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
        **_COMMON,
    ),
}


def get_preset(name: str) -> ModelConfig:
    """The preset called ``name``.

    Raises:
        ConfigError: ``name`` is not a preset; the message lists the presets (and the closest match).
    """
    try:
        return PRESETS[name]
    except KeyError:
        close = closest_preset(name)
        hint = f" (did you mean {close!r}?)" if close else ""
        raise ConfigError(f"unknown preset {name!r}{hint}; presets: {', '.join(PRESETS)}") from None


def closest_preset(name: str, cutoff: float = 0.6) -> str | None:
    """The preset ``name`` most likely meant, or None: by spelling, or by its words in any order (``llama3-tiny``
    -> ``tiny-llama``, ``Qwen/Qwen3-8B`` -> ``qwen3-8b``), case-insensitively; ``cutoff`` is difflib's ratio."""
    def words(s: str) -> str:
        return " ".join(sorted(re.findall(r"[a-z]+|\d+", s.lower())))

    def score(p: str) -> float:
        return max(difflib.SequenceMatcher(None, name.lower(), p).ratio(),
                   difflib.SequenceMatcher(None, words(name), words(p)).ratio())

    best = max(PRESETS, key=score)
    return best if score(best) >= cutoff else None


def with_layers(config: ModelConfig, num_layers: int) -> ModelConfig:
    """``config`` with only its first ``num_layers`` decoder layers (for per-layer latency measurements).

    Layer-indexed fields (``mlp_only_layers``) keep the entries below ``num_layers``.

    Raises:
        ConfigError: ``num_layers`` < 1.
    """
    if num_layers < 1:
        raise ConfigError(f"num_layers must be >= 1, got {num_layers}")
    return dataclasses.replace(
        config,
        num_hidden_layers=num_layers,
        mlp_only_layers=tuple(i for i in config.mlp_only_layers if i < num_layers),
    )
