"""Mutation pass of amd_mono's tensor parallelism (K2's publish and reduce stages, the TP forward, build, specs and the
fault switch): break it in one place, run the tests that must notice, expect a failure.

    python3 bench/scripts/mutate_amd_tp.py      # from the repository root (or a worktree's)

Groups: the kernels (``kernels/k2_tp.py``, the gate/up stage's awaited stage, the masked embedding) against
vendors/amd_mono/tests/test_mono_kernels_tp.py (simulated ranks in one process, stage per launch, and one persistent
launch with a forged peer); the forward, the build, the specs and the fault switch against
vendors/amd_mono/tests/test_mono_tp.py (``lowlat run --tp 2`` on CPU, a spawned gloo worker); all under
TRITON_INTERPRET=1 with this checkout's sources first on the path. None is left out as equivalent.
Prints CAUGHT (with the first failing test) or MISSED per mutation; exits 1 if any was missed.
"""

import os
import pathlib
import sys

import mutation_runner  # same directory

V = pathlib.Path("vendors/amd_mono/src/lowlat_amd_mono")
K, F, TP = V / "kernels/k2_tp.py", V / "forward.py", V / "tp.py"
EH, SP = V / "kernels/embed_head.py", V / "specs.py"
M_KERNELS = [  # (name, file, original text, mutated text)
    ("publish: the tile cast, not rounded to nearest even", K, "publish_tile(rnd(acc, DT, INTERP).to(DT),",
     "publish_tile(acc.to(DT),"),
    ("publish: rows at the wrong stride", K, ".to(DT), r[:, None] * H + n[None, :], m",
     ".to(DT), r[:, None] * (H + 1) + n[None, :], m"),
    ("publish: the wrong flag tile", K, "cap, cap_tiles, i, publish_on, WORLD)",
     "cap, cap_tiles, 0, publish_on, WORLD)"),
    ("reduce: the rank sum not rounded before the residual", K, "y = rnd(res + rnd(acc, DT, INTERP), DT, INTERP)",
     "y = rnd(res + acc, DT, INTERP)"),
    ("reduce: residual dropped", K, "y = rnd(res + rnd(acc, DT, INTERP), DT, INTERP)",
     "y = rnd(rnd(acc, DT, INTERP), DT, INTERP)"),
    ("reduce: ranks summed in reverse order", K, "(parity * WORLD + s).to(tl.int64)",
     "(parity * WORLD + (WORLD - 1 - s)).to(tl.int64)"),
    ("reduce: a rank left out", K, "for s in tl.static_range(WORLD):", "for s in tl.static_range(WORLD - 1):"),
    ("reduce: a failed wait not marked", K, 'y = tl.where(ready, y, float("nan"))', "y = y"),
    ("reduce: the wrong parity", K, "    parity = ptag & 1\n", "    parity = 0\n"),
    ("reduce: the tile's wait skipped", K, "        if alive != 0:\n            ready = wait_tiles(",
     "        if alive == 12345:\n            ready = wait_tiles("),
    ("reduce: its own amd_mono flag never published", K,
     "publish(flags_ptr + STAGE_ID * MAX_ITEMS + i, cnt_ptr + STAGE_ID * CNT, tag, debug_mask, STAGE_ID, COUNT)",
     "pass"),
    ("tags: down reuses the o_proj call's tag", K, "t_d = t_o % _TAG_CYCLE + 1", "t_d = t_o"),
    ("tags: the launch stores the first call's tag", K, "finish_call(ptag_ptr, t_d, nprog)",
     "finish_call(ptag_ptr, t_o, nprog)"),
    ("gate/up waits on o_proj, not its reduce", K, "COUNT, ROW1,\n                              _S_RED_O)",
     "COUNT, ROW1,\n                              _S_OPROJ)"),
    ("down reduce reads the wrong residual", K, "debug_mask, xmid_ptr, x_ptr, flags_ptr", "debug_mask, x_ptr, x_ptr, "
     "flags_ptr"),
    ("down's site is o_proj's", K, "pdeadline, 2 * layer + 1, H, BN_D", "pdeadline, 2 * layer, H, BN_D"),
    ("fault injection ignored", TP, "int(self.publish)),", "1),"),
    ("logits: the padding columns kept", TP, "full if full.shape[1] == self.vocab_size else", "full if True else"),
]
M_TP = [
    ("embed: every rank keeps every id", EH, "hi = tl.where((tok >= 0) & (tok < v_rows), H, 0)", "hi = H"),
    ("embed: the vocabulary range off by one", TP, "vocab_start=binding.tp_rank * v_l, vocab_rows=v_l)",
     "vocab_start=binding.tp_rank * v_l + 1, vocab_rows=v_l)"),
    ("embed: not all-reduced", F, "self.tp.all_reduce_embedding(self.x[:shape.rows], site=2 * self.dims.layers)",
     "pass"),
    ("logits: not gathered", F, "            logits = self.tp.gather_logits(logits)\n", ""),
    ("forward: K2 without the TP stages", F, "            if self.tp is not None:  # the same buffers",
     "            if False:  # the same buffers"),
    ("fault switch: the wrong rank silent", TP, "publish=silent != binding.tp_rank",
     "publish=silent == binding.tp_rank"),
    ("fault switch: any rank number accepted", TP, "if silent is not None and not 0 <= silent < binding.tp_size:",
     "if False:"),
    ("specs: dense models at tp_size 1 only", SP, "DENSE_TP_SIZES = frozenset({1, 2, 4, 8}) if",
     "DENSE_TP_SIZES = frozenset({1}) if"),
    ("specs: MoE allowed at TP", SP, "requirements=REQUIREMENTS if a in MOE_ARCHITECTURES else",
     "requirements=REQUIREMENTS if False else"),
]
GROUPS = [(M_KERNELS, "vendors/amd_mono/tests/test_mono_kernels_tp.py"),
          (M_TP, "vendors/amd_mono/tests/test_mono_tp.py")]

if __name__ == "__main__":
    src = ["core/src", "vendors/amd_mono/src", "contract_tests/src"]  # this checkout's, before the installed ones
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([*src, os.environ.get("PYTHONPATH", "")])}
    failed = 0
    for muts, tests in GROUPS:
        failed |= mutation_runner.run(muts, tests, env, timeout_s=400)
    sys.exit(failed)
