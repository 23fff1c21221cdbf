"""Sampled ids (plugin API 3): a plugin whose coverage declares ``sampling`` returns, when a DECODE step asks for
ids, the tokens the core sampler would pick from the general path's logits: greedy ids equal their argmax (the
lowest index among exact ties; near-ties within the dtype's bound either way), sampled ids follow the core
sampler's distribution (temperature, top-k, top-p) of the same logits, the same seeds give the same ids, and a
row whose logits are not all finite comes back as -1 (the engine's non-finite guard on this path).

Method: requests with cached prefixes; the step's ``SamplingInfo`` is built as the engine builds it
(``lowlat.runtime.sampling_inputs``). The distribution test repeats one DECODE step of B identical requests
(same prompt, so the same logits; one seed per row and repetition) until it has ``DRAWS`` draws, and compares them
with ``target_probs`` of the plugin's own logits of that step (those match the general path's within tolerance:
``forward_outputs``) by a chi-square test of size ``ids_check.ALPHA`` (1e-4), plus an exact support check.
Exact ties come from two equal rows of the LM head weight, non-finite logits from a NaN row; the plugin is
rebuilt over the changed parameters and they are restored after.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lowlat_contract.harness import Requests, prefix_lens, rebuild_plugin
from lowlat_contract.ids_check import distribution_problem, greedy_problem, nonfinite_problem, temperature_for
from lowlat_contract.oracle import copy_batch, restore, snapshot

_CHECKED: set[tuple[str, str]] = set()  # covering sweeps: (plugin, variant or "read-only") one case has checked
PROMISE = ("With coverage.sampling, sampled ids equal the general path's argmax (ties: lowest index) and follow "
           "the core sampler's distribution; the same seeds give the same ids; non-finite rows come back -1.")
pytestmark = pytest.mark.lowlat_contract("sampled_ids", PROMISE)
DRAWS = 480
COVERING_DRAWS = 160
"""Draws per variant in ``covering`` sweeps (the Triton interpreter: one draw of B rows is one interpreted forward,
3-8 s): 20 forwards at B = 8 instead of 60. Still enough: the kind-9 mutants (temperature ignored, top-k one
too many, ...) fail at this count too (``test_mutants.py::test_sampling_mutant_fails_covering_sampled_ids``);
full sweeps (GPUs, plain torch) draw ``DRAWS``."""


@pytest.fixture
def sampling(case: Any) -> Any:
    from lowlat.forward_batch import ForwardMode

    sc = case.spec.coverage.sampling
    if sc is None:
        pytest.skip("the spec declares no sampled ids (coverage.sampling): the runtime always asks for logits")
    if ForwardMode.DECODE not in sc.modes:
        pytest.skip("coverage.sampling does not include DECODE, the mode the runtime asks ids in")
    return sc


def _attach(runner: Any, batch: Any, params: list, seeds: list[int]) -> Any:
    from lowlat.runtime.sampling_inputs import SamplingInputs

    si = SamplingInputs(device=runner.device, max_rows=len(params), vocab=runner.model_config.vocab_size)
    batch.sampling = si.fill(params, seeds, [n - 1 for n in batch.seq_lens_cpu])
    batch.logits_required = False
    return batch


def _rows(case: Any, want: int) -> int:
    return max(case.spec.coverage.min_tokens, min(want, case.spec.coverage.max_tokens))


def test_greedy_ids_match_general(case: Any, runner: Any, dispatcher: Any, sampling: Any) -> None:
    """Greedy ids of a DECODE step equal the argmax of the general path's logits (near-ties within the bound)."""
    from lowlat.forward_batch import ForwardMode
    from lowlat.runtime.sampling import SamplingParams

    b = _rows(case, 3)
    with Requests.with_prefixes(runner, prefix_lens(b), seed=11) as reqs:
        batch = _attach(runner, reqs.step(ForwardMode.DECODE, 1), [SamplingParams()] * b, [0] * b)
        pristine, snap = copy_batch(batch), snapshot(runner.kv_pool)
        pristine.sampling, pristine.logits_required = None, True
        with torch.inference_mode():
            ids = dispatcher.run("plugin", batch, check=False).clone()
            restore(runner.kv_pool, snap)
            want = runner.general_forward(pristine)
    assert ids.dtype == torch.int64 and tuple(ids.shape) == (b,), f"ids {ids.dtype} {tuple(ids.shape)}"
    problem = greedy_problem(ids, want, case.tolerance.atol(want), f"greedy ids of DECODE with {b} requests")
    assert problem is None, problem


def _lm_head_name(params: dict) -> str:
    return "lm_head.weight" if "lm_head.weight" in params else "model.embed_tokens.weight"


