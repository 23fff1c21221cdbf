"""Mutation pass of the interpreter speed-up (core's ``lowlat/fast_interpreter.py`` and its install in
``PluginHost._build``): break it in one place, run core/tests/test_fast_interpreter.py, expect a failure.

    .venv/bin/python bench/scripts/mutate_fast_interpreter.py   # from the repository root

Prints CAUGHT (with the first failing test) or MISSED per mutation; exits 1 if any was missed.
"""

import os
import pathlib
import sys

import mutation_runner  # same directory

F = pathlib.Path("core/src/lowlat/fast_interpreter.py")
H = pathlib.Path("core/src/lowlat/runtime/plugin_host/host.py")
M = [  # (name, file, original text, mutated text)
    ("patched on every helper call", F, "            patched.add(key)\n", "            pass\n"),
    ("helpers never patched", F, "        if key not in patched:\n", "        if False:\n"),
    ("the sanitizer kept", F,
     "        ti.interpreter_builder.options = dataclasses.replace(options, sanitize_overflow=False)", "        pass"),
    ("the sanitizer dropped under debug too", F, '    if not getattr(options, "debug", True):', "    if True:"),
    ("the off switch ignored", F, '    if os.environ.get("LOWLAT_FAST_INTERPRETER", "1") == "0":', "    if False:"),
    ("never installed", F, "    ti.InterpretedFunction.__call__ = device_call\n", ""),
    ("the helper's result dropped", F, "            return fn(*args, **kwargs)", "            fn(*args, **kwargs)"),
    ("the internals not checked", F,
     '    if not all(hasattr(ti, n) for n in needed) or not hasattr(ti.InterpretedFunction, "rewrite"):',
     "    if False:"),
    ("rewrite not checked", F, ' or not hasattr(ti.InterpretedFunction, "rewrite"):', ":"),
    ("the options not checked", F,
     '    if not dataclasses.is_dataclass(options) or not hasattr(options, "sanitize_overflow"):', "    if False:"),
    ("not installed at build", H, "            fast_interpreter.install()\n", "            pass\n"),
    ("installed only off the interpreter", H, "        if triton_interpreter_enabled():  # the plugin's kernels",
     "        if not triton_interpreter_enabled():  # the plugin's kernels"),
]

if __name__ == "__main__":
    env = {**os.environ, "PYTHONPATH": "core/tests"}
    sys.exit(mutation_runner.run(M, "core/tests/test_fast_interpreter.py", env))
