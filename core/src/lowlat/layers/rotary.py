"""Rotary position embedding, neox style (HF ``rotate_half``), with HF's inverse-frequency rules.

Formulas follow transformers' ``modeling_rope_utils``: default ``inv_freq = 1 / theta ** (arange(0, D, 2) / D)``;
``linear`` divides it by ``factor``; ``llama3`` (``_compute_llama3_parameters``) divides low frequencies by
``factor``, keeps high ones and interpolates between them with ``low_freq_factor`` / ``high_freq_factor`` /
``original_max_position_embeddings``. cos/sin are computed in float32 as ``pos * inv_freq`` and cast to the
activation dtype before use, as HF's ``LlamaRotaryEmbedding.forward`` does.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies (CPU).

    Raises:
        ValueError: for a rope type other than default, linear and llama3, or a llama3 dict missing a key.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim))
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]  # type: ignore[index]
    if kind != "llama3":
        raise ValueError(f"rope_scaling type {kind!r} is not supported; lowlat implements {SUPPORTED_ROPE_TYPES}")
    try:
        factor = scaling["factor"]  # type: ignore[index]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]  # type: ignore[index]
        old_len = scaling["original_max_position_embeddings"]  # type: ignore[index]
    except KeyError as e:
        raise ValueError(f"llama3 rope_scaling lacks {e.args[0]!r}") from None
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_angles(head_dim: int, theta: float, scaling: dict[str, Any] | None, max_positions: int,
                device: torch.device | str) -> torch.Tensor:
    """[max_positions, head_dim / 2] float32 angles ``float(pos) * inv_freq`` on ``device``.

    The single source of the general path's RoPE tables and of ``lowlat.plugin.rope_tables`` (plugin API 2),
    so plugins get them bit for bit. Raises ValueError for an unsupported rope type (see ``rope_inv_freq``).
    """
    inv_freq = rope_inv_freq(head_dim, theta, scaling).to(device)
    return torch.arange(max_positions, device=device, dtype=torch.int64).float()[:, None] * inv_freq


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [..., D]: (x1, x2) -> (-x2, x1) over the two halves of the last dim."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D], cos/sin [T, D] in x's dtype -> [T, heads, D]: x*cos + rotate_half(x)*sin."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions ``[0, max_positions)``, built once on ``device``.

    Buffers (not parameters): ``cos_cache`` and ``sin_cache`` [max_positions, D] float32, where
    ``max_positions`` is the engine's max context length when given (so a 128k-position model does not pay for
    128k rows), else ``max_position_embeddings``. Positions at or beyond it are out of range: the runtime
    never schedules them (they exceed the KV pool's ``max_context_len``).
    """

    cos_cache: torch.Tensor
    sin_cache: torch.Tensor

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None, max_positions: int,
                 *, device: torch.device) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
        freqs = rope_angles(head_dim, theta, scaling, max_positions, device)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.max_positions = max_positions
        self.register_buffer("cos_cache", emb.cos(), persistent=False)
        self.register_buffer("sin_cache", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> (cos, sin), each [T, D] in ``dtype``."""
        return self.cos_cache[positions].to(dtype), self.sin_cache[positions].to(dtype)
