"""Rounding of fp32 values to the activation dtype, the same on GPUs and under the Triton interpreter.

``to_act`` / ``rnd`` are what storing an intermediate in bf16/fp16 does; every kernel of the plugin rounds where
the unfused torch path rounds (``small_gemm``'s docstring), so the CPU tests compare bit for bit where they can.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lowlat_nvidia_mega.kernels.pdl import interpreting

# The interpreter (triton 3.9) truncates fp32 -> bf16 casts instead of rounding to nearest even as GPUs do;
# ``to_act`` then rounds with integer arithmetic so CPU results round like the GPU's and like torch's.
_EMULATE_BF16_ROUNDING = tl.constexpr(interpreting())


@triton.jit
def to_act(x, dt: tl.constexpr):
    """Cast fp32 ``x`` to the activation dtype ``dt``, rounding to nearest even (also under the interpreter)."""
    if _EMULATE_BF16_ROUNDING:
        if dt == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            return x.to(dt)
    else:
        return x.to(dt)


@triton.jit
def rnd(x, dt: tl.constexpr):
    """fp32 ``x`` rounded to ``dt`` and back: what storing an intermediate in the activation dtype does."""
    return to_act(x, dt).to(tl.float32)
