"""One group of a mutation script, ``GROUPS[INDEX]``, run as the script runs it (its mutations, test file and
environment), from a worktree's root: ``python run_group.py SCRIPT INDEX`` (e.g. ``mutate_mega_tp 1``)."""

import importlib
import os
import sys

sys.path.insert(0, "bench/scripts")
import mutation_runner  # noqa: E402 - from bench/scripts

script, idx = sys.argv[1], int(sys.argv[2])
muts, tests = importlib.import_module(script).GROUPS[idx]
vendor = "vendors/amd_mono/src" if "amd" in script else "vendors/nvidia_mega/src"
src = ["core/src", vendor, "contract_tests/src"]  # as the script itself puts first
env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1",
       "PYTHONPATH": os.pathsep.join([*src, os.environ.get("PYTHONPATH", "")])}
sys.exit(mutation_runner.run(muts, tests, env, timeout_s=400))
