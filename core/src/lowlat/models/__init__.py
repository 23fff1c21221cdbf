"""General forwards by HF architecture name, and ``build_model``.

A small registry (mini-sglang style): architecture -> ``"module:Class"``, imported on first use.
Every model class has the constructor ``(config, *, dtype, device, tp, max_context_len, attention_backend)``,
``load_weights(iterable of (hf_name, tensor))`` and ``forward(batch, kv_pool) -> float32 logits [R, vocab]``.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

from lowlat.config import ModelConfig
from lowlat.distributed import TPInfo

MODEL_REGISTRY: dict[str, str] = {
    "LlamaForCausalLM": "lowlat.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "lowlat.models.llama:LlamaForCausalLM",
    "Qwen3MoeForCausalLM": "lowlat.models.qwen3_moe:Qwen3MoeForCausalLM",
}

CausalLM = nn.Module
"""The type ``build_model`` returns: an nn.Module with ``forward(batch, kv_pool)`` and ``load_weights``."""


class UnknownArchitecture(ValueError):
    """``build_model`` was given an architecture with no general forward."""


def model_class(architecture: str) -> type[nn.Module]:
    """The general-forward class of an HF architecture name. Raises UnknownArchitecture listing the known ones."""
    try:
        target = MODEL_REGISTRY[architecture]
    except KeyError:
        raise UnknownArchitecture(
            f"no general forward for architecture {architecture!r}; lowlat has {', '.join(sorted(MODEL_REGISTRY))}"
        ) from None
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)


def build_model(config: ModelConfig, *, dtype: torch.dtype, device: torch.device | str,
                tp: TPInfo | None = None, max_context_len: int | None = None,
                attention_backend: str = "auto") -> CausalLM:
    """Create the general forward of ``config.architecture`` with empty parameters on ``device``.

    Args:
        config: the checkpoint's ModelConfig.
        dtype: parameter/activation dtype.
        device: where the parameters are allocated (once; ``load_weights`` fills them in place).
        tp: this rank's TPInfo; None = unsharded.
        max_context_len: the engine's longest sequence (bounds the RoPE tables).
        attention_backend: "auto", "torch" or "triton".

    Raises:
        UnknownArchitecture: for an architecture outside MODEL_REGISTRY.
        ValueError: for a TP size that does not divide the model's heads or intermediate sizes.
    """
    cls = model_class(config.architecture)
    return cls(config, dtype=dtype, device=device, tp=tp, max_context_len=max_context_len,  # type: ignore[call-arg]
               attention_backend=attention_backend)


__all__ = ["MODEL_REGISTRY", "CausalLM", "UnknownArchitecture", "build_model", "model_class"]
