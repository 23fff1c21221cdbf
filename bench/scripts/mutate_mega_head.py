"""Mutation pass of nvidia_mega's LM head config (``LMHeadConfig.min_rows``, ``LOWLAT_MEGA_LM_HEAD_CONFIG`` in
kernels/lm_head.py, its check at build and its use by the step in forward.py): break the code in one place, run the
LM head tests, expect a failure.

    PYTHONPATH=core/src:vendors/nvidia_mega/src .venv/bin/python bench/scripts/mutate_mega_head.py   # from the root

Each mutation is applied to the source, vendors/nvidia_mega/tests/test_kernels_lm_head.py and test_forward.py's
config tests run under TRITON_INTERPRET=1, and the source is restored. Prints CAUGHT (with the first failing test) or
MISSED per mutation; exits 1 if any was missed. Whether the padded rows take the MMA is not visible on CPU (the
interpreter multiplies in float32 either way); the GPU run of test_kernels_lm_head.py checks the results there.
"""

import os
import pathlib
import sys

import mutation_runner  # same directory

V = pathlib.Path("vendors/nvidia_mega/src/lowlat_nvidia_mega")
H, F, B = V / "kernels/lm_head.py", V / "forward.py", V / "build.py"
M = [  # (name, file, original text, mutated text)
    ("min_rows ignored by the launch", H, "ROWS_C=max(triton.next_power_of_2(t), cfg.min_rows)",
     "ROWS_C=triton.next_power_of_2(t)"),
    ("min_rows pads past T only when T is 1", H, "ROWS_C=max(triton.next_power_of_2(t), cfg.min_rows)",
     "ROWS_C=cfg.min_rows if t == 1 else triton.next_power_of_2(t)"),
    ("min_rows above 8 accepted", H, "if self.min_rows > ROWS:", "if False:"),
    ("min_rows default back to one row", H, "    min_rows: int = 8\n", "    min_rows: int = 1\n"),
    ("min_rows not a power of two accepted", H, 'for name in ("block_v", "block_k", "num_warps", "min_rows"):',
     'for name in ("block_v", "block_k", "num_warps"):'),
    ("warps above 32 accepted", H, "if self.num_warps > 32:", "if False:"),
    ("the env variable ignored", H, "return config_from_env(LMHeadConfig, CONFIG_ENV)", "return LMHeadConfig()"),
    ("the env not checked at build", B, "                   default_lm_head_config):", "                   ):"),
    ("the step's logits ignore the config", F, "pdl=use_pdl,\n                              config=self.head_config)",
     "pdl=use_pdl)"),
    ("the config never passed to the forward", B, "if tp > 1 else None, head_config=head_config)",
     "if tp > 1 else None)"),
    ("the sampler's tiles not the config's", B, "_head_workspace(mc, dev, alloc, head_config.block_v)",
     "_head_workspace(mc, dev, alloc, 128)"),
]

if __name__ == "__main__":
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    sys.exit(mutation_runner.run(M, "vendors/nvidia_mega/tests/test_kernels_lm_head.py", env,
                                 pytest_args=("vendors/nvidia_mega/tests/test_forward.py", "-k",
                                              "not test_forward.py or names_the_problem or lm_head_config")))
