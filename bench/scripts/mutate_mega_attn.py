"""Mutation pass of nvidia_mega's attention launch plan (``AttnPlan``'s checks, ``split_cap``, ``attn_plan``'s table
lookup, the plan reaching both kernels, the workspace sizing): break the code in one place, run the attention and
plan tests, expect a failure.

    PYTHONPATH=core/src:vendors/nvidia_mega/src .venv/bin/python bench/scripts/mutate_mega_attn.py   # from the root

Each mutation is applied to the source, vendors/nvidia_mega/tests/test_kernels_attention.py and test_forward.py run
under TRITON_INTERPRET=1, and the source is restored. Prints CAUGHT (with the first failing test) or MISSED per
mutation; exits 1 if any was missed. Warps and stages do not change results on CPU (the interpreter ignores them):
test_compile_sm90.py compiles the plans for sm90.
"""

import os
import pathlib
import sys

import mutation_runner  # same directory

K = pathlib.Path("vendors/nvidia_mega/src/lowlat_nvidia_mega")
A, T, B = K / "kernels" / "attention.py", K / "kernels" / "tuned_plans.py", K / "build.py"
M = [  # (name, file, original text, mutated text)
    ("block_kv below 16 accepted", A, '("block_kv", 16, None)', '("block_kv", 1, None)'),
    ("splits above MAX_SPLITS accepted", A, '("num_splits", 1, MAX_SPLITS)', '("num_splits", 1, None)'),
    ("non-power-of-two fields accepted", A, "if v < lo or (hi is not None and v > hi) or v & (v - 1):",
     "if v < lo or (hi is not None and v > hi):"),
    ("stages 0 accepted", A, "if self.split_stages < 1:", "if self.split_stages < 0:"),
    ("booleans accepted as integers", A, "if not isinstance(v, int) or isinstance(v, bool):",
     "if not isinstance(v, int):"),
    ("split cap one block short", A,
     "return max(1, min(MAX_SPLITS, triton.next_power_of_2(triton.cdiv(max_context_len, block_kv))))",
     "return max(1, min(MAX_SPLITS, triton.next_power_of_2(triton.cdiv(max_context_len, block_kv)) // 2))"),
    ("merge kernel keeps BLOCK_KV 64", A,
     "HQ=hq, HKV=hkv, G=g, R=r, D=d, BLOCK_M=block_m, BLOCK_KV=block_kv, NUM_SPLITS=splits,",
     "HQ=hq, HKV=hkv, G=g, R=r, D=d, BLOCK_M=block_m, BLOCK_KV=64, NUM_SPLITS=splits,"),
    ("split kernel one split short", A, "_attn_split_kernel[(b * hkv, splits)](",
     "_attn_split_kernel[(b * hkv, max(1, splits - 1))]("),
    ("partials sized for one split", A,
     "n = batch_size * num_kv_heads * plan.num_splits * attention_block_m(num_heads, num_kv_heads, rows_per_req)",
     "n = batch_size * num_kv_heads * attention_block_m(num_heads, num_kv_heads, rows_per_req)"),
    ("a tuned entry's splits not capped", T, "return AttnPlan(num_splits=min(splits, split_cap(max_context_len, "
     "block_kv)), block_kv=block_kv,", "return AttnPlan(num_splits=splits, block_kv=block_kv,"),
    ("the table never read", T, 'hit = _lookup(TUNED_ATTN, ("attn", batch_size,',
     'hit = None and _lookup(TUNED_ATTN, ("attn", batch_size,'),
    ("the workspace sized for the first plan only", B,
     "n_o, n_l = max(n_o, o), max(n_l, lse)", "n_o, n_l = max(n_o, o), max(n_l, lse)\n        break"),
]

if __name__ == "__main__":
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    sys.exit(mutation_runner.run(M, "vendors/nvidia_mega/tests/test_kernels_attention.py", env,
                                 pytest_args=("vendors/nvidia_mega/tests/test_forward.py",)))
