"""Mutation pass of nvidia_mega's one-row GEMV (kernels/gemv.py: the kernel and the ``gemm`` dispatcher): break it in
one place, run its CPU tests, expect a failure.

    PYTHONPATH=core/src:vendors/nvidia_mega/src .venv/bin/python bench/scripts/mutate_mega_gemv.py   # from the root

Each mutation is applied to the source, the GEMV tests of vendors/nvidia_mega/tests/test_kernels_gemv.py and
test_kernels_dense.py (``-k "gemv or gemm_runs or qkv_rope_one_row or refuses_a_row_pair"``, the last two for
qkv_rope's one-row loop) run under TRITON_INTERPRET=1,
and the source is restored. Prints CAUGHT (with the first failing test) or MISSED per mutation; exits 1 if any was
missed. The PDL order (weights before ``gdc_wait``) and the
16-byte weight loads are not visible on CPU: test_compile_sm90.py checks them in the compiled PTX.
"""

import os
import pathlib
import sys

import mutation_runner  # same directory

G = pathlib.Path("vendors/nvidia_mega/src/lowlat_nvidia_mega/kernels/gemv.py")
Q = pathlib.Path("vendors/nvidia_mega/src/lowlat_nvidia_mega/kernels/qkv_rope.py")
S = pathlib.Path("vendors/nvidia_mega/src/lowlat_nvidia_mega/kernels/small_gemm.py")
GP = pathlib.Path("vendors/nvidia_mega/src/lowlat_nvidia_mega/kernels/gemm_plans.py")
QL = pathlib.Path("vendors/nvidia_mega/src/lowlat_nvidia_mega/kernels/qk_late.py")
MO = pathlib.Path("vendors/nvidia_mega/src/lowlat_nvidia_mega/kernels/mem_overlap.py")
M = [  # (name, file, original text, mutated text)
    # prologue: HF's RMSNorm, rounded where torch rounds
    ("RMSNorm: x * rstd not rounded to the activation dtype", G,
     "h = rnd(x.to(tl.float32) * rstd, x.dtype)", "h = x.to(tl.float32) * rstd"),
    ("RMSNorm: normalized x not rounded before the dot", G,
     "x = to_act(nw.to(tl.float32) * h, x.dtype)", "x = nw.to(tl.float32) * h"),
    ("RMSNorm: norm weight not applied", G,
     "x = to_act(nw.to(tl.float32) * h, x.dtype)", "x = to_act(h, x.dtype)"),
    ("RMSNorm: mean over the block, not K", G, "tl.sum(ss, 0) / K + eps", "tl.sum(ss, 0) / BLOCK + eps"),
    ("RMSNorm: row statistics read past K", G,
     "x = tl.load(x_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)", "x = tl.load(x_ptr + ks).to(tl.float32)"),
    ("x chunk read past K", G, "x = tl.load(x_ptr + ks, mask=k_mask, other=0.0)", "x = tl.load(x_ptr + ks)"),
    # weight loads and the K loop
    ("K mask dropped when not EVEN_K (small_gemm.load_tile, the GEMV's weight load)", S,
     "return tl.load(ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)",
     "return tl.load(ptrs, mask=row_mask[:, None], other=0.0)"),
    ("first chunk's K mask ignores K", G, "k_mask = ks < K", "k_mask = ks < BLOCK_K"),
    ("up rows of the first chunk at BLOCK_N, not N", G,
     "w0u = load_tile(w_rows + N * stride_wn +", "w0u = load_tile(w_rows + BLOCK_N * stride_wn +"),
    ("up rows of the loop one row early", G,
     "wu = load_tile(w_rows + N * stride_wn +", "wu = load_tile(w_rows + (N - 1) * stride_wn +"),
    ("up sum of the first chunk from the gate rows", G,
     "acc_u = tl.sum(w0u.to(tl.float32) * xk, 1)", "acc_u = tl.sum(w0.to(tl.float32) * xk, 1)"),
    ("loop from 0: first chunk counted twice", G,
     "for k0 in range(BLOCK_K, K, BLOCK_K):", "for k0 in range(0, K, BLOCK_K):"),
    ("loop step of two chunks", G,
     "for k0 in range(BLOCK_K, K, BLOCK_K):", "for k0 in range(BLOCK_K, K, 2 * BLOCK_K):"),
    ("loop stops a chunk early", G,
     "for k0 in range(BLOCK_K, K, BLOCK_K):", "for k0 in range(BLOCK_K, K - BLOCK_K, BLOCK_K):"),
    ("loop reuses the first chunk of x", G,
     "xl = one_row_x(x_ptr, kl, kl_mask,", "xl = one_row_x(x_ptr, ks, k_mask,"),
    # output rows and the epilogue
    ("programs' rows overlap", G,
     "offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)", "offs_n = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N)"),
    ("column mask dropped on the store", G, "o_mask = n_mask[None, :]", "o_mask = (offs_n >= 0)[None, :]"),
    ("gate and up swapped in the epilogue", G,
     "    else:\n        _gemm_epilogue(acc[None, :], acc_u[None, :],",
     "    else:\n        _gemm_epilogue(acc_u[None, :], acc[None, :],"),
    # launcher
    ("launcher: residual pointer is out when a residual is given", G,
     "residual if residual is not None else out, out, n, k, eps)", "out, out, n, k, eps)"),
    ("launcher: eps not passed", G, "out, n, k, eps)", "out, n, k, 0.0)"),
    ("launcher: grid floored", G,
     "n_tiles = triton.cdiv(n, row1.block_n)", "n_tiles = n // row1.block_n"),
    ("launcher: EVEN_K from BLOCK_N", G, "EVEN_K=k % row1.block_k == 0", "EVEN_K=k % row1.block_n == 0"),
    ("launcher: norm over one chunk", G,
     "NORM_K=k if norm_weight is not None else 0", "NORM_K=row1.block_k if norm_weight is not None else 0"),
    ("launcher: norm weight ignored", G, "HAS_NORM=norm_weight is not None", "HAS_NORM=False"),
    ("launcher: epilogue ignored", G, "EPILOGUE=EPILOGUES[epilogue]", "EPILOGUE=0"),
    # dispatcher
    ("dispatcher: GEMV for 2 rows", G, "x.shape[0] != 1 or row1 is None", "x.shape[0] > 2 or row1 is None"),
    ("dispatcher: GEMV without a row1 plan", G, "x.shape[0] != 1 or row1 is None", "x.shape[0] != 1"),
    ("dispatcher: a row1 plan that splits K accepted", G, "    if row1.split_k != 1:\n", "    if False:\n"),
    ("dispatcher: arguments not checked", G,
     "_, k, n, _ = check_gemm_args(x, w, out, plan=plan, epilogue=epilogue, norm_weight=norm_weight,\n"
     "                                 residual=residual, workspace=workspace, counters=counters, split_k=False)",
     "k, n = x.shape[1], out.shape[1]"),
    ("dispatcher: the GEMV asks for a split-K workspace", G, "counters=counters, split_k=False)",
     "counters=counters, split_k=True)"),
    # the weight stream (_gemv_stream_kernel, GemvPlan.per_sm)
    ("stream: the ring requests the same chunk again", G,
     "_stream_load(w_ptr, stride_wn, tile, c + 1,", "_stream_load(w_ptr, stride_wn, tile, c,"),
    ("stream: the ring's next tile is the neighbour, not the grid stride", G,
     "_stream_load(w_ptr, stride_wn, tile + grid, 0,", "_stream_load(w_ptr, stride_wn, tile + 1, 0,"),
    ("stream: tiles walked one apart", G, "tile = pid + t * grid", "tile = pid + t"),
    ("stream: tiles per program floored", G,
     "my_tiles = tl.cdiv(tl.cdiv(N, BLOCK_N) - pid, grid)", "my_tiles = tl.cdiv(N, BLOCK_N) // grid"),
    ("stream: later chunks reuse chunk 0's x", G, "            if c > 0:\n", "            if False:\n"),
    ("stream: later chunks not normalized", G,
     "xk = one_row_x(x_ptr, kl, kl < K, rstd, nw_ptr, HAS_NORM)",
     "xk = one_row_x(x_ptr, kl, kl < K, rstd, nw_ptr, False)"),
    ("stream: x once without its K mask", G, "x_once = one_row_x(x_ptr, ks, ks < K,",
     "x_once = one_row_x(x_ptr, ks, ks < BLOCK_K,"),
    ("stream: up rows at BLOCK_N, not N", G,
     "wu = load_tile(rows + N * stride_wn,", "wu = load_tile(rows + BLOCK_N * stride_wn,"),
    ("stream: only a tile's last chunk summed", G,
     "            acc += tl.sum(w.to(tl.float32) * xk, 1)", "            acc = tl.sum(w.to(tl.float32) * xk, 1)"),
    ("stream: up from the gate rows", G,
     "                acc_u += tl.sum(wu.to(tl.float32) * xk, 1)",
     "                acc_u += tl.sum(w.to(tl.float32) * xk, 1)"),
    ("stream: column mask dropped on the store", G,
     "o_mask = (offs_n < N)[None, :]", "o_mask = (offs_n >= 0)[None, :]"),
    ("stream: gate and up swapped in the epilogue", G,
     "        else:\n            _gemm_epilogue(acc[None, :], acc_u[None, :],",
     "        else:\n            _gemm_epilogue(acc_u[None, :], acc[None, :],"),
    ("stream launcher: a partial last chunk dropped", G,
     "CHUNKS=triton.cdiv(k, row1.block_k)", "CHUNKS=k // row1.block_k"),
    ("stream launcher: never chosen", G, "    if row1.per_sm:\n", "    if False:\n"),
    ("stream grid: more programs than tiles", G,
     "return min(plan.per_sm * num_sms(device), triton.cdiv(n, plan.block_n))",
     "return plan.per_sm * num_sms(device)"),
    # qkv_rope's one-row K loop (same helpers; its tests are test_qkv_rope_one_row_loop_*)
    ("qkv row1: loop accumulator overwritten", Q,
     "        lo += tl.sum(wl.to(tl.float32) * xl, 1)", "        lo = tl.sum(wl.to(tl.float32) * xl, 1)"),
    ("qkv row1: first chunk not normalized", Q,
     "xk = one_row_x(x_ptr, ks, ks < k_end, rstd, nw_ptr, HAS_NORM)",
     "xk = one_row_x(x_ptr, ks, ks < k_end, rstd, nw_ptr, False)"),
    ("qkv row1: hi half from the lo rows", Q,
     "        hi += tl.sum(wh.to(tl.float32) * xl, 1)", "        hi += tl.sum(wl.to(tl.float32) * xl, 1)"),
    ("qkv row1: each split's loop starts at column PRE_K, not its own start", Q,
     "    for k0 in range(k_start + PRE_K, k_end, BLOCK_K):\n        kl = k0 + tl.arange(0, BLOCK_K)\n"
     "        kl_mask = kl < k_end\n        wl = load_tile(w_lo",
     "    for k0 in range(PRE_K, k_end, BLOCK_K):\n        kl = k0 + tl.arange(0, BLOCK_K)\n"
     "        kl_mask = kl < k_end\n        wl = load_tile(w_lo"),
    ("qkv launcher: one-row loop at 2+ rows", Q,
     "row1 = plan.row1 is not None and t == 1", "row1 = plan.row1 is not None and t <= 3"),
    ("qkv launcher: row1's split ignored", Q,
     "split_k=r1.split_k, num_warps=r1.num_warps", "split_k=1, num_warps=r1.num_warps"),
    ("qkv workspace: row1's split not counted", Q,
     "row1 = plan.row1.split_k * ncol if plan.row1 is not None and plan.row1.split_k > 1 else 0", "row1 = 0"),
]

