"""Mutation pass of nvidia_mega's one-row MoE down without the split over slots (``MoEKernelConfig.row1_down_loop``:
``moe_row1._moe_down_row1_kernel`` and its launch in moe.py): break the code in one place, run the MoE down-loop
tests, expect a failure.

    PYTHONPATH=core/src:vendors/nvidia_mega/src .venv/bin/python bench/scripts/mutate_mega_down_loop.py  # from root

Each mutation is applied to the source, vendors/nvidia_mega/tests/test_kernels_moe_down_loop.py runs under
TRITON_INTERPRET=1, and the source is restored. Prints CAUGHT (with the first failing test) or MISSED per mutation;
exits 1 if any was missed.
"""

import os
import pathlib
import sys

import mutation_runner  # same directory

V = pathlib.Path("vendors/nvidia_mega/src/lowlat_nvidia_mega")
R, M_ = V / "kernels/moe_row1.py", V / "kernels/moe.py"
M = [  # (name, file, original text, mutated text)
    ("an expert closed one chunk late", R, "done = jn % NCH == 0", "done = jn % NCH == 1"),
    ("the closing weight of the next expert", R, "wt = tl.load(slot_weight_ptr + s * ROWS_C)",
     "wt = tl.load(slot_weight_ptr + sn * ROWS_C)"),
    ("an expert's product not rounded", R, "acc += tl.where(done, rnd(d, dtype) * wt, 0.0)",
     "acc += tl.where(done, d * wt, 0.0)"),
    ("the partial sum not reset", R, "d = tl.where(done, 0.0, d)", "d = d"),
    ("the last expert never closed", R, "    for j in range(0, TOP_K * NCH):",
     "    for j in range(0, TOP_K * NCH - 1):"),
    ("the residual dropped", R, "acc += tl.load(residual_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)",
     "acc += 0.0"),
    ("the first expert from slot 0, not row 0's first choice", R,
     "e = tl.load(slot_expert_ptr + s, cache_modifier=\".cg\")",
     "e = tl.load(slot_expert_ptr, cache_modifier=\".cg\")"),
    ("the activations of the next chunk's slot", R, "a = tl.load(act_ptr + s * ROWS_C * INTER + i0 + offs_i",
     "a = tl.load(act_ptr + sn * ROWS_C * INTER + i0 + offs_i"),
    ("the prefetch of the current chunk, not the next", R, "i0n = (jn % NCH) * BLOCK_I", "i0n = (j % NCH) * BLOCK_I"),
    ("the tile carried over not swapped", R, "        w = w_next\n", "        w = w\n"),
    ("the slot carried over not swapped", R, "        s = sn\n", "        s = s\n"),
    ("the I mask dropped on a padded chunk", R, "EVEN_I: tl.constexpr = INTER % BLOCK_I == 0",
     "EVEN_I: tl.constexpr = True"),
    ("the chunk offset dropped", R, "i0 = (j % NCH) * BLOCK_I", "i0 = 0 * BLOCK_I"),
    ("the loop kernel beyond one row", M_, "if self.row1 and cfg.row1_down_loop and self.peer is None:",
     "if cfg.row1_down_loop and self.peer is None:"),
    ("the loop kernel ignoring the switch", M_, "if self.row1 and cfg.row1_down_loop and self.peer is None:",
     "if self.row1 and self.peer is None:"),
    ("the launch's I chunk not the config's", M_, "BLOCK_I=k_chunk(cfg.row1_down_block_i, ws.inter)",
     "BLOCK_I=k_chunk(cfg.down_block_i, ws.inter)"),
    ("the launch's top-k fixed", M_, "INTER=ws.inter, TOP_K=self.top_k,", "INTER=ws.inter, TOP_K=2,"),
    ("on by default", M_, "row1_down_loop: bool = False", "row1_down_loop: bool = True"),
]

if __name__ == "__main__":
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    sys.exit(mutation_runner.run(M, "vendors/nvidia_mega/tests/test_kernels_moe_down_loop.py", env))
