"""Mutation pass of amd_mono's stage counters: break them in one place, run the CPU tests, expect a failure.

    python3 bench/scripts/mutate_amd_counters.py      # from the repository root

Each mutation is applied to the source, vendors/amd_mono/tests/test_kernels.py runs under TRITON_INTERPRET=1 (a
hang counts as caught after 300 s), and the source is restored. Prints CAUGHT (with the first failing test) or
MISSED per mutation; exits 1 if any was missed. Under the interpreter the stages run one launch each, so which
counter a persistent wait polls is exercised on a GPU only (vendors/amd_mono/tests/test_gpu.py, fault cases with
counters); these mutations cover the wait itself, the publish, the per-step reset and the host's report.
"""

import os
import pathlib
import sys

import mutation_runner  # same directory

S = pathlib.Path("vendors/amd_mono/src/lowlat_amd_mono/kernels/sync.py")
E = pathlib.Path("vendors/amd_mono/src/lowlat_amd_mono/kernels/embed_head.py")
F = pathlib.Path("vendors/amd_mono/src/lowlat_amd_mono/forward.py")
K2 = pathlib.Path("vendors/amd_mono/src/lowlat_amd_mono/kernels/k2_attn_out_mlp.py")
MOE = pathlib.Path("vendors/amd_mono/src/lowlat_amd_mono/kernels/moe.py")
M = [  # (name, file, original text, mutated text)
    ("count reached one item early", S, "lanes + seen >= need", "lanes + seen >= need - 1"),
    ("count must exceed need (off by one late)", S, "lanes + seen >= need", "lanes + seen > need"),
    ("deadline ignored", S, "tl.where((lanes + elapsed) > deadline, 1, 0))),",
     "tl.where((lanes + elapsed) < 0, 1, 0))),"),
    ("abort word not polled", S, "abort_tag = tl.load(ctl_ptr + CTL_ABORT, volatile=True)\n"
     "        elapsed = _elapsed(t0, spins, TIMER)\n        spins += 1\n        # One decision",
     "abort_tag = tl.full([], 0, tl.int32)\n"
     "        elapsed = _elapsed(t0, spins, TIMER)\n        spins += 1\n        # One decision"),
    ("an aborted counter wait counts as ready", S, "state = tl.where(sig == 3, 1, tl.where(sig == 2, 2,",
     "state = tl.where(sig == 3, 1, tl.where(sig == 2, 1,"),
    ("record holds the need, not the count seen", S,
     "_record_timeout(state == 3, tag, layer, seen, ctl_ptr, STAGE_ID, AWAITED, KIND_COUNT)",
     "_record_timeout(state == 3, tag, layer, need, ctl_ptr, STAGE_ID, AWAITED, KIND_COUNT)"),
    ("record says a flag wait", S,
     "_record_timeout(state == 3, tag, layer, seen, ctl_ptr, STAGE_ID, AWAITED, KIND_COUNT)",
     "_record_timeout(state == 3, tag, layer, seen, ctl_ptr, STAGE_ID, AWAITED, KIND_DEADLINE)"),
    ("fault bit ignored by the counter", S, 'tl.atomic_add(cnt_ptr, 1, mask=keep, sem="release", scope="gpu")',
     'tl.atomic_add(cnt_ptr, 1, sem="release", scope="gpu")'),
    ("publish adds 2", S, 'tl.atomic_add(cnt_ptr, 1, mask=keep, sem="release", scope="gpu")',
     'tl.atomic_add(cnt_ptr, 2, mask=keep, sem="release", scope="gpu")'),
    ("publish never counts", S, "    if COUNT:\n        tl.atomic_add(cnt_ptr, 1,",
     "    if False:\n        tl.atomic_add(cnt_ptr, 1,"),
    ("counters never reset", E, "tl.store(cnt_ptr + j * CNT, tl.zeros([N_CNT], tl.int32))",
     "tl.store(cnt_ptr + j * CNT, tl.load(cnt_ptr + j * CNT))"),
    ("reset misses the last layers", E, "tl.store(cnt_ptr + j * CNT, tl.zeros([N_CNT], tl.int32))",
     "tl.store(cnt_ptr + j * CNT, tl.zeros([N_CNT], tl.int32), mask=j < N_CNT // 4)"),
    ("every layer shares layer 0's counters", F, "self.counters[layer * P.NUM_STAGES]", "self.counters[0]"),
    ("o_proj counted on the combine's counter", K2, "cnt_ptr + _S_OPROJ * CNT, tag, debug_mask, 4, COUNT)",
     "cnt_ptr + _S_COMB * CNT, tag, debug_mask, 4, COUNT)"),
    ("expert gate/up not counted", MOE, "publish(flags_ptr + S_ME * MAX_ITEMS + i, cnt_ptr + S_ME * CNT, tag, "
     "debug_mask, S_ME, COUNT)\n    return alive\n\n\n@triton.jit\ndef expert_down_stage",
     "publish(flags_ptr + S_ME * MAX_ITEMS + i, cnt_ptr + S_ME * CNT, tag, debug_mask, S_ME, False)\n"
     "    return alive\n\n\n@triton.jit\ndef expert_down_stage"),
    ("host: a counter timeout reported as an item", F, 'if kind == int(KIND_COUNT) else', 'if kind == -1 else'),
]
if __name__ == "__main__":  # importing this file must not mutate the tree
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
    sys.exit(mutation_runner.run(M, "vendors/amd_mono/tests/test_kernels.py", env))
