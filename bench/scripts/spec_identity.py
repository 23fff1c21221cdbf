"""Greedy identity of speculative decoding on one device: plain vs each drafter, batch 1 and 4, per path, with every
divergence classified as a near-tie or a bug.

``python bench/scripts/spec_identity.py --model llama-3.2-1b --device cuda --paths none,nvidia_mega``
prints one line per (path, drafter, batch): identical or not, acceptance length, VERIFY steps per path, whether
the KV pool got every page back, and one line per divergence. The drafters are ngram and the target drafting
itself (draft:MODEL: every draft kept, the draft runner's graphs and plugin path exercised). Exits 1 on a bug
(a divergence that is no near-tie) or a page not given back; near-ties alone exit 0.

Why divergences happen at all. In bfloat16 a VERIFY step of B x (k + 1) rows and a DECODE step of B rows run
different GEMM tilings and attention splits (and at B x (k + 1) > 8 tokens nvidia_mega hands VERIFY to the general
path), so where the two best tokens are nearly tied the pick can flip; CPU float32 runs are exact
(core/tests/test_spec_engine.py).

The classification. At a request's first differing token ``d`` both runs had fed the same tokens (the prompt and
the common output prefix), so the logits each run computed for token ``d`` are that path teacher-forced on the
common prefix, with its own kernels and KV cache. They are recorded during the runs (``Recorder``, an
``Engine.logits_observer`` keyed by request and output index: a VERIFY row stands for the token after the pending
token and the drafts before it; a row computed behind a rejected draft is replaced by a later step's row for the
same index before that token is appended). With ``a`` the plain run's token and ``b`` the speculative run's there:

- ``gap_plain = plain[a] - plain[b]`` and ``gap_spec = spec[b] - spec[a]`` (each >= the row's top-2 gap);
- the bound is the contract suite's per-element bound of that row, ``Tolerance.for_dtype(dtype).atol(row)`` =
  ``R * u * max(1, max |row|)`` (bfloat16: 5.08e-2 x scale; docs/contract.md, "Tolerances"), the bound that
  ``lowlat_contract.harness.compare_greedy`` excuses a plugin's greedy divergence by;
- a near-tie when both gaps are within their row's bound, otherwise a bug. The largest difference between the
  two rows and whether it is within the contract's per-row bounds are printed beside it (information only).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lowlat import Engine, EngineConfig, SamplingParams
from lowlat.forward_batch import ForwardMode

PROMPTS = [list(range(1, 40)), [7, 8, 9] * 12, [100, 200, 300] * 5 + [5] * 20, list(range(400, 430))]
Edit = Callable[[Any, torch.Tensor], None]  # fn(step, logits): may change logits in place (broken cases in tests)


def row_targets(step: Any) -> Iterator[tuple[int, Any, int]]:
    """``(logits row, request, output index)`` for each row of ``step`` that picks a token.

    Call before the step's tokens are appended (a logits observer is): a PREFILL/DECODE row picks the request's
    next token (``len(output_ids)``); VERIFY row ``i * (k+1) + j`` the token after the pending token and drafts
    ``0..j-1`` of request i (``len(output_ids) + j``).
    """
    if step.mode is ForwardMode.VERIFY:
        k1 = step.batch.tokens_per_req
        for i, r in enumerate(step.requests):
            for j in range(k1):
                yield i * k1 + j, r, len(r.output_ids) + j
    else:
        for row, r in zip(step.sample_rows, step.sample_reqs):
            yield row, r, len(r.output_ids)


class Recorder:
    """``Engine.logits_observer`` keeping, per (request id, output index), the float32 logits row [V] that picked
    it (the latest row wins: see the module docstring). Rows stay on the engine's device. ``edit`` runs first."""

    def __init__(self, edit: Edit | None = None) -> None:
        self.rows: dict[tuple[int, int], torch.Tensor] = {}
        self.edit = edit

    def __call__(self, step: Any, logits: torch.Tensor) -> None:
        if self.edit is not None:
            self.edit(step, logits)
        for row, r, idx in row_targets(step):
            if idx < r.params.max_new_tokens:
                self.rows[(r.rid, idx)] = logits[row].detach().float().clone()


def generate_recorded(engine: Engine, prompts: Sequence[Sequence[int]],
                      params: SamplingParams | Sequence[SamplingParams], edit: Edit | None = None,
                      ) -> tuple[list[list[int]], list[dict[int, torch.Tensor]]]:
    """Greedy ``generate`` with a Recorder: per prompt, its tokens and {output index: logits row}.

    Raises ValueError when ``engine`` overlaps DECODE steps (its observer sees a step after its tokens are
    appended, so the output index would be off by one): build it with ``overlap=False``.
    """
    if getattr(engine, "overlap", None) is not None:
        raise ValueError("generate_recorded needs an engine without the overlapped loop: EngineConfig(overlap=False)")
    rec = Recorder(edit)
    engine.logits_observer = rec
    try:
        done = engine.generate([list(p) for p in prompts], params)
    finally:
        engine.logits_observer = None
    rows = [{idx: t for (rid, idx), t in rec.rows.items() if rid == c.request_id} for c in done]
    return [list(c.token_ids) for c in done], rows


