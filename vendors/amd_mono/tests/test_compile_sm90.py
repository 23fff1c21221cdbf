"""amd_mono's persistent kernels (K1, K2 and the one-launch step) compile for sm90 at llama-3.2-1b's and
qwen3-30b-a3b's shapes on a machine without a GPU (Triton's compiler and its bundled ptxas)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("collects the launches from a MonoForward on CPU: needs TRITON_INTERPRET=1", allow_module_level=True)
pytest.importorskip("triton.backends.compiler")

from lowlat.loader.presets import get_preset, with_layers  # noqa: E402
from lowlat_amd_mono.forward import MonoForward  # noqa: E402
from lowlat_amd_mono.kernels import plan as P  # noqa: E402
from lowlat_amd_mono.kernels.launch import MonoOptions  # noqa: E402
from mono_testutil import MAX_CTX, Setup, empty_params, make_pool, new_requests, step_batch  # noqa: E402

SCRIPT = Path(__file__).with_name("_sm90_compile.py")
_DT = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.int32: "i32", torch.int64: "i64"}


def _describe(name: str, kernel, args: tuple, meta: dict) -> dict:
    """A launch as the compile script takes it: signature by argument, constexprs, the 16-byte aligned pointers."""
    names = kernel.arg_names
    meta = {**meta, "STAGE": -1, "INTERP": False, "TIMER": 1, "XC": ".cg"}
    sig, consts, aligned = {}, {}, []
    pos = 0
    for i, n in enumerate(names):
        if n in meta:
            sig[n] = "constexpr"
            v = meta[n]
            consts[n] = f"tl.{v.name.replace('bf16', 'bfloat16').replace('fp32', 'float32')}" if hasattr(v, "name") \
                and not isinstance(v, (bool, int, float, str)) else v
            continue
        a = args[pos]
        pos += 1
        if isinstance(a, torch.Tensor):
            sig[n] = "*" + _DT[a.dtype]
            aligned.append(i)
        elif isinstance(a, float):
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
    assert pos == len(args), (name, pos, len(args))
    return {"name": name, "signature": sig, "constexprs": consts, "aligned": aligned}


@pytest.mark.parametrize("preset", ["llama-3.2-1b", "qwen3-30b-a3b"])
def test_persistent_kernels_compile_for_sm90(preset: str, tmp_path: Path) -> None:
    cfg = dataclasses.replace(with_layers(get_preset(preset), 2), vocab_size=512)
    dtype, dev = torch.bfloat16, torch.device("cpu")
    fwd = MonoForward(model_config=cfg, params=empty_params(cfg, dtype), dtype=dtype, device=dev,
                      alloc_workspace=lambda n, s, d: torch.zeros(s, dtype=d), max_context_len=MAX_CTX,
                      options=MonoOptions(staged=False, one_launch=True))
    fwd.plan = P.MonoPlan.build(fwd.dims, 132 * (2 if fwd.dims.any_moe else 1))  # the H200's grid and tiles
    pool = make_pool(Setup(cfg, None, None, dtype, dev), num_pages=8, fill_seed=None)
    fwd.attach_kv_pool(pool)
    rows = new_requests(pool, [5])
    batch = step_batch(pool, rows, 1, torch.zeros(1, dtype=torch.int64))
    shape = fwd.plan.step_shape(1, 1)
    launches = [_describe(*[x for i, x in enumerate(fwd.step_launch(batch, shape)) if i != 2])]
    name, kernel, _, args, meta = fwd.k2_launch(0, batch, shape)
    launches.append(_describe(name, kernel, args, meta))
    spec = tmp_path / "launches.json"
    spec.write_text(json.dumps(launches))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(SCRIPT), str(spec)], capture_output=True, text=True, env=env, timeout=900)
    if r.returncode and "ptxas" in r.stderr and "not found" in r.stderr:
        pytest.skip("this Triton has no bundled ptxas")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("ok ") == 2, r.stdout
    v4 = {ln.split()[1]: int(ln.split()[2]) for ln in r.stdout.splitlines() if ln.startswith("v4 ")}
    # The weights reached through the pointer table load 16 bytes at a time, as those passed as arguments do.
    assert v4[launches[0]["name"]] >= v4[name] > 0, r.stdout