ARGS = [  # the shared argument checks (small_gemm.check_gemm_args) with test_kernels_gemv.py; mem_overlap's with
    # test_mem_overlap.py
    ("args: an empty reduction launched", S, "    if k < 1 or n < 1:\n", "    if False:\n"),
    ("args: integer tensors launched", S, "    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):\n",
     "    if False:\n"),
    ("args: out aliasing x accepted", S, "    if overlaps(out, x) or overlaps(out, w):", "    if overlaps(out, w):"),
    ("args: a norm weight on another device accepted", S,
     "or not norm_weight.is_contiguous() or norm_weight.device != x.device):",
     "or not norm_weight.is_contiguous()):"),
    ("args: a residual on another device accepted", S, "        or residual.device != x.device:", "        or False:"),
    ("args: adjacent rows counted as overlapping", MO, "j_lo = max(0, -(-(lo - lb + 1 - pb) // sb))",
     "j_lo = max(0, -(-(lo - lb - pb) // sb))"),
    ("args: a row's last byte left out", MO, "j_hi = min(mb - 1, (hi - 1 - pb) // sb)",
     "j_hi = min(mb - 1, (hi - 2 - pb) // sb)"),
    ("args: row-strided views never overlap", MO, "        if j_lo <= j_hi:\n            return True",
     "        if j_lo < j_hi:\n            return True"),
    ("args: interleaved views refused (span only)", MO, "    ra, rb = _row_intervals(a), _row_intervals(b)",
     "    ra, rb = None, None"),
    ("args: a span ends before its last element", MO, "t.data_ptr() + (last + 1) * size", "t.data_ptr() + last * size"),
]
M += ARGS

