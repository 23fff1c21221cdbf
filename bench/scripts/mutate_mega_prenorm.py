"""Mutation pass of nvidia_mega's prenorm path (kernels/norm_rows.py, qkv_rope's ``HAS_NORM``, MegaForward's choice
through ``norm_rows.prenorm_step``, and the same rule in bench_kernels.py and tune_plans.py): break it in one place,
run its CPU tests, expect a failure.

    PYTHONPATH=core/src:vendors/nvidia_mega/src .venv/bin/python bench/scripts/mutate_mega_prenorm.py   # from the root

Each mutation is applied to the source, vendors/nvidia_mega/tests/test_kernels_norm.py (the kernels' mutants), the
prenorm and one-row steps of test_forward.py (MegaForward's) or test_plans.py's norm-prologue test (the benchmarks')
run under TRITON_INTERPRET=1, and the source is restored. Prints CAUGHT (with the first failing
test) or MISSED per mutation; exits 1 if any was missed. PDL (nothing read before ``gdc_wait``) is not visible on
CPU: test_compile_sm90.py checks the compiled PTX.
"""

import os
import pathlib
import sys

import mutation_runner  # same directory

N = pathlib.Path("vendors/nvidia_mega/src/lowlat_nvidia_mega/kernels/norm_rows.py")
Q = pathlib.Path("vendors/nvidia_mega/src/lowlat_nvidia_mega/kernels/qkv_rope.py")
F = pathlib.Path("vendors/nvidia_mega/src/lowlat_nvidia_mega/forward.py")
B = pathlib.Path("vendors/nvidia_mega/src/lowlat_nvidia_mega/build.py")
BK = pathlib.Path("vendors/nvidia_mega/bench_kernels.py")
TP = pathlib.Path("vendors/nvidia_mega/tune_plans.py")
KERNELS = [  # (name, file, original text, mutated text): checked by test_kernels_norm.py
    ("norm weight not applied", N, "h = load_rows(x_ptr, stride_xm, offs_m, m_mask, ks, k_mask, rstd, nw_ptr, True)",
     "h = load_rows(x_ptr, stride_xm, offs_m, m_mask, ks, k_mask, rstd, nw_ptr, False)"),
    ("statistics over the chunk, not the row", N, "rstd = row_rstd(x_ptr, stride_xm, offs_m, m_mask, K, eps, "
     "RSTD_BLOCK)", "rstd = row_rstd(x_ptr, stride_xm, offs_m, m_mask, BLOCK_K, eps, BLOCK_K)"),
    ("store ignores the column mask", N, "mask=m_mask[:, None] & k_mask[None, :])", "mask=m_mask[:, None])"),
    ("store ignores the row mask", N, "mask=m_mask[:, None] & k_mask[None, :])", "mask=k_mask[None, :])"),
    ("output row stride taken from x", N, "h_ptr + offs_m[:, None] * stride_hm + ks[None, :]",
     "h_ptr + offs_m[:, None] * stride_xm + ks[None, :]"),
    ("one program too few", N, "_norm_rows_kernel[(triton.cdiv(k, block_k),)](",
     "_norm_rows_kernel[(max(1, k // block_k),)]("),
    ("overlap not refused", N, 'raise ValueError("out overlaps x', 'print("out overlaps x'),
    ("qkv_rope normalizes again", Q, "ROW1=row1, HAS_NORM=has_norm,", "ROW1=row1, HAS_NORM=True,"),
    ("qkv_rope's tl.dot loop keeps the norm", Q,
     "                xl = load_rows(x_ptr, stride_xm, offs_m, m_mask, kl, kl_mask, rstd, nw_ptr, HAS_NORM)",
     "                xl = load_rows(x_ptr, stride_xm, offs_m, m_mask, kl, kl_mask, rstd, nw_ptr, True)"),
]
STEPS = [  # MegaForward's choice (norm_rows.prenorm_step, build's table, the GEMM inputs): checked through its steps
    ("prenorm at one row", N, "return rows > 1 and (rows <= max_rows if on is None else on)",
     "return (rows <= max_rows if on is None else on)"),
    ("prenorm switch ignored", N, "(rows <= max_rows if on is None else on)", "(rows <= max_rows)"),
    ("the measured rule ignored", N, "(rows <= max_rows if on is None else on)", "(bool(on))"),
    ("the rule's bound off by one", N, "(rows <= max_rows if on is None else on)",
     "(rows < max_rows if on is None else on)"),
    ("MegaForward ignores its measured bound", F, "prenorm_step(t, self.prenorm_max_rows)", "prenorm_step(t, 8)"),
    ("unset reads as off", N, "env_switch(PRENORM_ENV, None,", "env_switch(PRENORM_ENV, False,"),
    ("the table's kind ignored", B, 'prenorm_rows("moe" if mc.is_moe else "dense", hid, dt, dev)',
     'prenorm_rows("dense", hid, dt, dev)'),
    ("the table never read", B, 'prenorm_max_rows=prenorm_rows("moe" if mc.is_moe else "dense", hid, dt, dev)',
     "prenorm_max_rows=0"),
    ("the GEMM keeps its norm weight", F, "return norm_rows(x, norm_weight, self.eps, h, use_pdl=use_pdl), None",
     "return norm_rows(x, norm_weight, self.eps, h, use_pdl=use_pdl), norm_weight"),
    ("gate_up reads the raw rows", F, "gu_in, gu_norm = self._gemm_input(x, lw.post_norm, h, use_pdl)",
     "gu_in, gu_norm = self._gemm_input(x, lw.post_norm, h, use_pdl)\n                gu_in = x"),
    ("gate_up normalized with the input norm", F, "self._gemm_input(x, lw.post_norm, h, use_pdl)",
     "self._gemm_input(x, lw.input_norm, h, use_pdl)"),
]
BENCH = [  # bench_kernels.py's Case.prenorm, its chains and tune_plans.py's: checked by test_plans.py
    ("bench ignores the rule", BK, "self.prenorm = prenorm_step(rows,", "self.prenorm = False and prenorm_step(rows,"),
    ("bench ignores the table", BK, "self.prenorm = prenorm_step(rows, prenorm_rows(",
     "self.prenorm = prenorm_step(rows, 0 * prenorm_rows("),
    ("bench's rule ignores the model kind", BK, 'prenorm_rows("moe" if s["experts"] else "dense", h, dtype, dev)',
     'prenorm_rows("dense", h, dtype, dev)'),
    ("bench's prologue keeps the weight", BK, "return None if self.prenorm else self.norm[i % 8]",
     "return self.norm[i % 8]"),
    ("bench's qkv chain keeps the norm", BK, "qkv_rope(self.x, self.prologue_norm(i), w,",
     "qkv_rope(self.x, self.norm[i % 8], w,"),
    ("bench's layer skips norm_rows", BK, "return norm_rows(x, self.norm[i % 8], EPS, self.h, use_pdl=pdl), None",
     "return x, None"),
    ("bench's layer keeps the norm weight", BK,
     "return norm_rows(x, self.norm[i % 8], EPS, self.h, use_pdl=pdl), None",
     "return norm_rows(x, self.norm[i % 8], EPS, self.h, use_pdl=pdl), self.norm[i % 8]"),
    ("bench's layer gate_up reads the raw rows", BK, "gemm(xn, self.wgu[i],", "gemm(x, self.wgu[i],"),
    ("tune_plans keeps the norm", TP, "self.norm = case.prologue_norm", "self.norm = lambda i: case.norm[i % 8]"),
]
M = KERNELS + STEPS + BENCH  # every anchor, for core/tests/test_mutation_anchors.py

if __name__ == "__main__":
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    failed = mutation_runner.run(KERNELS, "vendors/nvidia_mega/tests/test_kernels_norm.py", env)
    failed |= mutation_runner.run(STEPS, "vendors/nvidia_mega/tests/test_forward.py", env,
                                  pytest_args=("-k", "prenorm or one_row"))
    failed |= mutation_runner.run(BENCH, "vendors/nvidia_mega/tests/test_plans.py", env,
                                  pytest_args=("-k", "norm_prologue"))
    sys.exit(failed)
