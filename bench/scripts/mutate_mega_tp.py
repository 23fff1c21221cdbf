"""Mutation pass of nvidia_mega's tensor parallelism and core's plugin API 4 (peer buffers for plugins): break it in
one place, run the tests that must notice, expect a failure.

    python3 bench/scripts/mutate_mega_tp.py      # from the repository root (or a worktree's)

Groups: the kernels (epilogue publishing, ``reduce_rows``) against vendors/nvidia_mega/tests/test_mega_kernels_tp.py
(simulated ranks in one process); the forward, the build, the fault switch and core's binding / host / dispatcher
against vendors/nvidia_mega/tests/test_mega_tp.py (``lowlat run --tp 2`` on CPU, a spawned gloo worker); all under
TRITON_INTERPRET=1 with this checkout's sources first on the path. Left out as equivalent on the tiny presets:
o_proj's tiles reduced at down's width (at TP 2 their o_proj and down plans have the same 32-column tiles); the MoE's
down publishing under another tile index (hidden 64 is one 64-column tile).
Prints CAUGHT (with the first failing test) or MISSED per mutation; exits 1 if any was missed.
"""

import os
import pathlib
import sys

import mutation_runner  # same directory

V = pathlib.Path("vendors/nvidia_mega/src/lowlat_nvidia_mega")
E, R, F, TP = V / "kernels/tp_epilogue.py", V / "kernels/tp_reduce.py", V / "forward.py", V / "tp.py"
G = V / "kernels/gemv.py"
C = pathlib.Path("core/src/lowlat")
M_KERNELS = [  # (name, file, original text, mutated text)
    ("publish: the unrounded fp32 tile", E, "publish_tile(to_act(acc, dt),", "publish_tile(acc.to(dt),"),
    ("publish: rows at the wrong stride", E, "offs_m[:, None] * N + offs_n[None, :]",
     "offs_m[:, None] * (N + 1) + offs_n[None, :]"),
    ("publish: the tag of the previous call", E, "tag = device_tag(tag_ptr, 0)", "tag = device_tag(tag_ptr, 0) - 1"),
    ("reduce: the partial sum not rounded before the residual", R, "y = rnd(rnd(acc, dt) + r.to(tl.float32), dt)",
     "y = rnd(acc + r.to(tl.float32), dt)"),
    ("reduce: residual dropped", R, "y = rnd(rnd(acc, dt) + r.to(tl.float32), dt)", "y = rnd(rnd(acc, dt), dt)"),
    ("reduce: ranks summed in reverse order", R, "(parity * WORLD + s).to(tl.int64)",
     "(parity * WORLD + (WORLD - 1 - s)).to(tl.int64)"),
    ("reduce: a rank left out", R, "for s in tl.static_range(WORLD):", "for s in tl.static_range(WORLD - 1):"),
    ("reduce: a failed wait not marked", R, 'y = tl.where(ready, y, float("nan"))', "y = y"),
    ("reduce: the last chunk's tiles never awaited", R, "tl.cdiv(N, TILE_N) - t0,", "1,"),
    ("reduce: norm over the stale rows", R, "xv = tl.load(x_ptr + row * stride_x + offs",
     "xv = tl.load(h_ptr + row * stride_h + offs"),
    ("reduce: mean over the chunk, not the row", R, "rstd = 1.0 / tl.sqrt(tl.sum(ss, 0) / N + eps)",
     "rstd = 1.0 / tl.sqrt(tl.sum(ss, 0) / CHUNK + eps)"),
    ("reduce: the tag never advances", R, "finish_call(tag_ptr, tag, tl.num_programs(0))",
     "finish_call(tag_ptr, tag - 1, tl.num_programs(0))"),
    ("gemv: the GEMV's tiles announced at small_gemm's width", G,
     "return plan.row1.block_n if rows == 1 and plan.row1 is not None else plan.block_n", "return plan.block_n"),
    ("fault injection ignored", E, "publish=int(peer.publish)", "publish=1"),
    ("logits: the padding columns kept", TP, "full if full.shape[1] == self.vocab_size else", "full if True else"),
]
M_TP = [
    ("forward: the next layer's norm skipped", F, "nxt = self.layers[i + 1].input_norm if i + 1 < n_layers else None",
     "nxt = None"),
    ("forward: o_proj's site is down's", F, "site=2 * i,", "site=2 * i + 1,"),
    ("forward: the MoE's tiles reduced at half their width", F, "tile_n=self.moe_config.down_block_n if lw.is_moe else",
     "tile_n=self.moe_config.down_block_n // 2 if lw.is_moe else"),
    ("moe: the partial stored, not published", V / "kernels/moe.py", "PUBLISH=self.peer is not None",
     "PUBLISH=False"),
    ("nccl variant never taken", F, 'tp_reduce_mode() == "nccl"', 'tp_reduce_mode() == "NCCL"'),
    ("nccl variant: the partials not summed", TP, "dist.all_reduce(part, group=self.tp.group)", "part.mul_(1)"),
    ("nccl variant: the residual not added", TP, "        x.add_(part)\n", "        x.copy_(part)\n"),
    ("nccl variant: a bad value passes the build", V / "build.py",
     "prenorm_switch, tuned_switch, tp_reduce_mode, default_config,\n",
     "prenorm_switch, tuned_switch, default_config,\n"),
    ("embed: every rank keeps every id", TP, "x.mul_(mine.unsqueeze(1).to(x.dtype))", "pass"),
    ("embed: the vocabulary range off by one", TP, "vocab_start=binding.tp_rank * v_l,",
     "vocab_start=binding.tp_rank * v_l + 1,"),
    ("fault switch: the wrong rank silent", TP, "publish=silent != str(binding.tp_rank)",
     "publish=silent == str(binding.tp_rank)"),
    ("core: the dispatcher reports non-finite logits first", C / "runtime/plugin_host/host.py",
     "            self.dispatcher.explain_nonfinite = self.check_peers\n", "            pass\n"),
    ("core: the host never checks the plugin's buffers", C / "runtime/plugin_host/host.py",
     "            if not bufs.closed:\n                bufs.check()", "            pass"),
    ("core: the binding's deadline unbounded", C / "runtime/peer_reduce.py",
     "    return TIMER_POLLS, max(1, int(seconds * CPU_POLLS_PER_S))",
     "    return TIMER_POLLS, max(1, int(seconds * CPU_POLLS_PER_S * 1000))"),
    ("core: ids asked of a plugin at TP", C / "runtime/dispatch.py",
     "self.coverage.sampling is not None and self.tp_size == 1", "self.coverage.sampling is not None"),
]
GROUPS = [(M_KERNELS, "vendors/nvidia_mega/tests/test_mega_kernels_tp.py"),
          (M_TP, "vendors/nvidia_mega/tests/test_mega_tp.py")]

if __name__ == "__main__":
    src = ["core/src", "vendors/nvidia_mega/src", "contract_tests/src"]  # this checkout's, before the installed ones
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([*src, os.environ.get("PYTHONPATH", "")])}
    failed = 0
    for muts, tests in GROUPS:
        failed |= mutation_runner.run(muts, tests, env, timeout_s=400)
    sys.exit(failed)
