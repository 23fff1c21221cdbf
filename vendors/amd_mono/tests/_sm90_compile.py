"""Compile amd_mono's persistent kernels for sm90 (H100/H200) without a GPU, at a real model's shapes.

Run by test_compile_sm90.py in a subprocess without TRITON_INTERPRET, with a JSON file of launches (kernel name,
signature, constexprs) the test collected from a MonoForward under the interpreter. Triton's code generation and
the bundled ptxas catch what the interpreter does not (types, unsupported ops, constexpr misuse). Prints
"ok <kernel>" per compile, and "v4 <kernel> <n>" with the count of 16-byte global loads in its PTX."""
import json
import sys

import triton
from lowlat_amd_mono.kernels import k1_attn_in, k2_attn_out_mlp, step
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

KERNELS = {"k1_attn_in": k1_attn_in.k1_attn_in_kernel, "k2_attn_out_mlp": k2_attn_out_mlp.k2_dense_kernel,
           "k2_attn_out_moe": k2_attn_out_mlp.k2_moe_kernel, "step_dense": step.step_dense_kernel,
           "step_moe": step.step_moe_kernel}

for launch in json.load(open(sys.argv[1])):
    fn = KERNELS[launch["name"]]
    consts = {k: (None if v is None else v) for k, v in launch["constexprs"].items()}
    for k, v in list(consts.items()):
        if isinstance(v, str) and v.startswith("tl."):
            consts[k] = getattr(triton.language, v[3:])
    attrs = {(i,): [["tt.divisibility", 16]] for i in launch["aligned"]}
    src = ASTSource(fn=fn, signature=launch["signature"], constexprs=consts, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3})
    print("ok", launch["name"], "ptx bytes", len(k.asm["ptx"]))
    print("v4", launch["name"], k.asm["ptx"].count("ld.global.v4") + k.asm["ptx"].count("ld.global.cg.v4"))
