"""``lowlat.fast_interpreter``: Triton's interpreter patches ``triton.language`` once per launch and helper module
instead of on every helper call, and skips the overflow sanitizer whose assertion it never evaluates; kernels
compute the same; ``LOWLAT_FAST_INTERPRETER=0`` and ``debug`` keep Triton's behaviour; a plugin built under the
interpreter gets it.

The interpreter state is process-wide, so each case runs in a fresh Python (about 2 s each)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# A kernel whose helper runs REPS times per launch (Triton's own tl.cdiv and tl.sum are helpers too), on 32-bit
# integers (the ops the sanitizer recomputes), plus a helper of another module that reaches triton.language only as
# ``triton.language.core`` (that module needs its own patch: unpatched, its static_range refuses to run); two
# launches; prints the outputs, how often _patch_lang ran and the sanitizer flag.
HELPER = """
import triton
import triton.language.core as tlc


@triton.jit
def add_sevens(x, N: tlc.constexpr):
    for _ in tlc.static_range(N):
        x = x + 7
    return x
"""
SCRIPT = r"""
import dataclasses, json, sys
import torch, triton, triton.language as tl
from triton.runtime import interpreter as ti
from lowlat import fast_interpreter
import helper_mod

patches = [0]
real = ti._patch_lang
def counting(fn):
    patches[0] += 1
    return real(fn)
ti._patch_lang = counting

@triton.jit
def _twice(x):
    return x * 2

@triton.jit
def _kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, REPS: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    acc = tl.load(x_ptr + offs, mask=offs < n, other=0)
    for _ in tl.static_range(REPS):
        acc = _twice(acc) - acc
    acc = helper_mod.add_sevens(acc, 3)
    tl.store(out_ptr + offs, acc * 3 + tl.cdiv(n, 4) + tl.sum(acc, axis=0) % 5, mask=offs < n)

if sys.argv[1] == "debug":
    ti.interpreter_builder.options = dataclasses.replace(ti.interpreter_builder.options, debug=True)
if sys.argv[1] == "build":  # a plugin built under the interpreter (core's fake "mirror" plugin)
    from lowlat import EngineConfig
    from lowlat.runtime import ModelRunner
    ModelRunner(EngineConfig(model="tiny-llama", device="cpu", dtype="float32", plugin="mirror",
                             max_batch_size=2, max_context_len=32), show_progress=False).close()
    active = fast_interpreter._INSTALLED
else:
    active = fast_interpreter.install() if sys.argv[1] != "none" else False
outs = []
for n in (10, 13):
    x = torch.arange(-5, n - 5, dtype=torch.int32)
    out = torch.zeros(n, dtype=torch.int32)
    _kernel[(2,)](x, out, n, BLOCK=16, REPS=20)
    outs.append(out.tolist())
print(json.dumps({"active": active, "outs": outs, "patches": patches[0],
                  "sanitize": ti.interpreter_builder.options.sanitize_overflow}))
"""
REPS, LAUNCHES, PROGRAMS = 20, 2, 2


def _run(mode: str, tmp_path, **env: str) -> dict:  # type: ignore[no-untyped-def]
    script = tmp_path / "kernel.py"
    script.write_text(SCRIPT)
    (tmp_path / "helper_mod.py").write_text(HELPER)
    full = {k: v for k, v in os.environ.items() if k != "LOWLAT_FAST_INTERPRETER"}
    full.update(TRITON_INTERPRET="1", **env)
    p = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, env=full, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> dict:  # type: ignore[no-untyped-def]
    return _run("none", tmp_path_factory.mktemp("plain"))


def test_triton_alone_patches_on_every_helper_call_and_sanitizes(plain: dict) -> None:
    """The baseline the speed-up is measured against (if Triton stops doing this, the module can go)."""
    assert plain["active"] is False and plain["sanitize"] is True
    assert plain["patches"] >= LAUNCHES * PROGRAMS * REPS, plain


def test_install_patches_once_per_launch_and_module_and_computes_the_same(plain: dict, tmp_path) -> None:
    fast = _run("fast", tmp_path)
    assert fast["active"] is True
    assert fast["outs"] == plain["outs"]
    # per launch: the launch itself, then the first call of each helper module (this file's _twice, helper_mod's
    # add_sevens, Triton's standard library's cdiv and sum) -- whatever the number of programs and helper calls
    assert fast["patches"] <= LAUNCHES * 4, fast
    assert fast["sanitize"] is False


def test_the_off_switch_keeps_tritons_behaviour(plain: dict, tmp_path) -> None:
    off = _run("fast", tmp_path, LOWLAT_FAST_INTERPRETER="0")
    assert off == plain


def test_debug_keeps_the_sanitizer_it_would_assert_with(tmp_path) -> None:
    """With ``debug`` on, ``device_assert`` evaluates the sanitizer's condition: then it is a check, and stays."""
    dbg = _run("debug", tmp_path)
    assert dbg["active"] is True and dbg["sanitize"] is True
    assert dbg["patches"] <= LAUNCHES * 4, dbg


def test_a_plugin_built_under_the_interpreter_installs_it(plain: dict, tmp_path) -> None:
    from plugin_dists import make_plugin_dist
    from plugin_fakes import mirror_source

    site = tmp_path / "site"
    site.mkdir()
    make_plugin_dist(site, "mirror", mirror_source(""))
    path = os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])
    built = _run("build", tmp_path, PYTHONPATH=path, LOWLAT_PLUGINS="mirror")
    assert built["active"] is True and built["sanitize"] is False
    assert built["outs"] == plain["outs"]


@pytest.mark.parametrize("missing", ["_patch_lang", "rewrite", "options", "sanitize_overflow"])
def test_another_triton_is_left_alone(monkeypatch: pytest.MonkeyPatch, missing: str) -> None:
    """A Triton whose interpreter lacks what ``install`` wraps gets nothing patched, and ``install`` says so."""
    import dataclasses
    import types

    import triton.runtime
    from lowlat import fast_interpreter

    @dataclasses.dataclass(frozen=True)
    class Options:
        debug: bool = False
        sanitize_overflow: bool = True

    @dataclasses.dataclass(frozen=True)
    class OptionsWithout:
        debug: bool = False

    class GridExecutor:
        def __call__(self) -> None: ...

    class InterpretedFunction:
        def __call__(self) -> None: ...

        def rewrite(self) -> None: ...

    if missing == "rewrite":
        del InterpretedFunction.rewrite
    builder = types.SimpleNamespace(options=OptionsWithout() if missing == "sanitize_overflow" else Options())
    if missing == "options":
        builder = types.SimpleNamespace()
    fake = types.SimpleNamespace(GridExecutor=GridExecutor, InterpretedFunction=InterpretedFunction,
                                 InterpreterError=RuntimeError, _patch_lang=lambda fn: None,
                                 interpreter_builder=builder)
    if missing == "_patch_lang":
        del fake._patch_lang
    calls = (GridExecutor.__call__, InterpretedFunction.__call__)
    monkeypatch.setattr(triton.runtime, "interpreter", fake)
    monkeypatch.setattr(fast_interpreter, "_INSTALLED", False)
    assert fast_interpreter.install() is False
    assert (GridExecutor.__call__, InterpretedFunction.__call__) == calls
    assert getattr(builder, "options", None) in (None, Options(), OptionsWithout())
