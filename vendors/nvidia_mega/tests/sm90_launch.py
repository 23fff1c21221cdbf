"""Capture a Triton launch made by a host launcher and compile it for sm90 as the runtime would, without a GPU
(shared by the opt-in ``test_compile_sm90_*.py`` checks; needs no ``TRITON_INTERPRET``).

The launch is captured from the launcher itself, called on meta tensors (nothing allocated), and its signature is
specialized as Triton's runtime does it (``native_specialize_impl``: an int equal to 1 becomes a constant, a
multiple of 16 gets a divisibility hint, unless the kernel says ``do_not_specialize``).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch
import triton
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import native_specialize_impl

META = torch.device("meta")
PTR = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.int32: "*i32", torch.int64: "*i64"}
OPTIONS = ("num_warps", "num_stages")


Launch = tuple[str, tuple[int, ...], tuple[Any, ...], dict[str, Any]]  # (kernel name, grid, args, kwargs)


class LaunchRecorder:
    """Stands in for a ``@triton.jit`` kernel named ``name``: each ``kernel[grid](*args, **kwargs)`` appends
    ``(name, grid, args, kwargs)`` to ``log`` (shared by the recorders of one test) and launches nothing."""

    def __init__(self, name: str, log: list[Launch]) -> None:
        self.name, self.log = name, log

    def __getitem__(self, grid: tuple[int, ...]):  # type: ignore[no-untyped-def]
        return lambda *args, **kwargs: self.log.append((self.name, grid, args, kwargs))


def capture(monkeypatch: pytest.MonkeyPatch, module: ModuleType, name: str, launch: Callable[[], None],
            pdl_modules: tuple[ModuleType, ...] = ()) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run ``launch()`` with ``module.<name>`` (a kernel) replaced by a recorder; return the one launch's bound
    arguments (by parameter name) and its ``num_warps`` / ``num_stages``. ``pdl_modules``' ``pdl_supported`` is
    made true (meta tensors stand in for a GPU)."""
    kernel = getattr(module, name)
    log: list[Launch] = []
    monkeypatch.setattr(module, name, LaunchRecorder(name, log))
    for m in pdl_modules:
        monkeypatch.setattr(m, "pdl_supported", lambda device=None: True)
    launch()
    (_, _, args, kwargs), = log
    names = kernel.arg_names
    bound = dict(zip(names, args, strict=False)) | {k: v for k, v in kwargs.items() if k in names}
    return bound, {k: kwargs[k] for k in OPTIONS if k in kwargs}


def compile_ptx(kernel: Any, bound: dict[str, Any], options: dict[str, Any]) -> str:
    """Specialize ``bound`` as the runtime would and compile ``kernel`` for sm90; returns the PTX."""
    sig: dict[str, str] = {}
    consts: dict[str, Any] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for i, p in enumerate(kernel.params):
        v = bound[p.name]
        if p.is_constexpr:
            sig[p.name], consts[p.name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[p.name] = PTR[v.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]  # CUDA allocations are 256-byte aligned
        else:
            ty, key = native_specialize_impl(BaseBackend, v, False, not p.do_not_specialize,
                                             not p.do_not_specialize_on_alignment)
            sig[p.name] = ty
            if ty == "constexpr":
                consts[p.name] = key
            elif key == "D":
                attrs[(i,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(ASTSource(kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                              options=options)
    return compiled.asm["ptx"]