def _with_rows(runner: Any, change: Any, run: Any) -> Any:
    """Run ``run(forward)`` on the plugin rebuilt with the LM head weight changed by ``change(w)`` (restored)."""
    params = runner.plugin_host.binding.params
    w = params[_lm_head_name(params)]
    saved = w.detach().clone()
    try:
        with torch.no_grad():
            change(w)
        fwd, _ = rebuild_plugin(runner)
        return run(fwd)
    finally:
        with torch.no_grad():
            w.copy_(saved)


def _step(runner: Any, fwd: Any, b: int, params: list) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, general logits) of one DECODE step of ``b`` requests whose inputs are tokens 2 .. 3b + 5 (never 0, 1
    or the last token: the rows the ties and NaN tests change, which a tied embedding also reads)."""
    from lowlat.forward_batch import ForwardMode

    with Requests(runner, [[2 + 3 * i + j for j in range(4 + i)] for i in range(b)]) as reqs:
        toks = [[2 + i] for i in range(b)]
        batch = _attach(runner, reqs.step(ForwardMode.DECODE, 1, toks), params, list(range(1, b + 1)))
        pristine, snap = copy_batch(batch), snapshot(runner.kv_pool)
        pristine.sampling, pristine.logits_required = None, True
        with torch.inference_mode():
            ids = fwd.forward(batch).clone()
            restore(runner.kv_pool, snap)
            return ids, runner.general_forward(pristine)


def test_greedy_exact_ties_pick_lowest_index(case: Any, runner: Any, dispatcher: Any, sampling: Any) -> None:
    """With two equal LM head rows tied at the maximum, the greedy id is the lower index (torch.argmax's rule)."""
    from lowlat.runtime.sampling import SamplingParams

    b = _rows(case, 2)
    probe = _step(runner, dispatcher.plugin_forward, b, [SamplingParams()] * b)[1]
    top = int(torch.argmax(probe[0]))
    low = 0 if top > 0 else 1  # a row below (or, for top 0, above) the argmax becomes its exact copy
    ids, want = _with_rows(runner, lambda w: w[low].copy_(w[top]),
                           lambda fwd: _step(runner, fwd, b, [SamplingParams()] * b))
    row = want[0]
    if float(row[low]) != float(row[top]) or float(row.max()) != float(row[top]):
        pytest.skip(f"the general path's logits of the copied rows are not tied at the maximum here "
                    f"({float(row[low])} vs {float(row[top])}, max {float(row.max())})")
    problem = greedy_problem(ids[:1], want[:1], None, "greedy ids with LM head rows "
                             f"{min(low, top)} and {max(low, top)} equal", exact_ties=True)
    assert problem is None, problem


def test_nonfinite_rows_are_flagged(case: Any, runner: Any, dispatcher: Any, sampling: Any) -> None:
    """A NaN row of the LM head weight makes every row's logits non-finite: every id must be -1 (greedy and,
    when served, sampled rows)."""
    from lowlat.runtime.sampling import SamplingParams

    b = _rows(case, 2)
    params = [SamplingParams()] + [SamplingParams(temperature=1.0) if sampling.temperature else SamplingParams()
                                   ] * (b - 1)
    nan_row = runner.model_config.vocab_size - 1
    ids, want = _with_rows(runner, lambda w: w[nan_row].fill_(float("nan")),
                           lambda fwd: _step(runner, fwd, b, params))
    assert not bool(torch.isfinite(want).all()), "suite bug: the general path's logits stayed finite"
    problem = nonfinite_problem(ids, want, f"DECODE with {b} requests and a NaN LM head row")
    assert problem is None, problem


VARIANTS = {"sample": {}, "top_k": {"top_k": 3}, "top_p": {"top_p": 0.7}, "top_k_top_p": {"top_k": 6, "top_p": 0.8}}


def _variant_params(name: str, sc: Any, temperature: float) -> Any:
    from lowlat.runtime.sampling import SamplingParams

    kw = VARIANTS[name]
    if not sc.temperature:
        return "coverage.sampling serves greedy rows only"
    if kw.get("top_k", 0) > sc.max_top_k:
        return f"coverage.sampling serves top_k <= {sc.max_top_k}, not {kw['top_k']}"
    if "top_p" in kw and (sc.top_p == "none" or (sc.top_p == "with_top_k" and "top_k" not in kw)):
        return f"coverage.sampling serves top_p {sc.top_p!r}"
    return SamplingParams(temperature=temperature, **kw)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_sampled_ids_follow_distribution(case: Any, runner: Any, dispatcher: Any, sampling: Any,
                                         variant: str, request: pytest.FixtureRequest) -> None:
    """Sampled ids of one DECODE step follow the core sampler's distribution of the step's logits; seeds
    reproduce.

    Covering sweeps (the default under the Triton interpreter, where a draw of B rows is one interpreted
    forward) draw ``COVERING_DRAWS`` and check each variant on the first architecture case only: the sampling
    happens after the LM head, on logits whose agreement with the general path every architecture's
    forward_outputs already checks. Full sweeps check every case.
    """
    from lowlat.forward_batch import ForwardMode
    from lowlat.runtime.sampling import SamplingParams
    from lowlat.runtime.speculative.verify import target_probs

    from lowlat_contract.pytest_plugin import sweep_mode

    key = (str(request.config.getoption("lowlat_plugin", default="") or ""), variant)
    covering = sweep_mode(request.config) == "covering"
    n_draws = COVERING_DRAWS if covering else DRAWS
    if covering and key in _CHECKED:
        pytest.skip(f"covering sweep: {variant} sampling passed on an earlier architecture "
                    "(--lowlat-sweep full checks every one)")

    b = _rows(case, 8)
    prompt = Requests.with_prefixes(runner, [9], seed=5).prompts[0]
    with Requests(runner, [prompt] * b) as reqs:
        batch = reqs.step(ForwardMode.DECODE, 1, [[prompt[-1]]] * b)
        snap = snapshot(runner.kv_pool)
        with torch.inference_mode():
            logits = dispatcher.run("plugin", copy_batch(batch)).clone()
            restore(runner.kv_pool, snap)
        params = _variant_params(variant, sampling, temperature_for(logits[0]))
        if isinstance(params, str):
            pytest.skip(params)
        assert isinstance(params, SamplingParams)
        draws, first = [], None
        with torch.inference_mode():
            for rep in range(-(-n_draws // b)):
                seeds = [1000 * rep + i + 1 for i in range(b)]
                # the same inputs rewrite the same K/V at the same slots: no restore between repetitions
                ids = dispatcher.run("plugin", _attach(runner, batch, [params] * b, seeds)).clone()
                if rep == 0:
                    again = dispatcher.run("plugin", _attach(runner, batch, [params] * b, seeds)).clone()
                    assert torch.equal(ids, again), (f"the same seeds gave ids {ids.tolist()}, then "
                                                     f"{again.tolist()}: sampled ids must be reproducible")
                    first = ids
                draws.append(ids)
            restore(runner.kv_pool, snap)
    assert first is not None
    probs = target_probs(logits[:1], [params])[0]
    problem = distribution_problem(torch.cat(draws), probs, f"{variant} ({params}) on {case.model}")
    assert problem is None, problem
    _CHECKED.add(key)


def test_sampling_inputs_left_untouched(case: Any, runner: Any, dispatcher: Any, sampling: Any,
                                       request: pytest.FixtureRequest) -> None:
    """The plugin leaves the step's SamplingInfo and batch tensors as the runtime wrote them, for a greedy step
    and for the widest sampled variant its coverage serves: the runtime rewrites a step's sampling rows only when
    they change (``lowlat.runtime.sampling_inputs``), so an in-place edit would carry into the next steps.
    Covering sweeps check the first architecture case that passes, as the distribution test does; full sweeps
    every case."""
    from lowlat.forward_batch import ForwardMode
    from lowlat.runtime.sampling import SamplingParams

    from lowlat_contract.ids_check import sampling_edits, sampling_snapshot
    from lowlat_contract.oracle import input_edits
    from lowlat_contract.pytest_plugin import sweep_mode

    key = (str(request.config.getoption("lowlat_plugin", default="") or ""), "read-only")
    covering = sweep_mode(request.config) == "covering"
    if covering and key in _CHECKED:
        pytest.skip("covering sweep: the sampling inputs stayed untouched on an earlier architecture "
                    "(--lowlat-sweep full checks every one)")

    b = _rows(case, 2)
    sets: list[tuple[str, list]] = [("greedy", [SamplingParams()] * b)]
    for name in ("top_k_top_p", "top_k", "top_p", "sample"):  # the widest first
        params = _variant_params(name, sampling, 0.8)
        if not isinstance(params, str):
            sets.append((name, [params] * b if b == 1 else [SamplingParams()] + [params] * (b - 1)))
            break
    with Requests.with_prefixes(runner, prefix_lens(b), seed=13) as reqs:
        batch = reqs.step(ForwardMode.DECODE, 1)
        snap = snapshot(runner.kv_pool)
        problems = []
        for name, params in sets:
            _attach(runner, batch, params, list(range(3, 3 + b)))
            pristine = copy_batch(batch)
            before = sampling_snapshot(batch.sampling)
            with torch.inference_mode():
                dispatcher.run("plugin", batch, check=False)
                restore(runner.kv_pool, snap)
            edited = sampling_edits(batch.sampling, before) + input_edits(batch, pristine)
            if edited:
                problems.append(f"a {name} DECODE step of {b} requests changed {', '.join(edited)} in place")
    assert not problems, "; ".join(problems) + " (a plugin must treat its inputs as read-only)"
    _CHECKED.add(key)
