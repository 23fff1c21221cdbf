"""The shape sweeps: which steps the sweep contract runs, for a coverage, a page size and a sweep mode.

Real kernels change code path on batch size, VERIFY length, context length (split-KV boundaries), page size,
dtype and TP size, so the sweep crosses each boundary:

- DECODE at every batch size 1..M (M = the most tokens coverage allows), and M+1 (must take the general path);
- VERIFY at every tokens-per-request n in 2..M, at batch 1, 2 and the most that fits (M // n);
- contexts (tokens cached before the step) CONTEXTS: 0, 1, page-1, page, page+1, 63, 64, 65, 255, 256, 1000
  (GPU adds 1023, 1024, 2047, 2048, 4095, 4096), spread over the requests of those steps (each context
  reached at least once in DECODE and once in VERIFY), plus a DECODE and a VERIFY step per context in
  ``full`` mode;
- request rows as serving hands them out: a DECODE step at batch M and a VERIFY step (``covering``: one DECODE
  step at batch 2) whose requests hold the pool's top rows (``high_rows``: fillers hold the rows below), so
  per-row state sized by coverage's batch instead of the engine's ``max_batch_size`` shows (the other steps
  get rows 0..B-1);
- every page size and dtype the spec declares (``settings``); TP sizes are the fallback contract's TP check.

``covering`` (the default under the Triton interpreter, where a step costs seconds) keeps only the boundary
points: DECODE at 1, 2, M-1 and M; VERIFY n in {2, M} at batch 1, n = 2 and M // 2 at batch 2, n = 2 at the
largest batch; every context still reached once per mode; other page sizes
and dtypes get one DECODE and one VERIFY step each, on contexts straddling their page boundaries.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

CPU_CONTEXTS = (0, 1, 63, 64, 65, 255, 256, 1000)
GPU_EXTRA_CONTEXTS = (1023, 1024, 2047, 2048, 4095, 4096)
DEFAULT_PAGE_SIZES = (1, 16, 64)  # tried when the spec accepts any page size (None)


@dataclass(frozen=True)
class SweepStep:
    """One step: ``mode`` ("DECODE"/"VERIFY"), ``contexts`` (cached tokens of each request before it),
    ``tokens_per_req``; ``expect`` "plugin" (checked against the general path) or "general" (outside coverage:
    the dispatcher must route it to the general path); ``high_rows``: the requests take the pool's top rows."""

    mode: str
    contexts: tuple[int, ...]
    tokens_per_req: int
    expect: str = "plugin"
    high_rows: bool = False

    @property
    def batch_size(self) -> int:
        return len(self.contexts)

    @property
    def num_tokens(self) -> int:
        return self.batch_size * self.tokens_per_req

    @property
    def name(self) -> str:
        ctx = ",".join(map(str, self.contexts)) if len(self.contexts) <= 4 else \
            f"{min(self.contexts)}..{max(self.contexts)}"
        rows = " top rows" if self.high_rows else ""
        return f"{self.mode} b{self.batch_size}x{self.tokens_per_req} ctx[{ctx}]{rows}"


def contexts(page_size: int, device: str) -> tuple[int, ...]:
    """The context lengths to reach: the fixed ones plus page-1, page and page+1."""
    extra = GPU_EXTRA_CONTEXTS if device == "cuda" else ()
    return tuple(sorted({*CPU_CONTEXTS, *extra, max(0, page_size - 1), page_size, page_size + 1}))


def max_context(device: str) -> int:
    """The longest context any sweep step runs on (the sweep engines' max_context_len adds the step's tokens)."""
    return max(contexts(1, device))


def decode_sizes(m: int, mode: str) -> list[int]:
    if mode == "full":
        return list(range(1, m + 1))
    return sorted({1, min(2, m), m - 1 if m > 1 else 1, m})


def verify_shapes(m: int, max_verify: int, mode: str) -> list[tuple[int, int]]:
    """(batch, tokens per request) pairs of VERIFY steps within M tokens."""
    top = min(m, max_verify)
    if top < 2:
        return []
    out: set[tuple[int, int]] = set()
    if mode == "full":
        for n in range(2, top + 1):
            out.update((b, n) for b in {1, 2, m // n} if 1 <= b and b * n <= m)
    else:
        out.update((1, n) for n in {2, top})
        out.update((2, n) for n in {2, max(2, min(top, m // 2))} if 2 * n <= m)
        out.add((max(1, m // 2), 2))
    return sorted(out)


def plan(m: int, max_verify: int, decode: bool, verify: bool, page_size: int, device: str, mode: str,
         max_batch: int) -> list[SweepStep]:
    """The steps of the main setting (see the module docstring). ``m``: coverage's max_tokens; ``decode`` /
    ``verify``: the modes covered; ``max_batch``: the engine's max_batch_size (bounds the fallback step)."""
    ctx = contexts(page_size, device)
    steps: list[SweepStep] = []
    for kind, shapes in (("DECODE", [(b, 1) for b in decode_sizes(m, mode)] if decode else []),
                         ("VERIFY", verify_shapes(m, max_verify, mode) if verify else [])):
        if not shapes:
            continue
        pool = itertools.cycle(ctx)
        reached: set[int] = set()
        for b, n in shapes:
            c = tuple(next(pool) for _ in range(b))
            reached.update(c)
            steps.append(SweepStep(kind, c, n))
        left = [c for c in ctx if c not in reached]
        big_b, big_n = max(shapes)
        for i in range(0, len(left), big_b):  # covering: the contexts not reached yet, on the largest batch
            chunk = left[i:i + big_b]
            steps.append(SweepStep(kind, tuple(chunk + [ctx[0]] * (big_b - len(chunk))), big_n))
        if mode == "full":
            steps += [SweepStep(kind, (c,), shapes[-1][1] if kind == "VERIFY" else 1) for c in ctx]
    if decode and m + 1 <= max_batch:
        steps.append(SweepStep("DECODE", tuple(itertools.islice(itertools.cycle(ctx[:4]), m + 1)), 1, "general"))
    if max_batch > m:  # the pool's top rows (rows past coverage's batch); covering: one small DECODE step
        b = m if mode == "full" else min(2, m)
        if decode:
            steps.append(SweepStep("DECODE", tuple(itertools.islice(itertools.cycle(ctx[1:5]), b)), 1, high_rows=True))
        if verify and min(m, max_verify) >= 2 and m >= 4 and (mode == "full" or not decode):
            steps.append(SweepStep("VERIFY", (ctx[2], ctx[1]), 2, high_rows=True))
    return steps


def setting_plan(m: int, max_verify: int, decode: bool, verify: bool, page_size: int, device: str,
                 mode: str) -> list[SweepStep]:
    """The steps of another page size or dtype: the main plan in ``full`` mode; in ``covering`` one DECODE and
    one VERIFY step whose requests sit at page_size-1, page_size, page_size+1 and 2*page_size+1 tokens."""
    if mode == "full":
        return plan(m, max_verify, decode, verify, page_size, device, mode, 0)
    around = (max(0, page_size - 1), page_size, page_size + 1, 2 * page_size + 1)
    steps = []
    if decode:
        steps.append(SweepStep("DECODE", around[:max(1, min(4, m))], 1))
    if verify and min(m, max_verify) >= 2:
        n = min(m, max_verify)
        b = max(1, min(2, m // n))
        steps.append(SweepStep("VERIFY", around[1:1 + b], n))
    return steps
