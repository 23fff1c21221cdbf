"""Faster Triton interpreter runs (``TRITON_INTERPRET=1``): the same kernels, computed the same way, in about half the
time. Installed by ``PluginHost.build`` whenever a plugin is built under the interpreter (``lowlat run`` on a CPU,
tensor-parallel ranks, the contract suite, the vendors' tests), and by the vendors' scripts in ``--smoke`` mode.

Two kinds of redundant work go (checked on Triton 3.6 and 3.9, whose interpreters these lines follow):

1. **Re-patching on every helper call.** The interpreter re-runs ``_patch_lang`` on every call of a ``@triton.jit``
   helper, and that walks every member of ``triton.language`` (about 7 ms a call). Within one launch the repeats are
   redundant: the launch already patched ``triton.language``, and a helper's own patch is never undone until the
   launch ends. ``install`` keeps the first patch per helper module per launch and skips the rest.
2. **The integer-overflow sanitizer without its assertion.** The interpreter's options are fixed at
   ``sanitize_overflow=True, debug=False``. With them every 32-bit integer ``+ - *`` is recomputed in 64 bits and
   compared against the 32-bit range, and the resulting condition goes to ``device_assert``, which returns without
   looking at it unless ``debug`` is on (``triton.language.semantic``: ``binary_op_sanitize_overflow_impl``,
   ``device_assert``). So it checks nothing, at about a third of the interpreter's time. ``install`` turns
   ``sanitize_overflow`` off only while ``debug`` is off; were ``debug`` on, the check would be real and it stays.

Measured (bench/results/2026-12-08-cpu-fast-interpreter, ``bench/scripts/interpreter_step_time.py``): one nvidia_mega
DECODE step of 8 rows on tiny-llama with sampled ids, 3.02 s without either, 1.99 s with (1) only, 1.30 s with both;
nvidia_mega's covering contract run 687 s with (1) only, 458 s with both.

``LOWLAT_FAST_INTERPRETER=0`` turns both off (Triton's own behaviour). Without the interpreter's internals that it
wraps (another Triton), ``install`` does nothing.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

_INSTALLED = False


def install() -> bool:
    """Install both speed-ups once per process (idempotent; cheap to call again).

    Returns:
        Whether they are active: False under ``LOWLAT_FAST_INTERPRETER=0``, without Triton, or when its interpreter
        lacks ``GridExecutor``, ``InterpretedFunction.rewrite``, ``InterpreterError``, ``_patch_lang`` or
        ``interpreter_builder.options``.
    """
    global _INSTALLED
    if _INSTALLED:
        return True
    if os.environ.get("LOWLAT_FAST_INTERPRETER", "1") == "0":
        return False
    try:
        from triton.runtime import interpreter as ti
    except ImportError:
        return False
    needed = ("GridExecutor", "InterpretedFunction", "InterpreterError", "_patch_lang", "interpreter_builder")
    if not all(hasattr(ti, n) for n in needed) or not hasattr(ti.InterpretedFunction, "rewrite"):
        return False
    options = getattr(ti.interpreter_builder, "options", None)
    if not dataclasses.is_dataclass(options) or not hasattr(options, "sanitize_overflow"):
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
    if not getattr(options, "debug", True):
        ti.interpreter_builder.options = dataclasses.replace(options, sanitize_overflow=False)
    _INSTALLED = True
    return True
