"""mutate_mega_qkv_pairs.py's first group alone (its row-pair mutants of qkv_rope.py / qk_late.py against
test_kernels_dense.py -k qkv), run from a worktree's root as the script runs it."""

import os
import sys

sys.path.insert(0, "bench/scripts")
import mutate_mega_qkv_pairs as m  # noqa: E402 - from bench/scripts
import mutation_runner  # noqa: E402

env = {**os.environ, "TRITON_INTERPRET": "1"}
pairs = [x for x in m.M if x not in m.LATE]
dense = "vendors/nvidia_mega/tests/test_kernels_dense.py"
sys.exit(mutation_runner.run([x for x in pairs if x[1] in (m.Q, m.L)], dense, env, pytest_args=("-k", "qkv")))