PLANS = [  # the plan checks of the stream (test_plans.py) and its TP publish (test_mega_kernels_tp.py)
    ("GemvPlan: a negative per_sm accepted", GP, "if self.per_sm < 0 or (self.per_sm and self.split_k > 1):",
     "if self.per_sm and self.split_k > 1:"),
    ("GemvPlan: per_sm with split-K accepted", GP, "if self.per_sm < 0 or (self.per_sm and self.split_k > 1):",
     "if self.per_sm < 0:"),
    ("qkv_rope: a weight-stream plan accepted", QL, "    if row1.per_sm:\n        raise",
     "    if False:\n        raise"),
    ("stream: publishes its program id, not its tile", G,
     "flag_ptrs, tag_ptr, rank, cap, cap_tiles, tile, publish, WORLD)",
     "flag_ptrs, tag_ptr, rank, cap, cap_tiles, pid, publish, WORLD)"),
]
M += PLANS  # every anchor, for core/tests/test_mutation_anchors.py

if __name__ == "__main__":
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    failed = mutation_runner.run([m for m in M if m not in PLANS and m not in ARGS],
                                 "vendors/nvidia_mega/tests/test_kernels_dense.py",
                                 env, pytest_args=("-k",
                                                   "gemv or gemm_runs or qkv_rope_one_row or refuses_a_row_pair",
                                                   "vendors/nvidia_mega/tests/test_kernels_gemv.py"))
    failed |= mutation_runner.run([a for a in ARGS if a[1] != MO], "vendors/nvidia_mega/tests/test_kernels_gemv.py",
                                  env, pytest_args=("-k", "refused_by_name"))
    failed |= mutation_runner.run([a for a in ARGS if a[1] == MO], "vendors/nvidia_mega/tests/test_mem_overlap.py", env)
    failed |= mutation_runner.run(PLANS[:3], "vendors/nvidia_mega/tests/test_plans.py", env,
                                  pytest_args=("-k", "not smoke"))
    failed |= mutation_runner.run(PLANS[3:], "vendors/nvidia_mega/tests/test_mega_kernels_tp.py", env,
                                  pytest_args=("-k", "publish or roundings"))
    sys.exit(failed)
