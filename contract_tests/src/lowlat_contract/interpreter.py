"""A speed-up for Triton's interpreter, for test runs: patch ``triton.language`` once per launch and module.

Triton's interpreter (checked on 3.6-3.9) re-runs ``_patch_lang`` on every call of a ``@triton.jit`` helper,
and that walks every member of ``triton.language`` (about 7 ms a call). Plugin kernels call small helpers
thousands of times per step, so a tiny-model step of amd_mono took about a minute on CPU. Within one launch the repeated
patches are redundant: the launch already patched ``triton.language``, and a helper's own patch is never
undone until the launch ends. ``install`` keeps the first patch per helper module per launch and skips the
rest, which cuts a step to a few seconds without changing what any kernel computes.

The contract suite installs it when TRITON_INTERPRET=1 (vendors' own test suites may call ``install`` too);
it does nothing if the interpreter lacks the internals it wraps, and ``LOWLAT_FAST_INTERPRETER=0`` turns it
off. It changes how often the interpreter patches, never what a kernel computes.
"""

from __future__ import annotations

import os
from typing import Any

_INSTALLED = False


def install() -> bool:
    """Install the speed-up once per process; returns whether it is active."""
    global _INSTALLED
    if _INSTALLED:
        return True
    if os.environ.get("LOWLAT_FAST_INTERPRETER", "1") == "0":
        return False
    try:
        from triton.runtime import interpreter as ti
    except ImportError:
        return False
    needed = ("GridExecutor", "InterpretedFunction", "InterpreterError", "_patch_lang")
    if not all(hasattr(ti, n) for n in needed) or not hasattr(ti.InterpretedFunction, "rewrite"):
        return False
    patched: set[int] = set()
    grid_call = ti.GridExecutor.__call__

    def launch(self: Any, *args: Any, **kwargs: Any) -> Any:
        patched.clear()
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            patched.clear()

    def device_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        key = id(self.fn.__globals__)
        if key not in patched:
            ti._patch_lang(self.fn)
            patched.add(key)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise ti.InterpreterError(repr(e)) from e

    ti.GridExecutor.__call__ = launch
    ti.InterpretedFunction.__call__ = device_call
    _INSTALLED = True
    return True
