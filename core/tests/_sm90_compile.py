"""Compile the fused core kernels for sm90 (H100/H200) without a GPU: Triton's code generation and the bundled
ptxas catch what the interpreter does not (types, unsupported ops, constexpr misuse). Run by
test_kernels_sm90_compile.py in a subprocess without TRITON_INTERPRET; prints "ok <kernel>" per compile."""
import triton
from lowlat.kernels.moe_gemv import _moe_down_kernel, _moe_gate_up_kernel
from lowlat.kernels.rms_norm import _rms_norm_kernel
from lowlat.kernels.rope_kv import _qk_norm_rope_kv_kernel
from lowlat.kernels.silu_mul import _silu_mul_kernel
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

target = GPUTarget("cuda", 90, 32)


def build(fn, sig, consts, **opts):
    src = ASTSource(fn=fn, signature=sig, constexprs=consts)
    k = triton.compile(src, target=target, options={"num_warps": opts.get("num_warps", 4),
                                                    "enable_fp_fusion": False})
    print("ok", fn.__name__, consts, "ptx bytes", len(k.asm["ptx"]))


for dt in ("bf16", "fp32"):
    p = f"*{dt}"
    build(_rms_norm_kernel, {"x_ptr": p, "res_ptr": p, "w_ptr": p, "out_ptr": p, "res_out_ptr": p, "stride_x": "i32",
                             "stride_r": "i32", "stride_o": "i32", "stride_ro": "i32", "n_cols": "i32", "eps": "fp32",
                             "HAS_RESIDUAL": "constexpr", "BLOCK": "constexpr"}, {"HAS_RESIDUAL": True, "BLOCK": 2048})
    build(_rms_norm_kernel, {"x_ptr": p, "res_ptr": p, "w_ptr": p, "out_ptr": p, "res_out_ptr": p, "stride_x": "i32",
                             "stride_r": "i32", "stride_o": "i32", "stride_ro": "i32", "n_cols": "i32", "eps": "fp32",
                             "HAS_RESIDUAL": "constexpr", "BLOCK": "constexpr"}, {"HAS_RESIDUAL": False, "BLOCK": 4096})
    for norm in (True, False):
        sig = {"qkv_ptr": p, "pos_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "qn_ptr": p, "kn_ptr": p,
               "loc_ptr": "*i64", "q_out_ptr": p, "k_ptr": p, "v_ptr": p}
        for s in ("stride_qkv", "stride_cos", "stride_sin", "stride_qot", "stride_qoh", "stride_kt", "stride_kh",
                  "stride_vt", "stride_vh"):
            sig[s] = "i32"
        sig.update(eps="fp32", NUM_Q="constexpr", NUM_KV="constexpr", HEAD_DIM="constexpr", HALF_BLOCK="constexpr",
                   HAS_NORM="constexpr")
        build(_qk_norm_rope_kv_kernel, sig, {"NUM_Q": 32, "NUM_KV": 4, "HEAD_DIM": 128, "HALF_BLOCK": 64,
                                             "HAS_NORM": norm}, num_warps=1)
    build(_silu_mul_kernel, {"x_ptr": p, "out_ptr": p, "stride_x": "i32", "stride_o": "i32", "n_cols": "i32",
                             "BLOCK": "constexpr", "PRECISE_EXP": "constexpr"}, {"BLOCK": 1024, "PRECISE_EXP": True})
    build(_moe_gate_up_kernel, {"x_ptr": p, "ids_ptr": "*i64", "w13_ptr": p, "act_ptr": p, "stride_x": "i32",
                                "stride_we": "i32", "stride_wn": "i32", "stride_a": "i32", "HIDDEN": "i32",
                                "INTER": "i32", "TOP_K": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"},
          {"TOP_K": 8, "BLOCK_N": 16, "BLOCK_K": 256})
    build(_moe_down_kernel, {"act_ptr": p, "ids_ptr": "*i64", "wts_ptr": p, "w2_ptr": p, "out_ptr": p,
                             "stride_a": "i32", "stride_we": "i32", "stride_wn": "i32", "stride_o": "i32",
                             "HIDDEN": "i32", "INTER": "i32", "TOP_K": "constexpr", "BLOCK_N": "constexpr",
                             "BLOCK_K": "constexpr"}, {"TOP_K": 8, "BLOCK_N": 16, "BLOCK_K": 256})
