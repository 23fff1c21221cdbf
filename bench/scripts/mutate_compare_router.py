"""Mutation pass of ``lowlat run --compare``'s MoE router near-tie excuse (core/src/lowlat/cli/compare_router.py and
its verdict in compare.py): break it in one place, run core/tests/test_compare_router.py and
test_plugin_runtime.py's compare tests, expect a failure.

    PYTHONPATH=core/src .venv/bin/python bench/scripts/mutate_compare_router.py   # from the repository root

Prints CAUGHT (with the first failing test) or MISSED per mutation; exits 1 if any was missed.
"""

import os
import pathlib
import sys

import mutation_runner  # same directory

R = pathlib.Path("core/src/lowlat/cli/compare_router.py")
C = pathlib.Path("core/src/lowlat/cli/compare.py")
M = [  # (name, file, original text, mutated text)
    ("the prefill's token counts", R, "if max(1, lo) <= t.token <= d), None)", "if 0 <= t.token <= d), None)"),
    ("a tie after the divergence counts", R, "if max(1, lo) <= t.token <= d), None)",
     "if max(1, lo) <= t.token), None)"),
    ("prefill steps recorded", R, "if step.mode is ForwardMode.PREFILL or not step.requests:",
     "if not step.requests:"),
    ("rows given to the wrong request", R, "if r // per_req == j:", "if r % len(step.requests) == j or True:"),
    ("ties attributed a token late", R, "first = len(req.output_ids)", "first = len(req.output_ids) + 1"),
    ("a VERIFY row's tie at the step's first token", R, "RouterTie(first + r % per_req, layer, g)",
     "RouterTie(first, layer, g)"),
    ("ties of rows that made no token kept", R, "if tie.token < len(req.output_ids):", "if True:"),
    ("hooks left installed", R, "        for h in handles:\n            h.remove()", "        pass"),
    ("observers left installed", R, "        engine.logits_observer = engine.step_observer = None\n", ""),
    ("pending ties not cleared", R, "found, pending[:] = list(pending), []", "found = list(pending)"),
    ("ties filed by first DECODE step", R,
     "{i: by_rid[c.request_id] for i, c in enumerate(done) if c.request_id in by_rid}",
     "{i: by_rid[r] for i, r in enumerate(by_rid)}"),
    ("graphs left on", R, "cuda_graph=False, overlap=False", "overlap=False"),
    ("excuse for every request", C, "return self._router_tie(j) if j == i else None", "return self._router_tie(i)"),
    ("excuse for the first to need it only", C, "if self._router_may_excuse(j) and self._router_tie(j) is not None:",
     "if self._router_may_excuse(j):"),
    ("excuse where one side ended", C, "return (d is not None and d < min(", "return (d is not None and 0 < min("),
    ("ties before the plugin's first step count", C,
     "return 1 if self.plugin.plugin_from is None else self.plugin.plugin_from.get(i)", "return 1"),
    ("no retrace check", C, "return i < len(self.router.token_ids) and self.router.token_ids[i][:d + 1] == "
     "self.general.token_ids[i][:d + 1]", "return True"),
    ("router run for float32 too", C, "self.general.dtype in (torch.bfloat16, torch.float16)", "True"),
    ("router run for dense models", C, "self.general.moe_layers > 0 and ", ""),
    ("router never run", C, "    if report.needs_router:\n        report.router",
     "    if False:\n        report.router"),
    ("strict accepts the router excuse", C, "return 0 if self.identical or (self.near_ties_only and not strict) else 1",
     "return 0 if self.identical or self.near_ties_only else 1"),
    ("the verdict ignores the router excuse", C, "bad = [i for i in differ if not self.excused(i)]",
     "bad = [i for i in differ if not self.differs_at_near_tie(i)]"),
]

if __name__ == "__main__":
    sys.exit(mutation_runner.run(M, "core/tests/test_compare_router.py", {**os.environ, "PYTHONPATH": os.pathsep.join(
        ["core/src", "core/tests", os.environ.get("PYTHONPATH", "")])}))
