"""Mutation pass of nvidia_mega's LM head one-row loop (kernels/lm_head.py: ``_row1_logits``, the ``ROW1`` choice and
``LMHeadConfig``'s one-row fields): break it in one place, run its CPU tests, expect a failure.

    PYTHONPATH=core/src:vendors/nvidia_mega/src .venv/bin/python bench/scripts/mutate_mega_lm_head.py   # from the root

Each mutation is applied to the source, vendors/nvidia_mega/tests/test_kernels_lm_head.py runs under
TRITON_INTERPRET=1, and the source is restored. Prints CAUGHT (with the first failing test) or MISSED per mutation;
exits 1 if any was missed. The 16-byte weight loads and the absence of MMA are not visible on CPU:
test_compile_sm90_lm_head.py checks them in the compiled PTX.
"""

import os
import pathlib
import sys

import mutation_runner  # same directory

L = pathlib.Path("vendors/nvidia_mega/src/lowlat_nvidia_mega/kernels/lm_head.py")
M = [  # (name, file, original text, mutated text)
    ("x * rstd not rounded to the model dtype", L,
     "h = to_act(nw * to_act(x * rstd, dtype).to(tl.float32), dtype).to(tl.float32)",
     "h = to_act(nw * (x * rstd), dtype).to(tl.float32)"),
    ("normalized row not rounded before the products", L,
     "h = to_act(nw * to_act(x * rstd, dtype).to(tl.float32), dtype).to(tl.float32)",
     "h = nw * to_act(x * rstd, dtype).to(tl.float32)"),
    ("norm weight not applied", L,
     "h = to_act(nw * to_act(x * rstd, dtype).to(tl.float32), dtype).to(tl.float32)",
     "h = to_act(x * rstd, dtype).to(tl.float32)"),
    ("x chunk read past H", L, "x = tl.load(x_ptr + offs_k, mask=kmask, other=0.0).to(tl.float32)",
     "x = tl.load(x_ptr + offs_k, mask=offs_k < H + 8, other=1.0).to(tl.float32)"),
    ("norm weight read past H", L, "nw = tl.load(norm_w_ptr + offs_k, mask=kmask, other=0.0).to(tl.float32)\n"
     "        h = to_act", "nw = tl.load(norm_w_ptr + offs_k, mask=offs_k < H + 8, other=1.0).to(tl.float32)\n"
     "        h = to_act"),
    ("K loop skips the first chunk", L,
     "    acc = tl.zeros([BLOCK_V], dtype=tl.float32)\n    for k0 in range(0, H, BLOCK_K):",
     "    acc = tl.zeros([BLOCK_V], dtype=tl.float32)\n    for k0 in range(BLOCK_K, H, BLOCK_K):"),
    ("K loop stops a chunk early", L,
     "    acc = tl.zeros([BLOCK_V], dtype=tl.float32)\n    for k0 in range(0, H, BLOCK_K):",
     "    acc = tl.zeros([BLOCK_V], dtype=tl.float32)\n    for k0 in range(0, H - BLOCK_K, BLOCK_K):"),
    ("EVEN_K whatever H", L, "ROW1=row1, EVEN_K=hidden % block_k == 0,", "ROW1=row1, EVEN_K=True,"),
    ("sum over the wrong axis", L, "acc += tl.sum(w.to(tl.float32) * h[None, :], axis=1)",
     "acc += tl.sum(w.to(tl.float32) * h[None, :], axis=1) * 0 + tl.sum(tl.sum(w.to(tl.float32) * h[None, :], "
     "axis=0), axis=0) / BLOCK_V"),
    ("the rms of another row", L, "tl.sum(rstd, axis=0), H, dtype, BLOCK_V, BLOCK_K,",
     "tl.max(rstd, axis=0) * 1.01, H, dtype, BLOCK_V, BLOCK_K,"),
    ("ROW1 at more rows", L, "row1 = cfg.row1 and t == 1", "row1 = cfg.row1 and t <= 2"),
    ("row1 option ignored", L, "row1 = cfg.row1 and t == 1", "row1 = t == 1"),
    ("one-row K chunk ignored", L, "(cfg.row1_block_k, cfg.row1_num_warps, cfg.row1_num_stages) if row1",
     "(cfg.block_k, cfg.row1_num_warps, cfg.row1_num_stages) if row1"),
    ("one-row warps ignored", L, "(cfg.row1_block_k, cfg.row1_num_warps, cfg.row1_num_stages) if row1",
     "(cfg.row1_block_k, cfg.num_warps, cfg.row1_num_stages) if row1"),
    ("one-row stages unchecked", L, '        for name in ("num_stages", "row1_num_stages"):',
     '        for name in ("num_stages",):'),
    ("one-row K chunk not a power of two accepted", L,
     '        for name in ("block_v", "block_k", "num_warps", "row1_block_k", "row1_num_warps"):',
     '        for name in ("block_v", "block_k", "num_warps", "row1_num_warps"):'),
]

if __name__ == "__main__":
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    sys.exit(mutation_runner.run(M, "vendors/nvidia_mega/tests/test_kernels_lm_head.py", env))
