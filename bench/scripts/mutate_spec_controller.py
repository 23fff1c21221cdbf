"""Mutation pass of speculative decoding's off-switch warm-up (core/src/lowlat/runtime/speculative/controller.py,
``Controller.record``): break it in one place, run core/tests/test_spec_parts.py, expect a failure.

    .venv/bin/python bench/scripts/mutate_spec_controller.py   # from the repository root

Prints CAUGHT (with the first failing test) or MISSED per mutation; exits 1 if any was missed.
"""

import os
import pathlib
import sys

import mutation_runner  # same directory

C = pathlib.Path("core/src/lowlat/runtime/speculative/controller.py")
M = [  # (name, file, original text, mutated text)
    ("no warm-up drop", C, "        if key not in self._warm:\n            self._warm.add(key)\n",
     "        if False:\n"),
    ("warm-up drops the acceptance too", C,
     "        if tau is not None:\n            self.tau = tau if self.tau is None else self.tau + self.ewma * (tau - "
     "self.tau)\n        if key not in self._warm:",
     "        if key not in self._warm:\n            pass\n        if key not in self._warm:"),
    ("no re-probe after a VERIFY warm-up", C, "            if tokens_per_req > 1:", "            if False:"),
    ("re-probe after a DECODE warm-up too", C, "            if tokens_per_req > 1:", "            if True:"),
]

if __name__ == "__main__":
    sys.exit(mutation_runner.run(M, "core/tests/test_spec_parts.py", {**os.environ, "PYTHONPATH": os.pathsep.join(
        ["core/src", "core/tests", os.environ.get("PYTHONPATH", "")])}))
