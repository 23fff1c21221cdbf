"""Fallback: steps outside coverage take the general path, covered steps take the plugin's, switching paths
step by step gives the all-general tokens, and tensor-parallel ranks always agree on the path and the logits.

The TP check runs two processes (``lowlat_contract.tp_check``): sharded at ``tp_size`` 2 when the spec allows
it, else two replicas at TP size 1 whose Dispatcher agrees over the two-process group. On one step rank 1's
``supports()`` is wrapped to refuse: both ranks must take the general path. On every step both ranks must
return the same logits, bit for bit when sharded (each rank samples on its own), and plugin steps must match
the general path's logits.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from lowlat_contract.harness import Requests, compare_greedy, greedy_run, prefix_lens

PROMISE = ("Steps outside coverage take the general path, alternating paths per step gives the all-general tokens, "
           "and TP ranks agree on the path and the logits.")
pytestmark = pytest.mark.lowlat_contract("fallback", PROMISE)


class _Counting:
    """Wraps a PluginForward and counts forward calls."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.calls = inner, 0

    def supports(self, batch: Any) -> bool:
        return self.inner.supports(batch)

    def forward(self, batch: Any) -> torch.Tensor:
        self.calls += 1
        return self.inner.forward(batch)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _outside(case: Any, kind: str) -> tuple[Any, int, int] | str:
    """(mode, requests, tokens per request) of a step outside coverage of this kind, or why there is none."""
    from lowlat.forward_batch import ForwardMode

    cov, mb = case.spec.coverage, case.max_batch_size
    if kind == "PREFILL":
        return (ForwardMode.PREFILL, 2, 5) if ForwardMode.PREFILL not in cov.modes else "PREFILL is covered"
    if kind == "uncovered-mode":
        mode = next((m for m in (ForwardMode.VERIFY, ForwardMode.DECODE) if m not in cov.modes), None)
        return (mode, 1, 2 if mode is ForwardMode.VERIFY else 1) if mode else "DECODE and VERIFY are both covered"
    if kind == "below-min-tokens":
        return (ForwardMode.DECODE, cov.min_tokens - 1, 1) if cov.min_tokens > 1 else "coverage starts at 1 token"
    n = cov.max_tokens + 1
    if ForwardMode.DECODE in cov.modes and n <= mb:
        return ForwardMode.DECODE, n, 1
    if ForwardMode.VERIFY in cov.modes and n <= 32:
        return ForwardMode.VERIFY, 1, n
    return f"a step of {n} tokens does not fit the contract engine (max_batch_size {mb})"


@pytest.mark.parametrize("kind", ["PREFILL", "above-max-tokens", "below-min-tokens", "uncovered-mode"])
def test_outside_coverage_takes_general(case: Any, runner: Any, dispatcher: Any, monkeypatch: Any, kind: str) -> None:
    """A step outside the spec's coverage runs the general forward; the plugin's forward is not called."""
    shape = _outside(case, kind)
    if isinstance(shape, str):
        pytest.skip(shape)
    mode, n_req, tpr = shape
    counting = _Counting(dispatcher.plugin_forward)
    monkeypatch.setattr(dispatcher, "plugin_forward", counting)
    with Requests.with_prefixes(runner, prefix_lens(n_req), seed=31) as reqs:
        batch = reqs.step(mode, tpr)
        before = dict(dispatcher.stats.steps)
        with torch.inference_mode():
            runner.forward(batch)
    delta = {k: v - before.get(k, 0) for k, v in dispatcher.stats.steps.items() if v != before.get(k, 0)}
    assert counting.calls == 0, f"the plugin's forward ran for a {kind} step of {batch.num_tokens} tokens"
    assert dispatcher.last_path == "general", f"the dispatcher took the {dispatcher.last_path} path for a {kind} step"
    assert delta == {("general", mode): 1}, f"dispatcher stats for a {kind} step: {delta}; expected one general step"


def test_covered_steps_take_plugin(case: Any, runner: Any, dispatcher: Any) -> None:
    """Small covered steps (one DECODE and one VERIFY request) are served by the plugin (supports() agrees)."""
    from lowlat.forward_batch import ForwardMode

    cov = case.spec.coverage
    refused = []
    for mode, tpr in ((ForwardMode.DECODE, 1), (ForwardMode.VERIFY, 2)):
        n_req = max(1, -(-cov.min_tokens // tpr))
        if not cov.covers(mode, n_req * tpr):
            continue
        with Requests.with_prefixes(runner, prefix_lens(n_req), seed=32) as reqs:
            batch = reqs.step(mode, tpr)
            with torch.inference_mode():
                runner.forward(batch)
            if dispatcher.last_path != "plugin":
                refused.append(f"{mode.name} step of {batch.num_tokens} tokens")
    assert not refused, f"covered steps took the general path (supports() refused them): {refused}"


def test_alternating_paths_match_general(case: Any, runner: Any, dispatcher: Any) -> None:
    """Greedy decoding that switches between plugin and general path every step picks the all-general tokens:
    each path continues from the KV cache the other wrote."""
    from lowlat.forward_batch import ForwardMode

    cov = case.spec.coverage
    if ForwardMode.DECODE not in cov.modes or not cov.covers(ForwardMode.DECODE, min(2, cov.max_tokens)):
        pytest.skip("needs DECODE steps of 1 or 2 requests in coverage")
    n = min(2, cov.max_tokens)
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, runner.model_config.vocab_size, (k,), generator=gen).tolist() for k in (5, 22)[:n]]
    order = itertools.cycle(["plugin", "general"])

    def alternate(batch: Any) -> str | None:
        return None if batch.forward_mode is ForwardMode.PREFILL else next(order)

    got = greedy_run(runner, prompts, 9, force_path=alternate)
    want = greedy_run(runner, prompts, 9, force_path=lambda b: "general")
    assert {"plugin", "general"} <= set(got.paths[1:]), f"paths taken: {got.paths}"
    problems = compare_greedy(got, want, case.tolerance)
    assert not problems, "alternating paths changed the greedy tokens:\n" + "\n".join(problems)


