"""Mutation pass of ``lowlat bench``'s input sets fed through the engine's input path
(core/src/lowlat/bench/input_sets.py): break it in one place, run core/tests/test_bench_lowlat.py, expect a failure.

    .venv/bin/python bench/scripts/mutate_bench_inputs.py   # from the repository root

Prints CAUGHT (with the first failing test) or MISSED per mutation; exits 1 if any was missed. ``inputs.upload()``
and ``inputs.wait_host()`` are no-ops on a CPU (the host mirror is the buffer), so dropping them would be caught only
on a GPU: they are not listed.
"""

import os
import pathlib
import sys

import mutation_runner  # same directory

F = pathlib.Path("core/src/lowlat/bench/input_sets.py")
M = [  # (name, file, original text, mutated text)
    ("KV slots not written per step", F, "        pool.write_slots(*kv)\n", ""),
    ("every step restores set 0", F, "        inputs.host_buffer.copy_(mirrors[i % len(mirrors)])",
     "        inputs.host_buffer.copy_(mirrors[0])"),
    ("layout left stale", F, "        inputs.layout = (b, tpr)\n", ""),
    ("eager batches alias the step inputs", F, "        batches.append(_standalone(view))",
     "        batches.append(view)"),
    ("never built", F, "    built = builder is not None and builder.fits(b, tpr)", "    built = False"),
    ("built without step inputs", F, "    built = builder is not None and builder.fits(b, tpr)",
     "    built = builder is not None"),
    ("the KV slot view too short", F, "    kv = (inputs.kv_index[:b * tpr], inputs.kv_slot[:b * tpr])",
     "    kv = (inputs.kv_index[:b], inputs.kv_slot[:b])"),
]

if __name__ == "__main__":
    sys.exit(mutation_runner.run(M, "core/tests/test_bench_lowlat.py", {**os.environ, "PYTHONPATH": os.pathsep.join(
        ["core/src", os.environ.get("PYTHONPATH", "")])}))
