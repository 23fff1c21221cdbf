"""SiLU-and-mul of a fused gate/up projection: ``silu(gate) * up``, one Triton kernel.

    x = [gate | up]  ([T, 2I], the output of ``MergedColumnParallelLinear``)
    y = silu(gate).to(dtype) * up        (silu in float32, rounded to the dtype, then the product in the dtype)

That is ``F.silu(gate) * up`` of ``lowlat.models.llama.DenseMLP`` with torch's roundings: torch computes silu
in float32 for 16-bit inputs and rounds once, then rounds the product once. The plain forward launches two
kernels (silu, mul) and reads the [T, I] intermediate back; this reads x once and writes y once (the
``silu_and_mul`` op of vLLM and SGLang and Liger-Kernel's ``LigerSiLUMulFunction`` have the same contract; this
is written from the formula, not from their code).

Grid: ``(T, cdiv(I, BLOCK))``, one block of ``BLOCK`` columns per program.
Launched with ``enable_fp_fusion=False``: no multiply-add is contracted into an FMA, so every rounding is
torch's (eager torch never fuses them either).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from lowlat.kernels._launch import check_cpu_launch, check_row_major

__all__ = ["silu_and_mul"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_BLOCK = 1024


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n_cols, BLOCK: tl.constexpr, PRECISE_EXP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    dtype = out_ptr.dtype.element_ty
    g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + n_cols + offs, mask=mask, other=0.0)
    if PRECISE_EXP:  # a GPU: tl.exp is the approximate ex2-based exp there (10 ulps from torch seen in float32)
        e = libdevice.exp(-g)
    else:  # the interpreter (no libdevice there): numpy's exp, already precise
        e = tl.exp(-g)
    s = (g / (1.0 + e)).to(dtype)
    y = (s.to(tl.float32) * u.to(tl.float32)).to(dtype)
    tl.store(out_ptr + row * stride_o + offs, y, mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :I]) * x[:, I:]`` with I = x.shape[1] // 2.

    Args:
        x: [T, 2I] bf16/fp16/fp32, last dim contiguous (rows may be strided).
    Returns:
        a new contiguous [T, I] tensor in x's dtype, equal to ``F.silu(gate) * up`` of ``x.chunk(2, -1)``.
    Raises:
        ValueError: x not 2-D, an odd last dim, another dtype, a strided last dim, or CPU tensors without
            ``TRITON_INTERPRET=1``.
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"x must be a 2-D [T, 2I] tensor with an even last dim, got "
                         f"{tuple(getattr(x, 'shape', ()))}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"x must be bf16, fp16 or fp32, got {x.dtype}")
    check_row_major("x", x)
    if x.device.type == "cpu":
        check_cpu_launch("silu_and_mul", _silu_mul_kernel)
    t, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((t, inter), dtype=x.dtype, device=x.device)
    if t == 0 or inter == 0:
        return out
    _silu_mul_kernel[(t, triton.cdiv(inter, _BLOCK))](x, out, x.stride(0), out.stride(0), inter, BLOCK=_BLOCK,
                                                     PRECISE_EXP=x.device.type != "cpu",
                                                     num_warps=4, enable_fp_fusion=False)
    return out
