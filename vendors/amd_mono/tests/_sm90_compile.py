"""Compile amd_mono's persistent kernels for sm90 (H100/H200) without a GPU, at a real model's shapes.

Run by test_compile_sm90.py in a subprocess without TRITON_INTERPRET, with a JSON file of launches (label, kernel
name, signature, constexprs) the test collected from a MonoForward under the interpreter. Triton's code generation
and the bundled ptxas catch what the interpreter does not (types, unsupported ops, constexpr misuse). Prints per
compile "ok <label>", "v4 <label> <n>" (16-byte global loads in its PTX), "mma <label> <n>" (``mma`` / ``wgmma``
instructions: tensor-core dots) and "regs <label> <registers> <stack bytes>" (``cuobjdump -res-usage`` of the
cubin; -1 -1 without the bundled cuobjdump)."""
import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from lowlat_amd_mono.kernels import embed_head, k1_attn_in, k2_attn_out_mlp, step
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

KERNELS = {"k1_attn_in": k1_attn_in.k1_attn_in_kernel, "k2_attn_out_mlp": k2_attn_out_mlp.k2_dense_kernel,
           "k2_attn_out_moe": k2_attn_out_mlp.k2_moe_kernel, "step_dense": step.step_dense_kernel,
           "step_moe": step.step_moe_kernel, "head": embed_head.head_kernel}


def _cuobjdump() -> str:
    import triton.backends.nvidia as nv

    return os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump")


def registers(cubin: bytes) -> tuple[int, int]:
    """(registers, stack bytes) of the cubin's kernel (``cuobjdump -res-usage``; -1 without a cuobjdump)."""
    if not os.path.exists(_cuobjdump()):
        return -1, -1
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        r = subprocess.run([_cuobjdump(), "-res-usage", path], capture_output=True, text=True, check=True)
    m = re.search(r"REG:(\d+) STACK:(\d+)", r.stdout)
    return (int(m.group(1)), int(m.group(2))) if m else (-1, -1)


for launch in json.load(open(sys.argv[1])):
    fn = KERNELS[launch["name"]]
    label = launch.get("label", launch["name"])
    consts = {k: (None if v is None else v) for k, v in launch["constexprs"].items()}
    for k, v in list(consts.items()):
        if isinstance(v, str) and v.startswith("tl."):
            consts[k] = getattr(triton.language, v[3:])
    attrs = {(i,): [["tt.divisibility", 16]] for i in launch["aligned"]}
    src = ASTSource(fn=fn, signature=launch["signature"], constexprs=consts, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3})
    ptx = k.asm["ptx"]
    print("ok", label, "ptx bytes", len(ptx))
    print("v4", label, ptx.count("ld.global.v4") + ptx.count("ld.global.cg.v4"))
    print("mma", label, len(re.findall(r"\b(?:wg)?mma\.", ptx)))
    print("regs", label, *registers(k.asm["cubin"]), flush=True)
