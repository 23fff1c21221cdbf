"""Mutation pass of amd_mono's tensor parallelism (K2's publish and reduce stages, dense and MoE, the TP forward, build,
specs and the fault switch): break it in one place, run the tests that must notice, expect a failure.

    python3 bench/scripts/mutate_amd_tp.py      # from the repository root (or a worktree's)
    python3 bench/scripts/mutate_amd_tp.py moe  # only the groups whose name contains "moe"

Groups: ``kernels`` (``kernels/k2_tp.py``, the gate/up stage's awaited stage, a rank's sizes) against
vendors/amd_mono/tests/test_mono_kernels_tp.py (simulated ranks in one process, stage per launch, and one persistent
launch with a forged peer); ``moe-kernels`` (``kernels/k2_moe_tp.py``, the MoE's items, tile check and forward
branch) against vendors/amd_mono/tests/test_mono_kernels_moe_tp.py (the same, Qwen3-MoE); ``tp`` (the forward, the
build, the specs, the masked embedding and the fault switch) against vendors/amd_mono/tests/test_mono_tp.py
(``lowlat run --tp 2`` on CPU, a spawned gloo worker); all under TRITON_INTERPRET=1 with this checkout's sources
first on the path. Prints CAUGHT (with the first failing test) or MISSED per mutation; exits 1 if any was missed.

Left out as equivalent on CPU (no test can see them): the MoE reduce at another stage's tile width (every tile of
the tiny presets under the interpreter is 16 columns wide: ``plan.MonoPlan.build``'s interpreter tiles); the item
counts of the MoE stages' local waits and the expert down's own amd_mono flag (under the interpreter a persistent
launch is one program, so every wait is for work that program already did, and nothing of a TP launch waits on the
expert down's local flag: the reduce waits on every rank's peer flags, its own included); the MoE reduce's item
count (``plan.items``, ``S_RED_D: edown.n_tiles``) set to 1 (ran, MISSED: the count only sizes the stage-per-launch
grid, and ``k2_tp.reduce_stage`` strides over every tile from its program id, so one program reduces them all).
"""

import os
import pathlib
import sys

import mutation_runner  # same directory

V = pathlib.Path("vendors/amd_mono/src/lowlat_amd_mono")
K, F, TP = V / "kernels/k2_tp.py", V / "forward.py", V / "tp.py"
EH, SP, B = V / "kernels/embed_head.py", V / "specs.py", V / "build.py"
KM, PL = V / "kernels/k2_moe_tp.py", V / "kernels/plan.py"
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
    ("dims: moe_intermediate_size not checked against tp", PL, "intermediate_size % tp or moe_i % tp",
     "intermediate_size % tp or False"),
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
    ("forward: K2 without the TP stages", F, "        if self.tp is not None:  # the same buffers",
     "        if False:  # the same buffers"),
    ("fault switch: the wrong rank silent", TP, "publish=silent != binding.tp_rank",
     "publish=silent == binding.tp_rank"),
    ("fault switch: any rank number accepted", TP, "if silent is not None and not 0 <= silent < binding.tp_size:",
     "if False:"),
    ("specs: every model at tp_size 1 only", SP, "tp_sizes=frozenset({1, 2, 4, 8}) if PLUGIN_API_VERSION",
     "tp_sizes=frozenset({1}) if PLUGIN_API_VERSION"),
    ("build: a MoE model built without its TP state", B,
     "tp = open_tp(binding, mc.hidden_size, binding.dtype) if binding.tp_size != 1 else None",
     "tp = open_tp(binding, mc.hidden_size, binding.dtype) if binding.tp_size != 1 and not mc.is_moe else None"),
]
M_MOE = [
    ("moe publish: under o_proj's tag", KM, "pflag_ptrs, t_d, rank, cap, cap_tiles, publish, H, E,",
     "pflag_ptrs, t_o, rank, cap, cap_tiles, publish, H, E,"),
    ("moe publish: fault injection ignored", KM, "t_d, rank, cap, cap_tiles, publish, H, E, E_P2",
     "t_d, rank, cap, cap_tiles, 1, H, E, E_P2"),
    ("moe publish: the last chosen expert left out", KM, "acc = expert_down_tile(i, n_unique, T,",
     "acc = expert_down_tile(i, n_unique - 1, T,"),
    ("moe publish: the wrong flag tile", KM, "publish_rows(acc, i, T, H, BN, RM,",
     "publish_rows(acc, 0, T, H, BN, RM,"),
    ("moe reduce: awaits o_proj's call", KM, "pctl_ptr, t_d, rank, cap, cap_tiles, pdeadline, 2 * layer + 1",
     "pctl_ptr, t_o, rank, cap, cap_tiles, pdeadline, 2 * layer + 1"),
    ("moe reduce: o_proj's call site", KM, "pdeadline, 2 * layer + 1, H, BN_ED", "pdeadline, 2 * layer, H, BN_ED"),
    ("moe reduce: the residual is x, not x_mid", KM, "debug_mask, xmid_ptr, x_ptr, flags_ptr",
     "debug_mask, x_ptr, x_ptr, flags_ptr"),
    ("moe tags: the launch stores the first call's tag", KM, "finish_call(ptag_ptr, t_d, nprog)",
     "finish_call(ptag_ptr, t_o, nprog)"),
    ("moe tags: the MoE reuses the o_proj call's tag", KM, "t_d = t_o % _TAG_CYCLE + 1", "t_d = t_o"),
    ("moe router: waits on o_proj, not its reduce", KM, "MAX_ITEMS, _S_RED_O, _S_MLP1,",
     "MAX_ITEMS, _S_OPROJ, _S_MLP1,"),
    ("moe router: routes the residual x, not x_mid", KM, "debug_mask, eps, xmid_ptr, ln2_ptr, wg_ptr,",
     "debug_mask, eps, x_ptr, ln2_ptr, wg_ptr,"),
    ("moe: check_tiles ignores the expert down", TP, "(plan.down, plan.edown)", "(plan.down,)"),
    ("moe forward: the tp_size 1 MoE kernel at TP", F,
     '(k2_moe_tp_kernel, P.K2_MOE_TP_STAGES, "k2_attn_out_moe_tp") if moe else',
     '(k2_moe_kernel, P.K2_MOE_STAGES, "k2_attn_out_moe") if moe else'),
    ("moe dims: the experts' intermediate dim not split", PL, "moe_inter=cfg.moe_intermediate_size // tp,",
     "moe_inter=cfg.moe_intermediate_size,"),
]
GROUPS = [(M_KERNELS, "vendors/amd_mono/tests/test_mono_kernels_tp.py"),
          (M_MOE, "vendors/amd_mono/tests/test_mono_kernels_moe_tp.py"),
          (M_TP, "vendors/amd_mono/tests/test_mono_tp.py")]
NAMES = ["kernels", "moe-kernels", "tp"]

if __name__ == "__main__":
    src = ["core/src", "vendors/amd_mono/src", "contract_tests/src"]  # this checkout's, before the installed ones
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([*src, os.environ.get("PYTHONPATH", "")])}
    failed = 0
    for name, (muts, tests) in zip(NAMES, GROUPS):
        if len(sys.argv) < 2 or sys.argv[1] in name:
            failed |= mutation_runner.run(muts, tests, env, timeout_s=400)
    sys.exit(failed)
