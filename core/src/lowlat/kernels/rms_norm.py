"""RMSNorm with an optional fused residual add, one Triton program per token row.

    r = x + residual                    (rounded to the dtype: this is the new residual, as ``x + y`` in torch)
    y = weight * (r_f32 * rsqrt(mean(r_f32 ** 2) + eps)).to(dtype)    (the product in the dtype)

The math and its order are exactly ``lowlat.layers.norm.rms_norm`` (HF ``LlamaRMSNorm``): the normalisation in
float32, the cast to the activation dtype, then the product with ``weight`` rounded once in the dtype. Only the
order of the sum of squares differs from torch's, so float32 results agree within an ulp or two.

Design: the residual stream is carried beside the normed activations so each decoder layer needs one kernel
where the plain forward launches an add, a cast, a square, a mean, an rsqrt and two products (vLLM's
``fused_add_rms_norm`` CUDA op and Liger-Kernel's ``LigerRMSNorm`` Triton kernel use the same row-per-program
layout; this is written from the formula above, not from their code). The whole row sits in registers
(``BLOCK = next_power_of_2(hidden)``), so a row is read once and written once (twice with the residual).
Launched with ``enable_fp_fusion=False``: no multiply-add is contracted into an FMA, so every rounding is
torch's (eager torch never fuses them either).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowlat.kernels._launch import check_cpu_launch, check_row_major

__all__ = ["fused_add_rms_norm", "rms_norm"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_r, stride_o, stride_ro,
    n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)  # the add's rounded result is the new residual
        tl.store(res_out_ptr + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    mean_sq = tl.sum(xf * xf, axis=0) / n_cols
    h = (xf * (1.0 / tl.sqrt(mean_sq + eps))).to(dtype)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    y = (w.to(tl.float32) * h.to(tl.float32)).to(dtype)  # one rounding: torch's product in the dtype
    tl.store(out_ptr + row * stride_o + offs, y, mask=mask)


def _check(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a 2-D [T, H] tensor, got {getattr(x, 'shape', type(x).__name__)}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"x must be bf16, fp16 or fp32, got {x.dtype}")
    if weight.shape != (x.shape[1],) or weight.dtype != x.dtype:
        raise ValueError(f"weight must be {x.dtype} [{x.shape[1]}], got {weight.dtype} {tuple(weight.shape)}")
    if weight.shape[0] > 1 and weight.stride(0) != 1:
        raise ValueError("weight must be contiguous")
    check_row_major("x", x)
    tensors = [x, weight]
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"residual must be {x.dtype} {tuple(x.shape)}, got {residual.dtype} "
                             f"{tuple(residual.shape)}")
        check_row_major("residual", residual)
        tensors.append(residual)
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"x, residual and weight must be on one device, got {[str(t.device) for t in tensors]}")
    if x.device.type == "cpu":
        check_cpu_launch("rms_norm", _rms_norm_kernel)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    _check(x, residual, weight)
    t, h = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    res_out = torch.empty_like(out) if residual is not None else None
    if t == 0 or h == 0:
        return out, res_out
    block = triton.next_power_of_2(h)
    num_warps = 4 if block <= 2048 else (8 if block <= 8192 else 16)
    res = residual if residual is not None else x
    ro = res_out if res_out is not None else out
    _rms_norm_kernel[(t,)](
        x, res, weight, out, ro,
        x.stride(0), res.stride(0), out.stride(0), ro.stride(0),
        h, float(eps),
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=num_warps, enable_fp_fusion=False,
    )
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of x.

    Args:
        x: [T, H] bf16/fp16/fp32, last dim contiguous (rows may be strided).
        weight: [H], x's dtype, contiguous.
        eps: added to the mean square (``rms_norm_eps``).
    Returns:
        a new contiguous [T, H] tensor in x's dtype, equal to ``lowlat.layers.norm.rms_norm(x, weight, eps)``.
    Raises:
        ValueError: bad shapes, dtypes, strides or devices, or CPU tensors without ``TRITON_INTERPRET=1``.
    """
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``r = x + residual; return rms_norm(r, weight, eps), r`` in one kernel.

    Args:
        x, residual: [T, H], one dtype (bf16/fp16/fp32), last dim contiguous.
        weight: [H] in that dtype; eps: float.
    Returns:
        (normed [T, H], new residual [T, H]), both new contiguous tensors in x's dtype; the new residual is the
        dtype-rounded sum, bit for bit what ``x + residual`` gives.
    Raises:
        ValueError: as ``rms_norm``, and when residual's shape or dtype differs from x's.
    """
    out, res = _launch(x, residual, weight, eps)
    assert res is not None
    return out, res
