"""Mutation pass of the fused core kernels: break each kernel in one place, run its test file, expect a failure.

    .venv/bin/python bench/scripts/mutate_fused_kernels.py      # from the repository root

Each mutation is applied to the source, core/tests/test_kernels_fused.py runs under TRITON_INTERPRET=1, and the
source is restored (``mutation_runner.run``). Prints CAUGHT (with the first failing test) or MISSED per mutation;
exits 1 if any was missed.
"""

import os
import pathlib
import sys

import mutation_runner  # same directory

K = pathlib.Path("core/src/lowlat/kernels")
EDITS = [  # (file under K, original text, mutated text)
    ("rms_norm.py", "mean_sq = tl.sum(xf * xf, axis=0) / n_cols", "mean_sq = tl.sum(xf * xf, axis=0) / BLOCK"),
    ("rms_norm.py", "(1.0 / tl.sqrt(mean_sq + eps))", "(1.0 / tl.sqrt(mean_sq))"),
    ("rms_norm.py", "tl.store(res_out_ptr + row * stride_ro + offs, x, mask=mask)",
     "tl.store(res_out_ptr + row * stride_ro + offs, r, mask=mask)"),
    ("rms_norm.py", "y = (w.to(tl.float32) * h.to(tl.float32)).to(dtype)",  # the product without the cast first
     "y = (w.to(tl.float32) * xf * (1.0 / tl.sqrt(mean_sq + eps))).to(dtype)"),
    ("rope_kv.py", "o1 = ((x1f * c).to(dtype).to(tl.float32) - (x2f * s)",
     "o1 = ((x1f * c).to(dtype).to(tl.float32) + (x2f * s)"),
    ("rope_kv.py", "k_row = k_ptr + slot * stride_kt", "k_row = k_ptr + t * stride_kt"),
    ("rope_kv.py", "v_src = qkv_ptr + t * stride_qkv + (NUM_Q + NUM_KV + kv_head) * HEAD_DIM",
     "v_src = qkv_ptr + t * stride_qkv + (NUM_Q + kv_head) * HEAD_DIM"),
    ("rope_kv.py", "w1 = tl.where(is_q, tl.load(qn_ptr", "w1 = tl.where(not is_q, tl.load(qn_ptr"),
    ("rope_kv.py", "mean_sq = (tl.sum(x1f * x1f, axis=0) + tl.sum(x2f * x2f, axis=0)) / HEAD_DIM",
     "mean_sq = tl.sum(x1f * x1f, axis=0) * 2 / HEAD_DIM"),
    ("rope_kv.py", "c = tl.load(cos_ptr + pos * stride_cos + offs", "c = tl.load(cos_ptr + t * stride_cos + offs"),
    ("rope_kv.py", "(x1f * c).to(dtype).to(tl.float32) - (x2f * s).to(dtype).to(tl.float32)).to(dtype)",
     "(x1f * c) - (x2f * s)).to(dtype)"),  # one rounding instead of torch's three
    ("silu_mul.py", "s = (g / (1.0 + e)).to(dtype)", "s = (1.0 / (1.0 + e)).to(dtype)"),
    ("silu_mul.py", "row * stride_x + n_cols + offs", "row * stride_x + offs"),
    ("silu_mul.py", "offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)", "offs = tl.arange(0, BLOCK)"),
    ("moe_gemv.py", "x_row = x_ptr + (p // TOP_K) * stride_x", "x_row = x_ptr + (p % TOP_K) * stride_x"),
    ("moe_gemv.py", "(n[:, None] + INTER) * stride_wn", "(n[:, None] + 1) * stride_wn"),
    ("moe_gemv.py", "total += (acc.to(dtype).to(tl.float32) * wt)", "total += (acc.to(dtype).to(tl.float32) * 1.0)"),
    ("moe_gemv.py", "        e = tl.load(ids_ptr + p).to(tl.int64)\n        wt",
     "        e = tl.load(ids_ptr + t).to(tl.int64)\n        wt"),
    ("moe_gemv.py", "for k0 in range(0, HIDDEN, BLOCK_K):", "for k0 in range(0, HIDDEN - BLOCK_K, BLOCK_K):"),
]


M = [(f"{f}: {new[:70]}", K / f, old, new) for f, old, new in EDITS]  # (name, file, original, mutated)


if __name__ == "__main__":  # importing this file must not mutate the tree
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
    sys.exit(mutation_runner.run(M, "core/tests/test_kernels_fused.py", env))
