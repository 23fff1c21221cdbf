"""Mutation pass of qkv_rope's row-pair form (kernels/qkv_rope.py: the kernel's ``PAIRS`` branch, the launcher and
``check_row1_rows``), of ``tuned_plans.qkv_plan`` / ``default_qkv_row1`` and of the build's ``qk_norm``: break one
place, run the CPU tests, expect a failure.

    PYTHONPATH=core/src:vendors/nvidia_mega/src .venv/bin/python bench/scripts/mutate_mega_qkv_pairs.py  # from root

Runs test_kernels_dense.py's qkv tests (kernel and launcher), test_plans.py's plan tests (the tables) and
test_forward.py's one-row steps (the build) per mutant. Prints CAUGHT (with the first failing test) or MISSED per
mutation; exits 1 if any was missed.
"""

import os
import pathlib
import sys

import mutation_runner  # same directory

Q = pathlib.Path("vendors/nvidia_mega/src/lowlat_nvidia_mega/kernels/qkv_rope.py")
T = pathlib.Path("vendors/nvidia_mega/src/lowlat_nvidia_mega/kernels/tuned_plans.py")
B = pathlib.Path("vendors/nvidia_mega/src/lowlat_nvidia_mega/build.py")
M = [  # (name, file, original text, mutated text)
    ("every program takes the head's first pairs", Q, "offs_h = tl.program_id(1) * PAIRS + tl.arange(0, PAIRS)",
     "offs_h = tl.arange(0, PAIRS)"),
    ("a row-pair program reads one K split only", Q, "        pid_k = 0\n", "        pid_k = tl.program_id(1)\n"),
    ("the grid of a head per program for row pairs", Q,
     "plan.split_k if pairs == d // 2 else d // 2 // pairs)", "plan.split_k)"),
    ("the plan's rows ignored", Q, "pairs = check_row1_rows(r1, d, q_norm is not None)", "pairs = d // 2"),
    ("row pairs with q/k norm allowed", Q, "    if qk_norm:\n        raise", "    if False:\n        raise"),
    ("row pairs with split-K allowed", Q, "    if row1.split_k != 1:\n", "    if False:\n"),
    ("one row per program allowed", Q, "if not 2 <= bn < head_dim:", "if not 1 <= bn < head_dim:"),
    ("a row-pair entry reaches a q/k-norm model", T, "(row1[0] < head_dim and qk_norm)", "False"),
    ("an entry wider than the head used", T, "if row1 is None or row1[0] > head_dim or", "if row1 is None or"),
    ("the default ignores q/k norm", T, "    if qk_norm or head_dim <= 8:\n", "    if head_dim <= 8:\n"),
    ("no default", T, "    if qk_norm or head_dim <= 8:\n", "    if True:\n"),
    ("the H100 no longer a measured GPU", T, '    "NVIDIA H100 80GB HBM3": ((9, 0), 132),\n', ""),
    ("the build says no q/k norm", B, "qk_norm=mc.has_qk_norm", "qk_norm=False"),
]

if __name__ == "__main__":
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    failed = mutation_runner.run([m for m in M if m[1] == Q], "vendors/nvidia_mega/tests/test_kernels_dense.py", env,
                                 pytest_args=("-k", "qkv"))
    failed |= mutation_runner.run([m for m in M if m[1] == T], "vendors/nvidia_mega/tests/test_plans.py", env,
                                  pytest_args=("-k", "not smoke"))
    failed |= mutation_runner.run([m for m in M if m[1] == B], "vendors/nvidia_mega/tests/test_forward.py", env,
                                  pytest_args=("-k", "one_row"))
    sys.exit(failed)
