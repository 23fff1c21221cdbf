"""amd_mono's persistent kernels (K1, K2 and the one-launch step) compile for sm90 at llama-3.2-1b's and
qwen3-30b-a3b's shapes on a machine without a GPU (Triton's compiler and its bundled ptxas), at one row in both
GEMV forms: the one-row FMA form (``ROW1``) and the ``tl.dot`` form. Run with ``-s`` to see register counts."""

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
from lowlat_amd_mono import forward as fwd_mod  # noqa: E402
from lowlat_amd_mono.forward import MonoForward  # noqa: E402
from lowlat_amd_mono.kernels import plan as P  # noqa: E402
from lowlat_amd_mono.kernels.launch import MonoOptions  # noqa: E402
from mono_testutil import MAX_CTX, Setup, empty_params, make_pool, new_requests, step_batch  # noqa: E402

SCRIPT = Path(__file__).with_name("_sm90_compile.py")
_DT = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.int32: "i32", torch.int64: "i64"}


def _describe(name: str, kernel, args: tuple, meta: dict, label: str = "", stage: int = -1, **over) -> dict:
    """A launch as the compile script takes it: signature by argument, constexprs, the 16-byte aligned pointers
    (``stage``: the ``STAGE`` constexpr; ``over``: constexprs replaced)."""
    names = kernel.arg_names
    meta = {**meta, "STAGE": stage, "INTERP": False, "TIMER": 1, "XC": ".cg", **over}
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
    return {"name": name, "label": label or name, "signature": sig, "constexprs": consts, "aligned": aligned}


@pytest.mark.parametrize("preset", ["llama-3.2-1b", "qwen3-30b-a3b"])
def test_persistent_kernels_compile_for_sm90(preset: str, tmp_path: Path) -> None:
    cfg = dataclasses.replace(with_layers(get_preset(preset), 2), vocab_size=512)
    dtype, dev = torch.bfloat16, torch.device("cpu")
    fwd = MonoForward(model_config=cfg, params=empty_params(cfg, dtype), dtype=dtype, device=dev,
                      alloc_workspace=lambda n, s, d: torch.zeros(s, dtype=d), max_context_len=MAX_CTX,
                      options=MonoOptions(staged=False, one_launch=True, row1_fma=True))
    fwd.plan = P.MonoPlan.build(fwd.dims, 132 * (2 if fwd.dims.any_moe else 1))  # the H200's grid and tiles
    pool = make_pool(Setup(cfg, None, None, dtype, dev), num_pages=8, fill_seed=None)
    fwd.attach_kv_pool(pool)
    rows = new_requests(pool, [5])
    batch = step_batch(pool, rows, 1, torch.zeros(1, dtype=torch.int64))
    shape = fwd.plan.step_shape(1, 1)
    assert fwd.row1(1) and fwd.plan_for(1) == fwd.plan  # a one-row step: ROW1, with the production tiles
    step_args = [x for i, x in enumerate(fwd.step_launch(batch, shape)) if i != 2]
    launches = [_describe(*step_args), _describe(*step_args, f"{step_args[0]}.bm16", ROW1=False)]
    name, kernel, stage_items, args, meta = fwd.k2_launch(0, batch, shape)
    assert meta["ROW1"] is True
    launches.append(_describe(name, kernel, args, meta))
    launches.append(_describe(name, kernel, args, meta, f"{name}.bm16", ROW1=False))
    # The GEMV stages alone (STAGE = id: no attention, whose tl.dot stays): no tensor-core dot at ROW1.
    k1, k1_kernel, _, k1_args, k1_meta = fwd.k1_launch(0, batch, shape)
    gemv = [_describe(k1, k1_kernel, k1_args, k1_meta, f"{k1}.qkv.row1", P.S_QKV)]
    gemv += [_describe(name, kernel, args, meta, f"{name}.{fwd.stage_name(0, st)}.row1", st)
             for st in stage_items if st >= P.S_OPROJ]
    grid, h_args, h_meta = fwd.head_launch(torch.zeros(1, cfg.vocab_size))
    gemv.append(_describe("head", fwd_mod.head_kernel, h_args, h_meta, "head.row1"))
    launches += gemv + [_describe("head", fwd_mod.head_kernel, h_args, h_meta, "head.bm16", ROW1=False)]
    spec = tmp_path / "launches.json"
    spec.write_text(json.dumps(launches))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(SCRIPT), str(spec)], capture_output=True, text=True, env=env, timeout=900)
    if r.returncode and "ptxas" in r.stderr and "not found" in r.stderr:
        pytest.skip("this Triton has no bundled ptxas")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("ok ") == len(launches), r.stdout
    out = {(ln.split()[0], ln.split()[1]): [int(v) for v in ln.split()[2:]] for ln in r.stdout.splitlines()
           if ln.split()[0] in ("v4", "mma", "regs")}
    print(f"\n{preset} sm90 registers (stack bytes): " + ", ".join(
        f"{la}: {out['regs', la][0]} ({out['regs', la][1]})" for la in (x["label"] for x in launches)))
    # The weights reached through the pointer table load 16 bytes at a time, as those passed as arguments do.
    assert out["v4", launches[0]["label"]][0] >= out["v4", name][0] > 0, r.stdout
    for la in (x["label"] for x in gemv):  # the one-row GEMVs: FMA only, weights in 16-byte loads
        assert out["mma", la] == [0] and out["v4", la][0] > 0, (la, r.stdout)
    assert out["mma", "head.bm16"][0] > 0 and out["mma", f"{name}.bm16"][0] > 0  # the count sees tl.dot
    assert all(v[0] > 0 or v == [-1, -1] for k, v in out.items() if k[0] == "regs"), r.stdout
