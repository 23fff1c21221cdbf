"""Mutation pass of amd_mono's one-row FMA GEMV (``ROW1``: kernels/gemv_row1.py, its uses in the stages, and the host
choice): break it in one place, run its CPU tests, expect a failure.

    PYTHONPATH=core/src:contract_tests/src:vendors/amd_mono/src .venv/bin/python bench/scripts/mutate_amd_row1.py

Each mutation is applied to the source, vendors/amd_mono/tests/test_row1.py runs under TRITON_INTERPRET=1 (the tile
functions against a float64 reference with HF's roundings, whole one-row steps against the tl.dot form and the
general path, the ROW1 choice and its option), and the source is restored. Prints CAUGHT (with the first failing
test) or MISSED per mutation; exits 1 if any was missed. No tensor-core dot in the compiled one-row GEMVs and their
16-byte weight loads are not visible on CPU: test_compile_sm90.py checks them in the PTX.
"""

import os
import pathlib
import sys

import mutation_runner  # same directory

SRC = pathlib.Path("vendors/amd_mono/src/lowlat_amd_mono")
G = SRC / "kernels/gemv_row1.py"
K1 = SRC / "kernels/k1_attn_in.py"
K2 = SRC / "kernels/k2_attn_out_mlp.py"
MOE = SRC / "kernels/moe.py"
PL = SRC / "kernels/plan.py"
L = SRC / "kernels/launch.py"
F = SRC / "forward.py"
M = [  # (name, file, original text, mutated text)
    # the norm of the one row, rounded where HF rounds
    ("RMSNorm: x * rstd not rounded", G, "return rnd(rnd(a * rstd, DT, INTERP) * w, DT, INTERP)",
     "return rnd(a * rstd * w, DT, INTERP)"),
    ("RMSNorm: weight * h not rounded", G, "return rnd(rnd(a * rstd, DT, INTERP) * w, DT, INTERP)",
     "return rnd(a * rstd, DT, INTERP) * w"),
    ("RMSNorm: norm weight dropped", G, "return rnd(rnd(a * rstd, DT, INTERP) * w, DT, INTERP)",
     "return rnd(rnd(a * rstd, DT, INTERP), DT, INTERP)"),
    ("RMSNorm: norm weight read past K", G, "    w = tl.load(lnw_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)\n"
     "    return rnd(rnd(a * rstd", "    w = tl.load(lnw_ptr + ks).to(tl.float32)\n    return rnd(rnd(a * rstd"),
    ("RMSNorm: mean over one chunk, not K", G, "tl.rsqrt(tl.sum(ss, axis=0) / K + eps)",
     "tl.rsqrt(tl.sum(ss, axis=0) / BK + eps)"),
    ("RMSNorm: statistics of the first chunk only", G, "        r = rstd1(x_ptr, K, eps, BK, XC)",
     "        r = rstd1(x_ptr, BK, eps, BK, XC)"),
    # loads
    ("x read past K", G, "return tl.load(a_ptr + ks, mask=ks < K, other=0.0, cache_modifier=XC).to(tl.float32)",
     "return tl.load(a_ptr + ks, cache_modifier=XC).to(tl.float32)"),
    ("weight K mask dropped", G, "mask=(rows[:, None] < N) & (ks[None, :] < K), other=0.0)",
     "mask=rows[:, None] < N, other=0.0)"),
    ("weight rows strided by K, not the row stride", G,
     "w = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride + ks[None, :],",
     "w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + ks[None, :],"),
    # K ranges and accumulation
    ("first chunk counted twice", G, "acc1 = gemv1_loop(acc1, a_ptr, w_ptr, w_stride, row0, N, k_start + BK, k_end,",
     "acc1 = gemv1_loop(acc1, a_ptr, w_ptr, w_stride, row0, N, k_start, k_end,"),
    ("first chunk's x from K = 0, not k_start", G,
     "x1_chunk(a_ptr, k_start, K, rstd, lnw_ptr, NORM, BK, DT, INTERP, XC))",
     "x1_chunk(a_ptr, 0, K, rstd, lnw_ptr, NORM, BK, DT, INTERP, XC))"),
    ("loop runs to K, not k_end", G, "row0, N, k_start + BK, k_end, K, rstd, lnw_ptr, NORM,",
     "row0, N, k_start + BK, K, K, rstd, lnw_ptr, NORM,"),
    ("loop step of two chunks", G,
     "    for k in range(k_start, k_end, BK):\n        w = load_w1(",
     "    for k in range(k_start, k_end, 2 * BK):\n        w = load_w1("),
    ("pair: up accumulates the gate's first chunk", G, "fma1(tl.zeros([BN], tl.float32), wu0, x)",
     "fma1(tl.zeros([BN], tl.float32), wg0, x)"),
    ("pair: up rows of the loop from the gate rows", G, "wu = load_w1(w_ptr, u0, N,", "wu = load_w1(w_ptr, g0, N,"),
    ("pair: loop's x not normalized", G, "x = x1_chunk(a_ptr, k, K, rstd, lnw_ptr, NORM, BK,",
     "x = x1_chunk(a_ptr, k, K, rstd, lnw_ptr, False, BK,"),
    ("pair without a first chunk: up into the gate accumulator", G,
     "acc_g, acc_u = gemv1_2_loop(z, z, a_ptr, w_ptr, w_stride, g0, u0,",
     "acc_u, acc_g = gemv1_2_loop(z, z, a_ptr, w_ptr, w_stride, g0, u0,"),
    # the stages
    ("QKV: a K split runs to H, not its own end", K1, "nt * BN, NQKV, k0, k1, H,", "nt * BN, NQKV, k0, H, H,"),
    ("o_proj: K stops at half", K2, "i * BN, H, 0, KO, KO,", "i * BN, H, 0, KO // 2, KO,"),
    ("expert down: routing-weighted x not rounded", MOE,
     "rnd(load_x1(actm_ptr + u * (8 * IM), k, IM, BK, XC) * wu1, DT, INTERP)",
     "load_x1(actm_ptr + u * (8 * IM), k, IM, BK, XC) * wu1"),
    ("expert down: slot 0's routing weight for every slot", MOE,
     "wu1 = tl.load(slot_w_ptr + u * 16, cache_modifier=XC)", "wu1 = tl.load(slot_w_ptr, cache_modifier=XC)"),
    ("expert down: slot 0's activations for every slot", MOE, "load_x1(actm_ptr + u * (8 * IM), k,",
     "load_x1(actm_ptr, k,"),
    # the host
    ("ROW1 at two rows too", F, "return rows == 1 and self.options.row1_fma",
     "return rows <= 2 and self.options.row1_fma"),
    ("row1_fma ignored", F, "return rows == 1 and self.options.row1_fma", "return rows == 1"),
    ("LM head never ROW1", F, "PREC=self._prec, USE_PDL=self.options.pdl, ROW1=self.row1(rows))",
     "PREC=self._prec, USE_PDL=self.options.pdl, ROW1=False)"),
    ("option lost in resolve", L, "gemv_prefetch=opts.gemv_prefetch, row1_fma=opts.row1_fma,",
     "gemv_prefetch=opts.gemv_prefetch,"),
    ("register budget: experts' gate/up counted as one weight", PL, "eup=fit(self.eup, 2)", "eup=fit(self.eup)"),
    ("register budget: bk halved one step too far", PL, "while bk > 16 and self.bn * bk * weights > budget:",
     "while bk > 16 and self.bn * bk * weights >= budget:"),
]

if __name__ == "__main__":
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    sys.exit(mutation_runner.run(M, "vendors/amd_mono/tests/test_row1.py", env))
