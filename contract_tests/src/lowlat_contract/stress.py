"""Value-range stress: the tiny presets' random weights give attention scores below about 10, where a kernel that
is only right for small values (a softmax without the running maximum, an fp16 accumulator, an exp2 without
range reduction) cannot be told from a right one. ``scale_attention_scores`` multiplies what sets the scores'
scale in place, so both paths see the same larger scores: the q/k RMSNorm weights where the model has them
(Qwen3: a q/k projection scale would be normalised away), else the q and k rows of the fused QKV projection
(and their bias). Scores then grow by ``factor ** 2``.
"""

from __future__ import annotations

from typing import Any

import torch

FACTOR = 12.0
"""q and k each x 12: scores x 144, about 150-1500 on the tiny presets (float32 exp overflows past 88.7)."""


@torch.no_grad()
def scale_attention_scores(model: Any, config: Any, factor: float) -> list[str]:
    """Scale q and k of every layer of ``model`` (a general model at TP size 1) by ``factor`` in place.

    Args:
        model: the ``torch.nn.Module`` whose parameters the plugin is built from (``runner.model``).
        config: its ModelConfig (head counts and head_dim).
    Returns:
        The names of the parameters changed.
    Raises:
        ValueError: the model has neither q/k norms nor a ``qkv_proj.weight`` of the expected rows.
    """
    params = dict(model.named_parameters())
    norms = [n for n in params if n.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight"))]
    if norms:
        for n in norms:
            params[n].mul_(factor)
        return norms
    rows = (config.num_attention_heads + config.num_key_value_heads) * config.head_dim
    want = rows + config.num_key_value_heads * config.head_dim
    names = [n for n in params if n.endswith("self_attn.qkv_proj.weight") or n.endswith("self_attn.qkv_proj.bias")]
    if not names or any(params[n].shape[0] != want for n in names):
        raise ValueError(f"scale_attention_scores: expected q/k norms or qkv_proj tensors of {want} rows, found "
                         f"{[(n, tuple(params[n].shape)) for n in names]}")
    for n in names:
        params[n][:rows].mul_(factor)
    return names