@dataclass
class Divergence:
    """A request's first differing token and the two runs' logits there (see the module docstring)."""

    request: int
    index: int
    plain_token: int
    spec_token: int
    gap_plain: float
    gap_spec: float
    top2_plain: float
    top2_spec: float
    bound_plain: float
    bound_spec: float
    row_max_diff: float
    rows_within_tolerance: bool
    problem: str = ""  # a recording that cannot be classified (counts as a bug)

    @property
    def near_tie(self) -> bool:
        return not self.problem and self.gap_plain <= self.bound_plain and self.gap_spec <= self.bound_spec

    def line(self) -> str:
        if self.problem:
            return f"request {self.request}, token {self.index}: BUG: {self.problem}"
        verdict = "near-tie" if self.near_tie else "BUG (no near-tie)"
        return (f"request {self.request}, token {self.index}: plain {self.plain_token} / speculative "
                f"{self.spec_token}: gap plain {self.gap_plain:.4g} (top-2 {self.top2_plain:.4g}, bound "
                f"{self.bound_plain:.4g}), gap speculative {self.gap_spec:.4g} (top-2 {self.top2_spec:.4g}, bound "
                f"{self.bound_spec:.4g}): {verdict}; rows differ by at most {self.row_max_diff:.4g} "
                f"({'within' if self.rows_within_tolerance else 'outside'} the contract's row bounds)")


def _top2(row: torch.Tensor) -> float:
    v = torch.topk(row, 2).values
    return float(v[0] - v[1])


def classify(plain: list[list[int]], plain_rows: list[dict[int, torch.Tensor]], spec: list[list[int]],
             spec_rows: list[dict[int, torch.Tensor]], dtype: str) -> list[Divergence]:
    """Every request's first divergence between the plain and the speculative run, classified.

    Args:
        plain / spec: per request, the generated ids; plain_rows / spec_rows: per request, {output index: [V]
            float32 logits row that picked it} (``generate_recorded``).
        dtype: the model dtype ("bfloat16", "float16", "float32"): the contract's tolerance for it.
    """
    from lowlat_contract.cases import Tolerance

    tol = Tolerance.for_dtype(dtype)
    out = []
    for i, (p, s) in enumerate(zip(plain, spec)):
        d = next((j for j, (x, y) in enumerate(zip(p, s)) if x != y), None)
        if d is None:
            if len(p) != len(s):
                out.append(Divergence(i, min(len(p), len(s)), -1, -1, 0, 0, 0, 0, 0, 0, 0, False,
                                      problem=f"lengths differ: plain {len(p)}, speculative {len(s)} tokens"))
            continue
        a, b = p[d], s[d]
        lp, ls = plain_rows[i].get(d), spec_rows[i].get(d)
        if lp is None or ls is None:
            out.append(Divergence(i, d, a, b, 0, 0, 0, 0, 0, 0, 0, False, problem="no logits row recorded there"))
            continue
        lp, ls = lp.float().cpu(), ls.float().cpu()
        wrong = [f"the {n} row's argmax is {int(r.argmax())}, not its token {t}"
                 for n, r, t in (("plain", lp, a), ("speculative", ls, b)) if int(r.argmax()) != t]
        check = tol.check(ls[None], lp[None], "row")
        out.append(Divergence(i, d, a, b, float(lp[a] - lp[b]), float(ls[b] - ls[a]), _top2(lp), _top2(ls),
                              tol.atol(lp), tol.atol(ls), float((lp - ls).abs().max()), check is None,
                              problem="; ".join(wrong)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--paths", default="none,nvidia_mega")
    ap.add_argument("--drafters", default=None, help="comma-separated (default ngram,draft:MODEL)")
    ap.add_argument("--batch-sizes", default="1,4")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=5)
    args = ap.parse_args(argv)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, stop_at_eos=False)
    base = dict(model=args.model, device=args.device, dtype=args.dtype, max_batch_size=4, max_context_len=512,
                overlap=False)  # the observer must see each step before its tokens are appended
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    drafters = (args.drafters or f"ngram,draft:{args.model}").split(",")
    bugs = near_ties = 0
    for path in args.paths.split(","):
        with Engine(EngineConfig(plugin=path, **base)) as e:
            dtype = str(e.runner.dtype).removeprefix("torch.")
            plain = {b: generate_recorded(e, PROMPTS[:b], params) for b in sizes}
        for method in drafters:
            cfg = EngineConfig(plugin=path, speculative_method=method, num_draft_tokens=args.k,
                               speculative_adaptive=False, **base)
            with Engine(cfg) as e:
                pool = e.runner.kv_pool
                free = pool.free_pages
                for b in sizes:
                    e.speculator.stats.reset()
                    e.stats.reset()
                    got, rows = generate_recorded(e, PROMPTS[:b], params)
                    d = e.speculator.as_dict(e)
                    divs = classify(plain[b][0], plain[b][1], got, rows, dtype)
                    n_bug = sum(not v.near_tie for v in divs)
                    bugs += n_bug + (pool.free_pages != free)
                    near_ties += len(divs) - n_bug
                    what = ("identical" if not divs else
                            f"DIFFERENT at {len(divs)} of {b} requests ({len(divs) - n_bug} near-ties, {n_bug} bugs)")
                    print(f"path={path} {method} batch={b}: {what}, acceptance length {d['acceptance_length']:.2f}, "
                          f"VERIFY steps {d['verify_steps_by_path']}, pages back {pool.free_pages == free}", flush=True)
                    for v in divs:
                        print(f"  {v.line()}", flush=True)
    print(f"summary: {near_ties} near-tie divergences, {bugs} bugs (divergences that are no near-tie, or pages not "
          "given back)")
    return 1 if bugs else 0


if __name__ == "__main__":
    sys.exit(main())
