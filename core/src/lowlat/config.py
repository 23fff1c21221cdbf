"""EngineConfig (what the user asked for) and ModelConfig (what the checkpoint is).

Both are frozen dataclasses validated at construction, after mini-sglang's config style.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the fix."""


@dataclass(frozen=True)
class ModelConfig:
    """The model's shapes, from an HF ``config.json``.

    Sizes are in elements; ``head_dim`` defaults to hidden_size // num_attention_heads.
    MoE fields are zero / empty for dense models.
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
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.is_moe and not (self.num_experts_per_tok and self.moe_intermediate_size):
            raise ConfigError("a MoE model needs num_experts_per_tok and moe_intermediate_size")

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
        """Build from a parsed HF config.json. Raises ConfigError on an unknown architecture or missing key."""
        archs = d.get("architectures") or []
        if len(archs) != 1:
            raise ConfigError(f"config.json must name exactly one architecture, found {archs!r}")
        try:
            heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            eos = d.get("eos_token_id")
            return cls(
                architecture=archs[0],
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d.get("intermediate_size") or 0),
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=float(d.get("rope_theta", (d.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
                max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                rope_scaling=_rope_scaling(d),
                attention_bias=bool(d.get("attention_bias", False)),
                num_experts=int(d.get("num_experts") or d.get("num_local_experts") or 0),
                num_experts_per_tok=int(d.get("num_experts_per_tok") or 0),
                moe_intermediate_size=int(d.get("moe_intermediate_size") or 0),
                norm_topk_prob=bool(d.get("norm_topk_prob", True)),
                decoder_sparse_step=int(d.get("decoder_sparse_step") or 1),
                mlp_only_layers=tuple(d.get("mlp_only_layers") or ()),
                torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "bfloat16"),
                bos_token_id=d.get("bos_token_id"),
                eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            )
        except KeyError as e:
            raise ConfigError(f"config.json lacks required key {e.args[0]!r}") from None

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
        if isinstance(self.eos_token_id, tuple):
            d["eos_token_id"] = list(self.eos_token_id)
        if not self.is_moe:
            for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                      "decoder_sparse_step", "mlp_only_layers"):
                d.pop(k)
        return d


def _rope_scaling(d: dict[str, Any]) -> dict[str, Any] | None:
    rs = d.get("rope_scaling") or d.get("rope_parameters")
    if not rs:
        return None
    kind = rs.get("rope_type") or rs.get("type")
    if kind in (None, "default"):
        return None
    return dict(rs)


STEP_TIMEOUT_ENV = "LOWLAT_STEP_TIMEOUT"
DEFAULT_STEP_TIMEOUT_S = 60.0
_INT_FIELDS = ("tp_size", "page_size", "max_batch_size", "max_context_len", "max_verify_tokens",
               "chunked_prefill_size", "seed")
_BOOL_FIELDS = ("cuda_graph", "speculative")
_STR_FIELDS = ("model", "device", "dtype", "plugin")


def _check_types(cfg: EngineConfig) -> None:
    """Raise ConfigError naming the field when a value has the wrong type ("8" for an int, say)."""
    def bad(name: str, want: str) -> ConfigError:
        value = getattr(cfg, name)
        return ConfigError(f"EngineConfig.{name} must be {want}, got {value!r} ({type(value).__name__})")

    for name in _INT_FIELDS:
        v = getattr(cfg, name)
        if not isinstance(v, int) or isinstance(v, bool):
            raise bad(name, "an int")
    if cfg.num_layers is not None and (not isinstance(cfg.num_layers, int) or isinstance(cfg.num_layers, bool)):
        raise bad("num_layers", "an int or None")
    for name in _BOOL_FIELDS:
        if not isinstance(getattr(cfg, name), bool):
            raise bad(name, "a bool")
    for name in _STR_FIELDS:
        if not isinstance(getattr(cfg, name), str):
            raise bad(name, "a str")
    for name in ("kv_cache_fraction", "step_timeout_s"):
        v = getattr(cfg, name)
        if (v is not None or name == "kv_cache_fraction") and (not isinstance(v, (int, float)) or isinstance(v, bool)):
            raise bad(name, "a number")


@dataclass(frozen=True)
class EngineConfig:
    """What the user asked the engine for.

    Attributes:
        model: a checkpoint directory or a preset name (``lowlat.loader.presets``).
        device: "cpu", "cuda" or "auto" (cuda when available).
        dtype: "bfloat16", "float16", "float32" or "auto" (the checkpoint's dtype; float32 on CPU for bf16).
        tp_size: tensor-parallel ranks.
        page_size: KV slots per page (tokens).
        max_batch_size: requests that run together (and the largest CUDA graph captured).
        max_context_len: tokens per request, prompt plus completion.
        kv_cache_fraction: fraction of device memory left after weights and plugin workspaces
            that the KV pool may take (CUDA); on CPU the pool is sized for max_batch_size x max_context_len.
        cuda_graph: capture DECODE and VERIFY steps in CUDA graphs (CUDA only).
        max_verify_tokens: largest k+1 a VERIFY step may carry (graphs are captured for it).
        chunked_prefill_size: prompts longer than this are prefilled in chunks (tokens).
        plugin: "none", "auto" or a plugin name.
        seed: seed for presets' random weights and for sampling.
        speculative: the engine runs a speculative verifier (a feature plugins may require or refuse).
        num_layers: run only the first N decoder layers (benchmarks use two depths to get per-layer latency).
        step_timeout_s: deadline of one step, and of each cross-rank wait within it, in seconds; None reads
            LOWLAT_STEP_TIMEOUT, else 60 (below a typical serving watchdog). A missed deadline raises
            StepDeadlineExceeded and leaves the engine unusable (``lowlat.runtime.deadline``).
    """

    model: str = "tiny-llama"
    device: str = "auto"
    dtype: str = "auto"
    tp_size: int = 1
    page_size: int = 16
    max_batch_size: int = 8
    max_context_len: int = 2048
    kv_cache_fraction: float = 0.85
    cuda_graph: bool = True
    max_verify_tokens: int = 8
    chunked_prefill_size: int = 4096
    plugin: str = "auto"
    seed: int = 0
    speculative: bool = False
    num_layers: int | None = None
    step_timeout_s: float | None = None
    extra: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self) -> None:
        _check_types(self)
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {self.dtype!r}")
        for name in ("tp_size", "page_size", "max_batch_size", "max_context_len", "max_verify_tokens",
                     "chunked_prefill_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_layers is not None and self.num_layers < 1:
            raise ConfigError(f"num_layers must be >= 1 or None, got {self.num_layers}")
        if not 0.0 < self.kv_cache_fraction <= 1.0:
            raise ConfigError(f"kv_cache_fraction must be in (0, 1], got {self.kv_cache_fraction}")
        if not self.plugin:
            raise ConfigError("plugin must be 'none', 'auto' or a plugin name")
        if self.step_timeout_s is not None and not 0 < self.step_timeout_s < float("inf"):
            raise ConfigError(f"step_timeout_s must be a finite number of seconds > 0 or None, "
                              f"got {self.step_timeout_s}")

    @property
    def resolved_step_timeout_s(self) -> float:
        """The step deadline in seconds: ``step_timeout_s``, else LOWLAT_STEP_TIMEOUT, else 60.

        Raises:
            ConfigError: LOWLAT_STEP_TIMEOUT is not a positive finite number.
        """
        if self.step_timeout_s is not None:
            return float(self.step_timeout_s)
        raw = os.environ.get(STEP_TIMEOUT_ENV, "").strip()
        if not raw:
            return DEFAULT_STEP_TIMEOUT_S
        try:
            value = float(raw)
        except ValueError:
            value = float("nan")
        if not 0 < value < float("inf"):
            raise ConfigError(f"{STEP_TIMEOUT_ENV}={raw!r} must be a finite number of seconds > 0")
        return value

    @property
    def resolved_device(self) -> str:
        """"cuda" or "cpu" after resolving "auto"."""
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    def resolved_dtype(self, model: ModelConfig) -> torch.dtype:
        """The compute dtype: explicit, else the checkpoint's (bf16 becomes float32 on CPU for speed)."""
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        if self.resolved_device == "cpu":
            return torch.float32
        return DTYPES.get(model.torch_dtype, torch.bfloat16)
