"""RMSNorm, computed exactly as HF Llama/Qwen3 do (``LlamaRMSNorm`` in transformers).

    y = weight * (x_f32 * rsqrt(mean(x_f32 ** 2, -1) + eps)).to(x.dtype)

The product with ``weight`` happens in the input dtype, after the cast (HF's order), so bf16 results match HF.
"""

from __future__ import annotations

import torch
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS-normalize the last dim of ``x`` ([..., N], any float dtype) and scale by ``weight`` ([N])."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim with a learned ``weight`` [dim] (replicated under TP)."""

    def __init__(self, dim: int, eps: float, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., dim] -> [..., dim], same dtype."""
        return rms_norm(x, self.weight, self.eps)
