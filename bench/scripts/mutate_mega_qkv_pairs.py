"""Mutation pass of qkv_rope's row-pair form (kernels/qkv_rope.py: the kernel's ``PAIRS`` branch, the launcher and
``check_row1_rows``), of late q/k (kernels/qk_late.py, the attention's ``LATE`` path, forward.py's choice), of
``tuned_plans.qkv_plan`` / ``default_qkv_row1`` and of the build's ``qk_norm``: break one place, run the CPU tests,
expect a failure.

    PYTHONPATH=core/src:vendors/nvidia_mega/src .venv/bin/python bench/scripts/mutate_mega_qkv_pairs.py  # from root

Runs test_kernels_dense.py's qkv tests (kernel and launcher), test_kernels_qk_late.py (late q/k's mutants, and
qkv_rope's among them, once more), test_plans.py's plan tests (the tables) and test_forward.py's one-row steps (the
build, the forward) per mutant. Prints CAUGHT (with the first failing test) or MISSED per
mutation; exits 1 if any was missed.
"""

import os
import pathlib
import sys

import mutation_runner  # same directory

Q = pathlib.Path("vendors/nvidia_mega/src/lowlat_nvidia_mega/kernels/qkv_rope.py")
L = pathlib.Path("vendors/nvidia_mega/src/lowlat_nvidia_mega/kernels/qk_late.py")
A = pathlib.Path("vendors/nvidia_mega/src/lowlat_nvidia_mega/kernels/attention.py")
F = pathlib.Path("vendors/nvidia_mega/src/lowlat_nvidia_mega/forward.py")
P = pathlib.Path("bench/scripts/plan_ab.py")
GP = pathlib.Path("vendors/nvidia_mega/src/lowlat_nvidia_mega/kernels/gemm_plans.py")
T = pathlib.Path("vendors/nvidia_mega/src/lowlat_nvidia_mega/kernels/tuned_plans.py")
B = pathlib.Path("vendors/nvidia_mega/src/lowlat_nvidia_mega/build.py")
M = [  # (name, file, original text, mutated text)
    ("every program takes the head's first pairs", Q, "offs_h = tl.program_id(1) * PAIRS + tl.arange(0, PAIRS)",
     "offs_h = tl.arange(0, PAIRS)"),
    ("a row-pair program reads one K split only", Q, "        pid_k = 0\n", "        pid_k = tl.program_id(1)\n"),
    ("the grid of a head per program for row pairs", Q,
     "plan.split_k if pairs == d // 2 else d // 2 // pairs)", "plan.split_k)"),
    ("the plan's rows ignored", Q, "pairs = check_row1_rows(r1, d, q_norm is not None, qk_late)", "pairs = d // 2"),
    ("row pairs with q/k norm allowed", L, "    if qk_norm and not qk_late:\n", "    if False:\n"),
    ("row pairs with split-K allowed", L, "    if row1.split_k != 1:\n", "    if False:\n"),
    ("one row per program allowed", L, "if not 2 <= bn < head_dim:", "if not 1 <= bn < head_dim:"),
    ("a row-pair entry reaches a q/k-norm model", T, "(r1.block_n < head_dim and qk_norm)", "False"),
    ("an entry wider than the head used", T, "if r1 is None or r1.block_n > head_dim or", "if r1 is None or"),
    ("the default ignores q/k norm", T, "    if qk_norm or head_dim <= 8:\n", "    if head_dim <= 8:\n"),
    ("no default", T, "    if qk_norm or head_dim <= 8:\n", "    if True:\n"),
    ("the H100 no longer a measured GPU", T, '    "NVIDIA H100 80GB HBM3": ((9, 0), 132),\n', ""),
    ("the build says no q/k norm", B, "qk_norm=mc.has_qk_norm", "qk_norm=False"),
]
LATE = [  # late q/k: qkv_rope stores q/k raw, the attention finishes them (kernels/qk_late.py)
    ("qkv_rope finishes q/k in the row-pair form", Q, "if QK_LATE:  # stored raw", "if False:  # stored raw"),
    ("qk_late for any plan", L, "if qk_late and not (qk_norm and 2 <= bn < head_dim):", "if False:"),
    ("qk_late at several rows", Q, "if qk_late and not row1:", "if False:"),
    ("late q/k without the norm", L, "r = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)",
     "r = 1.0 + 0.0 * tl.sum(x, axis=1)"),
    ("rotate_half without its sign", L, "sign = tl.where(offs_d < HALF, -1.0, 1.0)", "sign = offs_d * 0 + 1.0"),
    ("rotate_half unswapped", L, "swap = (offs_d + HALF) % D", "swap = offs_d"),
    ("the swapped column's norm weight", L, "ws = tl.load(nw_ptr + swap)", "ws = tl.load(nw_ptr + offs_d)"),
    ("cos unrounded", L, "c = rnd(tl.load(cos_ptr + p[:, None] * HALF + half[None, :]), DT)",
     "c = tl.load(cos_ptr + p[:, None] * HALF + half[None, :])"),
    ("late at several rows", L, "return qk_norm and rows == 1 and", "return qk_norm and rows >= 1 and"),
    ("the attention leaves q/k raw", A, "if LATE:  # q and k left raw", "if False:  # q and k left raw"),
    ("the finished K row not written back", A, "tl.store(k_row[:, None] + offs_d[None, :], k_new)", "pass"),
    ("the first block keeps the raw K row", A,
     "        k = tl.where(((pos == prefix) & in_rng)[:, None], k_new, k)\n    else:", "    else:"),
    ("later blocks keep the raw K row", A,
     "            k = tl.where(((pos == prefix) & in_rng)[:, None], k_new, k)\n        m_i",
     "            pass\n        m_i"),
    ("late at several rows per request", A, "        if r != 1:\n", "        if False:\n"),
    ("a late entry for any model", T, '"qkv_late", n, hidden, dtype, device) if qk_norm else None',
     '"qkv_late", n, hidden, dtype, device) if True else None'),
    ("the late entry never read", T, '_tuned(TUNED_ROW1, "qkv_late",', '_tuned(TUNED_ROW1, "qkv_late_",'),
    ("the forward never late", F, "late = late_qk(t,", "late = False and late_qk(t,"),
    # the validators a broken-input attack found gaps in (helper-8)
    ("late norm weights may be strided", L, "w.device != device or not w.is_contiguous():", "w.device != device:"),
    ("an empty late RoPE table", L, "if tab.dim() != 2 or tab.shape[0] < 1 or", "if tab.dim() != 2 or"),
    ("late positions may be strided", L, "or p.device != device or not p.is_contiguous():", "or p.device != device:"),
    ("a negative late eps", L, "not math.isfinite(self.eps) or self.eps < 0", "not math.isfinite(self.eps)"),
    ("a late field of any type", L, "if not isinstance(getattr(self, name), torch.Tensor):", "if False:"),
    ("qkv_rope's sin of any dtype", Q, "or tab.dtype != torch.float32 or not tab.is_contiguous() or",
     "or not tab.is_contiguous() or"),
    ("qkv_rope's positions may be strided", Q,
     "or idx.device != x.device \\\n                or not idx.is_contiguous():", "or idx.device != x.device:"),
    ("a malformed table entry passed on", T, "plan = GemvPlan(*value)  # which checks every field",
     "plan = GemvPlan(*(abs(int(v)) or 1 for v in value))  # which checks every field"),
    ("a qkv table entry with a weight stream passed on", T, 'if kind.startswith("qkv") and plan.per_sm:',
     "if False:"),
    ("a table entry of any field count", T, "if not 4 <= len(value) <= 6:", "if False:"),
    ("plan_ab applies one entry twice", P, "        if key in seen:\n", "        if False:\n"),
    ("plan_ab with the tables off", P, "    if not tables_on:", "    if False:"),
    ("plan_ab removes an entry it does not have", P, "if value is None and not any(", "if False and not any("),
    ("plan_ab reads dtype aliases", P, 'or str(named) != f"torch.{dtype}":', "or False:"),
    ("plan_ab sets the entry when asked to remove it", P, "            if value is not None:\n                table[",
     "            if True:\n                table["),
    ("plan_ab at TP", P, 'or tp != "1":', ":"),
    ("plan_ab with any kind", P, "if kind not in KINDS[table] or key[1] < 1", "if key[1] < 1"),
    ("GemvPlan of any warps", GP, 'or (name == "num_warps" and v > 32)', ""),
    ("GemvPlan of floats", GP, "if not isinstance(v, int) or isinstance(v, bool):", "if False:"),
]
M += LATE  # every anchor, for core/tests/test_mutation_anchors.py

if __name__ == "__main__":
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    pairs = [m for m in M if m not in LATE]
    dense = "vendors/nvidia_mega/tests/test_kernels_dense.py"
    failed = mutation_runner.run([m for m in pairs if m[1] in (Q, L)], dense, env, pytest_args=("-k", "qkv"))
    failed |= mutation_runner.run([m for m in LATE if m[1] in (Q, L, A)],
                                  "vendors/nvidia_mega/tests/test_kernels_qk_late.py", env)
    failed |= mutation_runner.run([m for m in LATE if m[1] == F], "vendors/nvidia_mega/tests/test_forward.py", env,
                                  pytest_args=("-k", "one_row"))
    failed |= mutation_runner.run([m for m in M if m[1] in (T, GP)], "vendors/nvidia_mega/tests/test_plans.py", env,
                                  pytest_args=("-k", "not smoke"))
    failed |= mutation_runner.run([m for m in pairs if m[1] == B], "vendors/nvidia_mega/tests/test_forward.py", env,
                                  pytest_args=("-k", "one_row"))
    failed |= mutation_runner.run([m for m in M if m[1] == P], "vendors/nvidia_mega/tests/test_plan_ab.py", env)
    sys.exit(failed)
