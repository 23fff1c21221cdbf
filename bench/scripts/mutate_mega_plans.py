"""Mutation pass of nvidia_mega's launch-plan sources (kernels/tuned_plans.py: ``plan_sources``, ``tuned_switch``,
the lookups of every table) and the build's switch check: break one place, run the CPU tests, expect a failure.

    PYTHONPATH=core/src:vendors/nvidia_mega/src .venv/bin/python bench/scripts/mutate_mega_plans.py   # from the root

Runs vendors/nvidia_mega/tests/test_plans.py (without its sweep smoke tests) and test_forward.py's build check per
mutant. Prints CAUGHT (with the first failing test) or MISSED per mutation; exits 1 if any was missed.
"""

import os
import pathlib
import sys

import mutation_runner  # same directory

T = pathlib.Path("vendors/nvidia_mega/src/lowlat_nvidia_mega/kernels/tuned_plans.py")
B = pathlib.Path("vendors/nvidia_mega/src/lowlat_nvidia_mega/build.py")
M = [  # (name, file, original text, mutated text)
    ("no sibling GPU read", T, "and chip is not None and c == chip)", "and False)"),
    ("sibling by capability alone", T, "and chip is not None and c == chip)",
     "and chip is not None and c[0] == chip[0])"),
    ("switch inverted", T, "return bool(env_switch(TUNED_ENV, True,", "return not bool(env_switch(TUNED_ENV, True,"),
    ("switch ignored", T, "if not tuned_switch():", "if False:"),
    ("own entries never read", T, "own, chip = device_name(device), device_chip(device)",
     'own, chip = "no GPU", device_chip(device)'),
    ("sibling before own", T, "    for source in plan_sources(device):",
     "    for source in reversed(plan_sources(device)):"),
    ("prenorm by exact name only", T,
     'return _lookup(TUNED_PRENORM, (kind, hidden, str(dtype).removeprefix("torch.")), device) or 0',
     'return TUNED_PRENORM.get((device_name(device), kind, hidden, str(dtype).removeprefix("torch.")), 0)'),
    ("attention table never hit", T, 'hit = _lookup(TUNED_ATTN, ("attn",', 'hit = _lookup(TUNED_ATTN, ("attn_",'),
    ("the H200's chip misrecorded", T, '"NVIDIA H200": ((9, 0), 132),', '"NVIDIA H200": ((9, 0), 114),'),
    ("a bad switch value passes the build", B, "prefetch_act_enabled, prenorm_switch, tuned_switch, tp_reduce_mode,",
     "prefetch_act_enabled, prenorm_switch, tp_reduce_mode,"),
    ("the switch counted unknown", B, "SWITCHES = (PDL_ENV, PREFETCH_ENV, PRENORM_ENV, TUNED_ENV,",
     "SWITCHES = (PDL_ENV, PREFETCH_ENV, PRENORM_ENV,"),
]

if __name__ == "__main__":
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    failed = mutation_runner.run([m for m in M if m[1] == T], "vendors/nvidia_mega/tests/test_plans.py", env,
                                 pytest_args=("-k", "not smoke"))
    failed |= mutation_runner.run([m for m in M if m[1] == B], "vendors/nvidia_mega/tests/test_forward.py", env,
                                  pytest_args=("-k", "build_names"))
    sys.exit(failed)
