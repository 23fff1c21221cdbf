"""What a gpt-fast generate.py run measured: its printed per-sample figures, and its decode steps timed on the GPU's
own timeline from inside its process (its code unchanged).

Why: ``gpt_fast.py`` used to take gpt-fast's decode-only time as the difference of two generate.py processes (32
and 160 new tokens after the same prompt). Each process has its own compile and an eager prefill inside gpt-fast's
timer, and on the H200 that prefill moved by more than the decode between two days: qwen3-8b came out 4.581 ms per
token on 2026-12-01 and 6.189 on 2026-12-02 (bench/results/2026-12-02-h200-mega-prenorm-rule).

How: in the child, before generate.py runs, :func:`install` wraps ``torch.compile``. The function that generate.py
compiles under the name ``decode_one_token`` (one decode step; with ``--compile`` a CUDA graph, mode
"reduce-overhead") comes back wrapped: each call first records a CUDA event on the current stream (asynchronous,
a few µs of host time, no sync), then runs the step, then records one more. Within one generate() call,
consecutive start events are one token apart on the GPU's timeline: the step, the small ops gpt-fast's
``decode_n_tokens`` loop queues between steps (``input_pos += 1``, the token copies) and any idle gap while the host
prepares the next launch. At exit the child synchronizes and prints one line, ``[gpt-fast-timing] {json}``: for each
call, the milliseconds from its start event to the next call's (``next``; the last call: none) and to its own end
event (``own``). :func:`decode_ms_per_token` reads that line in the parent, taking ``own`` for the last step of each
generate() call (its ``next`` spans the following prefill). Without ``--compile`` nothing is wrapped (no line).
"""

from __future__ import annotations

import atexit
import json
import math
import re
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

STEP_NAME = "decode_one_token"  # gpt-fast's generate.py: the one-token decode step it torch.compiles
TAG = "[gpt-fast-timing]"


class GptFastError(RuntimeError):
    """gpt-fast cannot run this shape, its checkout is missing, or its output lacks a figure (message says which)."""


@dataclass
class GenerateRun:
    """One generate.py run: per-sample tokens/s and seconds (``new_tokens / tokens_per_s``), what it reported."""

    prompt_len: int
    new_tokens: int
    tokens_per_s: list[float]
    seconds: list[float]
    average_tokens_per_s: float
    compile_s: float | None
    memory_gb: float | None


_SAMPLE = re.compile(r"^Time for inference (\d+): ([\d.]+) sec total, ([\d.]+) tokens/sec", re.M)


def _field(text: str, label: str) -> str:
    m = re.search(rf"^{re.escape(label)}: ([\d.]+)", text, re.M)
    if not m:
        raise GptFastError(f"generate.py's output has no {label!r} line (a gpt-fast version whose summary "
                           f"differs?); last output:\n{text[-2000:]}")
    return m.group(1)


def parse_generate_output(text: str, *, prompt_len: int, new_tokens: int) -> GenerateRun:
    """Parse generate.py's stdout into a ``GenerateRun``.

    Raises:
        GptFastError: no per-sample lines, a summary line missing, or a batch size, prompt length or token count
            other than the one asked for.
    """
    samples = [(int(i), float(tps)) for i, _, tps in _SAMPLE.findall(text)]
    if not samples:
        raise GptFastError(f"no 'Time for inference N: ... tokens/sec' lines in generate.py's output:\n{text[-2000:]}")
    if [i for i, _ in samples] != list(range(1, len(samples) + 1)) or min(t for _, t in samples) <= 0:
        raise GptFastError(f"per-sample lines out of order or with zero tokens/sec: {samples}")
    got = {"Batch Size": int(_field(text, "Batch Size")), "Prompt Length": int(_field(text, "Prompt Length")),
           "Generated tokens": int(_field(text, "Generated tokens"))}
    want = {"Batch Size": 1, "Prompt Length": prompt_len, "Generated tokens": new_tokens}
    if got != want:
        raise GptFastError(f"generate.py ran {got}, asked for {want}")
    comp = re.search(r"^Compilation time: ([\d.]+) seconds", text, re.M)
    mem = re.search(r"^Memory used: ([\d.]+) GB", text, re.M)
    tps = [t for _, t in samples]
    return GenerateRun(prompt_len, new_tokens, tps, [new_tokens / t for t in tps],
                       float(_field(text, "Average tokens/sec")), float(comp.group(1)) if comp else None,
                       float(mem.group(1)) if mem else None)


def decode_ms(short: GenerateRun, long: GenerateRun) -> float:
    """Decode-only ms per token: the extra seconds of the long run over its extra tokens (sample medians).

    Raises:
        GptFastError: the runs have different prompts, or the long run is not longer.
    """
    if short.prompt_len != long.prompt_len or long.new_tokens <= short.new_tokens:
        raise GptFastError(f"need the same prompt and more new tokens in the long run: {short.prompt_len}/"
                           f"{short.new_tokens} vs {long.prompt_len}/{long.new_tokens}")
    extra = statistics.median(long.seconds) - statistics.median(short.seconds)
    return 1e3 * extra / (long.new_tokens - short.new_tokens)


