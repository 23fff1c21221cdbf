"""Mutation pass of bench/peers/gpt_fast_output.py (gpt-fast's decode steps timed with CUDA events, and the check of
its timing line): break it in one place, run core/tests/test_bench_gpt_fast.py, expect a failure.

    PYTHONPATH=core/src .venv/bin/python bench/scripts/mutate_gpt_fast_output.py   # from the repository root

Prints CAUGHT (with the first failing test) or MISSED per mutation; exits 1 if any was missed.
"""

import os
import pathlib
import sys

import mutation_runner  # same directory

OUT = pathlib.Path("bench/peers/gpt_fast_output.py")
M = [  # (name, file, original text, mutated text)
    ("every compiled function timed", OUT, "getattr(model, \"__name__\", None) != STEP_NAME or", "False and"),
    ("timed without CUDA", OUT, " or not torch.cuda.is_available():", ":"),
    ("the end event before the step", OUT, "            out = step(*args, **kwargs)\n            end.record()",
     "            end.record()\n            out = step(*args, **kwargs)"),
    ("the compile run kept", OUT, "for r in range(1, runs):", "for r in range(0, runs):"),
    ("the last step's next interval", OUT, "nxt[base + j] if j < per_run - 1 else own[base + j]",
     "nxt[min(base + j, len(nxt) - 1)]"),
    ("own time for every step", OUT, "nxt[base + j] if j < per_run - 1 else own[base + j]", "own[base + j]"),
    ("window one step late", OUT, "lo = max(0, kv_window[0] - prompt_len - 1)",
     "lo = max(0, kv_window[0] - prompt_len)"),
    ("window end left open", OUT, "hi = min(per_run - 1, kv_window[1] - prompt_len - 1)", "hi = per_run - 1"),
    ("mean over runs", OUT, "return statistics.median(means), means", "return statistics.fmean(means[:1]), means"),
    ("two lines accepted", OUT, "if len(lines) > 1:", "if len(lines) > 2:"),
    ("negative times accepted", OUT, "and 0 <= v < math.inf for v in ms", "and v < math.inf for v in ms"),
    ("infinite times accepted", OUT, "and 0 <= v < math.inf for v in ms", "and 0 <= v for v in ms"),
    ("booleans accepted", OUT, "and not isinstance(v, bool)\n", "\n"),
    ("list lengths unchecked", OUT, "if len(nxt) != len(own) - 1:", "if False:"),
    ("step count unchecked", OUT, "if runs < 2 or len(own) != runs * per_run:", "if runs < 2:"),
]

if __name__ == "__main__":
    sys.exit(mutation_runner.run(M, "core/tests/test_bench_gpt_fast.py", dict(os.environ)))