def _tp_device(case: Any) -> str:
    from lowlat.platform import detect_platform
    from lowlat.runtime.plugin_host import evaluate

    trace = evaluate(case.plugin, case.spec, detect_platform("cpu"))
    if case.is_tiny and next(r for r in trace.results if r.requirement == "platform").status == "pass":
        return "cpu"
    if case.device == "cuda" and torch.cuda.device_count() >= 2:
        return "cuda"
    pytest.skip("the TP check needs two GPUs (or, for a tiny preset, a CPU platform the spec declares)")


def test_tp_ranks_agree(case: Any, case_trace: Any) -> None:
    """All ranks (2, and 4 where declared: gloo on CPU) take the same path on every step (general on all when
    rank 1 refuses) and return the same logits, DECODE and VERIFY; plugin steps match the general path's."""
    from lowlat_contract.tp_check import run_tp_check

    sizes = case.spec.requirements.tp_sizes
    mode = "tp" if sizes is None or 2 in sizes else "replicas"
    device = _tp_device(case)
    worlds = [2] if mode == "replicas" else sorted({w for w in (2, 3, 4) if sizes is None and w != 3 or
                                                    sizes is not None and w in sizes})
    if device == "cuda":
        worlds = [w for w in worlds if w <= torch.cuda.device_count()]
    problems = []
    for world in worlds:
        problems += [f"TP {world}: {p}" for p in _tp_problems(case, run_tp_check(case, device, mode, world=world),
                                                               mode)]
    assert not problems, f"TP ranks disagree ({mode}, {worlds} ranks):\n" + "\n".join(problems)


def _tp_problems(case: Any, reports: list[dict], mode: str) -> list[str]:
    """Problems of one TP check: each rank against rank 0, rank failures, nothing exercised."""
    problems: list[str] = []
    for other in range(1, len(reports)):
        problems += _pair_problems(case, reports[0], reports[other], other, mode)
    for r, rep in enumerate(reports):
        if rep["error"]:
            tail = "\n    ".join(rep["error"].strip().splitlines()[-6:])
            problems.append(f"rank {r} failed (the end of its traceback):\n    {tail}")
    if not problems and not any(s["path"] == "plugin" for s in reports[0]["steps"]):
        problems.append(f"no step took the plugin path on every rank (own answers: "
                        f"{[(s['name'], s['local']) for s in reports[0]['steps']]}); the check exercised nothing")
    return problems


def _pair_problems(case: Any, rep0: dict, rep1: dict, other: int, mode: str) -> list[str]:
    """Rank 0 against rank ``other``: same path every step, same logits, plugin logits near the general's."""
    problems: list[str] = []
    for a, b in zip(rep0["steps"], rep1["steps"]):
        name = a["name"]
        if a["path"] != b["path"]:
            problems.append(f"{name}: rank 0 took the {a['path']} path, rank {other} the {b['path']} path (own "
                            f"answers: {a['local']}, {b['local']}); the dispatcher did not make them agree")
        elif name.endswith("refuses") and a["path"] != "general":
            problems.append(f"{name}: rank 1's supports() refused, but both ranks took the {a['path']} path")
        if "logits" not in a or "logits" not in b:
            continue
        same = torch.equal(a["logits"], b["logits"]) if mode == "tp" else \
            case.tolerance.check(b["logits"], a["logits"], name) is None
        if not same:
            diff = float((a["logits"] - b["logits"]).abs().max())
            problems.append(f"{name} ({a['path']} path): rank {other}'s logits differ from rank 0's (max {diff:.4g}); "
                            f"each rank samples on its own, so the ranks would pick different tokens")
        for r, rep in ((0, a), (other, b)):
            if r == 0 and other > 1:
                continue  # rank 0's own problems were reported with rank 1
            problems += rep.get("problems") or []
            if rep["general"] is not None:
                bad = case.tolerance.check(rep["logits"], rep["general"], f"{name}, rank {r}, plugin vs general")
                if bad:
                    problems.append(bad)
    return problems