# ---- its decode steps on the GPU timeline ----------------------------------------------------------------------



def install(torch: Any, *, at_exit: bool = True) -> Callable[[], None]:
    """Wrap ``torch.compile`` (see the module docstring) and print the step intervals at exit. CUDA only: where
    ``torch.cuda.is_available()`` is false the compiled step comes back unwrapped. Returns the printer (registered
    with ``atexit`` when ``at_exit``)."""
    real = torch.compile
    events: list[tuple[Any, Any]] = []

    def timed(step: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = step(*args, **kwargs)
            end.record()
            events.append((start, end))
            return out
        return run

    def compile_timed(model: Any = None, **kwargs: Any) -> Any:
        if model is None:  # torch.compile(mode=...) as a decorator factory: nothing of ours to time
            return real(**kwargs)
        compiled = real(model, **kwargs)
        if getattr(model, "__name__", None) != STEP_NAME or not torch.cuda.is_available():
            return compiled
        return timed(compiled)

    def report() -> None:
        if not events:
            return
        torch.cuda.synchronize()
        nxt = [a.elapsed_time(b) for (a, _), (b, _) in zip(events, events[1:], strict=False)]
        own = [a.elapsed_time(b) for a, b in events]
        print(f"{TAG} {json.dumps({'step': STEP_NAME, 'next': nxt, 'own': own})}", flush=True)
        sys.stdout.flush()

    torch.compile = compile_timed
    if at_exit:
        atexit.register(report)
    return report


def step_intervals(text: str) -> tuple[list[float], list[float]] | None:
    """The ``next`` and ``own`` milliseconds of the child's ``[gpt-fast-timing]`` line (``len(next) ==
    len(own) - 1``), or None when it printed none.

    Raises:
        ValueError: more than one such line, or one that is not the JSON :func:`install` prints.
    """
    lines = re.findall(rf"^{re.escape(TAG)} (.*)$", text, re.M)
    if not lines:
        return None
    if len(lines) > 1:
        raise ValueError(f"{len(lines)} {TAG} lines in one generate.py output; expected one")
    try:
        got = json.loads(lines[0])
        nxt, own = got["next"], got["own"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"unreadable {TAG} line {lines[0][:200]!r}: {e}") from None
    for name, ms in (("next", nxt), ("own", own)):
        if not isinstance(ms, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                               and 0 <= v < math.inf for v in ms):
            raise ValueError(f"{TAG} {name!r} must hold non-negative (finite) milliseconds, got {str(ms)[:200]}")
    if len(nxt) != len(own) - 1:
        raise ValueError(f"{TAG} has {len(nxt)} 'next' and {len(own)} 'own' intervals; expected one fewer 'next'")
    return [float(v) for v in nxt], [float(v) for v in own]


def decode_ms_per_token(intervals: tuple[list[float], list[float]], *, runs: int, new_tokens: int, prompt_len: int,
                        kv_window: tuple[int, int]) -> tuple[float, list[float]]:
    """gpt-fast's decode ms per token over the steps whose KV length lies in ``kv_window`` (inclusive): the mean
    time per step of those steps in each timed run, then the median over the runs.

    ``intervals`` (:func:`step_intervals`) covers ``runs`` generate() calls of ``new_tokens - 1`` decode steps each
    (generate.py's first new token comes from its prefill), the first call being the compile run, which is dropped.
    Step j of a call writes position ``prompt_len + j``, so it attends over ``prompt_len + j + 1`` tokens; its time
    is the ``next`` interval, or ``own`` for the last step of a call.

    Returns:
        (the median, the per-run means).
    Raises:
        ValueError: the count is not ``runs * (new_tokens - 1)``, fewer than two runs, or no step in the window.
    """
    nxt, own = intervals
    per_run = new_tokens - 1
    if runs < 2 or len(own) != runs * per_run:
        raise ValueError(f"{len(own)} timed decode steps; expected {runs} generate() calls (the compile run "
                         f"and at least one timed run) of {per_run} steps each")
    lo = max(0, kv_window[0] - prompt_len - 1)
    hi = min(per_run - 1, kv_window[1] - prompt_len - 1)
    if lo > hi:
        raise ValueError(f"no decode step of a {prompt_len}-token prompt + {new_tokens} new tokens has its KV length "
                         f"in {kv_window}")
    means = []
    for r in range(1, runs):
        base = r * per_run
        steps = [nxt[base + j] if j < per_run - 1 else own[base + j] for j in range(lo, hi + 1)]
        means.append(statistics.fmean(steps))
    return statistics.median(means), means
