"""Checks shared by the launchers of the small fused kernels (rms_norm, rope_kv, silu_mul)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def interpreting(kernel: object) -> bool:
    """True when ``kernel`` was built by Triton's interpreter (TRITON_INTERPRET=1 when its module was imported)."""
    return not isinstance(kernel, triton.runtime.JITFunction)


def check_cpu_launch(name: str, kernel: object) -> None:
    """CPU tensors need the interpreter, for the kernel and for triton.language's own jit helpers (tl.sum, ...).

    Raises:
        ValueError: naming ``name``, when either was built without TRITON_INTERPRET=1.
    """
    if not interpreting(kernel):
        raise ValueError(f"{name} got CPU tensors but Triton is not in interpreter mode; use the torch reference "
                         "on CPU, or set TRITON_INTERPRET=1 before importing triton")
    if isinstance(tl.sum, triton.runtime.JITFunction):
        raise ValueError("TRITON_INTERPRET=1 was set after triton was first imported; set it before the first "
                         "`import triton` (for pytest: at the top of conftest.py)")


def check_row_major(name: str, t: torch.Tensor) -> None:
    """The last dim must be contiguous (rows may be strided). Raises ValueError naming ``name``."""
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension (stride {t.stride(-1)}); "
                         f"pass {name}.contiguous()")
