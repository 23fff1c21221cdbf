"""Compile the peer all-reduce kernel for sm90 (H100/H200) without a GPU (Triton's code generation and its bundled
ptxas), and print, per configuration, the memory operations of its PTX as one JSON line. Run by
test_peer_allreduce.py in a subprocess without TRITON_INTERPRET."""
import json
import re

import triton
from lowlat.kernels.peer_allreduce import _peer_all_reduce_kernel
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

OPS = r"(atom\.[\w.]+|ld\.volatile[\w.]*|bar\.sync|%globaltimer)"
for dt, world, push, reduce, timer in (("bf16", 2, True, True, 1), ("fp32", 4, True, False, 1),
                                       ("fp16", 8, False, True, 0)):
    sig = {"x_ptr": f"*{dt}", "out_ptr": f"*{dt}", "data_ptrs": "*i64", "flag_ptrs": "*i64", "ctl_ptr": "*i64",
           "tag_ptr": "*i32", "n": "i32", "cap": "i32", "rank": "i32", "host_tag": "i32", "deadline": "i64",
           "site": "i32", "publish": "i32"}
    consts = dict(WORLD=world, WPAD=world, BLOCK=1024, PUSH=push, REDUCE=reduce, TIMER=timer)
    sig.update({k: "constexpr" for k in consts})
    k = triton.compile(ASTSource(fn=_peer_all_reduce_kernel, signature=sig, constexprs=consts),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    print(json.dumps({"config": [dt, world, push, reduce, timer], "cubin": len(k.asm["cubin"]),
                      "ops": sorted(set(re.findall(OPS, k.asm["ptx"])))}))
