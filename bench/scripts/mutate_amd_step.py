"""Mutation pass of amd_mono's one-launch step: break its cross-stage and cross-layer waits in one place, run the
CPU tests, expect a failure.

    python3 bench/scripts/mutate_amd_step.py      # from the repository root

Each mutation is applied to the source, vendors/amd_mono/tests/test_persistent_cpu.py runs under
TRITON_INTERPRET=1 (the persistent kernels over a grid of one program; a hang counts as caught after 300 s), and
the source is restored. Prints CAUGHT (with the first failing test) or MISSED per mutation; exits 1 if any was
missed. A one-program grid cannot race, so a dropped wait is caught through fault injection: a stage that never
publishes must stop the step at the wait that depends on it.
"""

import os
import pathlib
import sys

import mutation_runner  # same directory

ST = pathlib.Path("vendors/amd_mono/src/lowlat_amd_mono/kernels/step.py")
K1 = pathlib.Path("vendors/amd_mono/src/lowlat_amd_mono/kernels/k1_attn_in.py")
K2 = pathlib.Path("vendors/amd_mono/src/lowlat_amd_mono/kernels/k2_attn_out_mlp.py")
MOE = pathlib.Path("vendors/amd_mono/src/lowlat_amd_mono/kernels/moe.py")
F = pathlib.Path("vendors/amd_mono/src/lowlat_amd_mono/forward.py")
W = pathlib.Path("vendors/amd_mono/src/lowlat_amd_mono/weights.py")
M = [  # (name, file, original text, mutated text)
    ("no wait on the previous layer", K1, "            if WAIT_PREV:\n", "            if False:\n"),
    ("previous layer's items not counted", ST, "tl.where(layer > 0, N_DOWN, 0), ctl_ptr, step_ptr, H, HQ, HKV, D, "
     "TPR, M_ATT, BLOCK_S,\n                            NSPLIT_MAX, BN_Q, BK_Q, KS, KCH, QK_NORM, BN_O, BK_O, "
     "MAX_ITEMS, PF_BYTES, _S_MLP2,", "0, ctl_ptr, step_ptr, H, HQ, HKV, D, TPR, M_ATT, BLOCK_S,\n"
     "                            NSPLIT_MAX, BN_Q, BK_Q, KS, KCH, QK_NORM, BN_O, BK_O, MAX_ITEMS, PF_BYTES, _S_MLP2,"),
    ("waits on the wrong layer", ST, "prev = tl.maximum(layer - 1, 0)", "prev = layer"),
    ("RoPE heads do not publish", ST, "HQ, HKV, D, BN_Q, KS, QK_NORM, MAX_ITEMS, True, True, DT",
     "HQ, HKV, D, BN_Q, KS, QK_NORM, MAX_ITEMS, True, False, DT"),
    ("attention does not wait for RoPE", ST, "MAX_ITEMS, -1, DT, INTERP, TIMER, PREC, XC, MAXW,\n"
     "                             COUNT, True)", "MAX_ITEMS, -1, DT, INTERP, TIMER, PREC, XC, MAXW,\n"
     "                             COUNT, False)"),
    ("attention waits for the wrong v head", K2, "rope, HQ + HKV + kvh, HQ + HKV + kvh + 1,",
     "rope, HQ + kvh, HQ + kvh + 1,"),
    ("dense down does not publish", K2,
     "publish(flags_ptr + _S_MLP2 * MAX_ITEMS + i, cnt_ptr + _S_MLP2 * CNT, tag, debug_mask, 6, COUNT)", "pass"),
    ("MoE down does not publish", MOE, "one-launch step\n            publish(flags_ptr + S_ME * MAX_ITEMS + i, "
     "cnt_ptr + S_ME * CNT, tag, debug_mask, S_ME, COUNT)\n", "one-launch step\n"),
    ("unused gate/up slots do not publish", MOE, "the whole stage.\n            publish(",
     "the whole stage.\n            if u < n_unique:\n                publish("),
    ("debug masks not copied to the device", F, "        self.dbg[layer] = self.debug_masks[layer]", "        pass"),
    ("pointer table not filled", F, "                self.wtab.copy_(table)", "                pass"),
    ("KV columns swapped", W, "S.COL_KC: k_buffers[i], S.COL_VC: v_buffers[i]",
     "S.COL_KC: v_buffers[i], S.COL_VC: k_buffers[i]"),
    ("alignment not checked", W, "if t.data_ptr() % 16:", "if t.data_ptr() % 16 > 99:"),
    ("a model mixing dense and MoE layers takes the one launch", F, "not (dm.any_moe and dm.any_dense)",
     "not (dm.any_moe and dm.any_dense and False)"),
    ("error names this layer for a cross-layer wait", F, "if stage == P.S_QKV and layer > 0", "if False"),
]

if __name__ == "__main__":
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    sys.exit(mutation_runner.run(M, "vendors/amd_mono/tests/test_persistent_cpu.py", env))
