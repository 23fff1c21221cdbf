"""Shape sweeps: every covered shape, across every batch, VERIFY-length, context and page boundary, in every
declared dtype and page size, matches the general path through the isolated oracle (``lowlat_contract.oracle``).

Each step runs on requests whose caches hold the sweep's context lengths (prefilled by the general forward),
on an engine of its own per setting (``max_context_len`` long enough for the longest context). The oracle
snapshots the pool, runs the plugin, checks the inputs and every slot outside ``out_cache_loc`` are untouched,
then runs the general forward on the snapshot and compares logits and the K/V rows stored. Steps outside
coverage (DECODE with one request more than ``max_tokens``) must take the general path. The plan and its
``full`` / ``covering`` modes are in ``lowlat_contract.sweep``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lowlat_contract.harness import Requests, dispatcher_of
from lowlat_contract.oracle import check_step
from lowlat_contract.pytest_plugin import sweep_mode
from lowlat_contract.sweep import DEFAULT_PAGE_SIZES, max_context, plan, setting_plan

PROMISE = ("Every covered shape across batch, VERIFY-length, context and page boundaries, in every declared dtype "
           "and page size, gives the general path's logits and K/V, touching nothing else.")
pytestmark = pytest.mark.lowlat_contract("shape_sweeps", PROMISE)


def _settings(case: Any) -> list[tuple[str, int]]:
    """(dtype, page size) pairs this machine can run, the case's own first: every declared dtype x page size."""
    req = case.spec.requirements
    pages = sorted(req.page_sizes) if req.page_sizes is not None else list(DEFAULT_PAGE_SIZES)
    dtypes = sorted(req.dtypes)
    out = [(case.dtype, case.page_size)]
    out += [(d, p) for d in dtypes for p in pages if (d, p) != out[0]]
    return out


def _rows(case: Any) -> int:
    """max_batch_size of the top-rows engine: twice coverage's batch (capped), so that the top-rows steps
    hold rows past it, as a serving engine with more admitted requests than one step's batch does."""
    from lowlat_contract.cases import MAX_BATCH

    return max(case.max_batch_size, min(MAX_BATCH, 2 * case.spec.coverage.max_tokens + 1))


def _runner(case: Any, dtype: str, page_size: int, rows: int | None = None, **overrides: Any) -> Any:
    from lowlat.runtime import ModelRunner

    ctx = max_context(case.device) + case.max_verify_tokens + page_size + 1
    cfg = case.engine_config(dtype=dtype, page_size=page_size, max_context_len=-(-ctx // 64) * 64,
                             max_batch_size=rows or case.max_batch_size, **overrides)
    return ModelRunner(cfg, show_progress=False)


def _owner(reqs: Requests) -> Any:
    pool = reqs.runner.kv_pool
    live = {s: f"a cached token of request {i}" for i, (r, n) in enumerate(zip(reqs.rows, reqs.lens))
            for s in pool.slots_of(r, n).tolist()}
    return lambda s: "the dummy slot 0" if s == 0 else live.get(s, "a free slot")


def run_steps(runner: Any, steps: list[Any], tol: Any, label: str) -> tuple[list[str], int, list[str]]:
    """Run each SweepStep through the oracle; returns (problems, plugin steps checked, steps supports() refused).
    A ``high_rows`` step first lets fillers hold every row but the step's, so its requests get the top rows."""
    d = dispatcher_of(runner)
    problems: list[str] = []
    refused: list[str] = []
    checked = 0
    for i, step in enumerate(steps):
        what = f"{label} {step.name}"
        pool = runner.kv_pool
        fillers = [pool.alloc_req() for _ in range(pool.free_rows - step.batch_size)] if step.high_rows else []
        try:
            problems_i, checked_i, refused_i = _run_one(runner, d, step, i, tol, what)
        finally:
            for row in fillers:
                pool.free_req(row)
        problems += problems_i
        checked += checked_i
        refused += refused_i
    return problems, checked, refused


def _run_one(runner: Any, d: Any, step: Any, i: int, tol: Any, what: str) -> tuple[list[str], int, list[str]]:
    """One SweepStep through the oracle (or the dispatcher's choice, for a step outside coverage)."""
    from lowlat.forward_batch import ForwardMode

    mode = ForwardMode[step.mode]
    problems: list[str] = []
    with Requests.with_prefixes(runner, list(step.contexts), seed=100 + i) as reqs:
        owner = _owner(reqs)
        batch = reqs.step(mode, step.tokens_per_req)
        with torch.inference_mode():
            path = d.choose(batch)
        if step.expect == "general":
            if path != "general":
                problems.append(f"{what}: outside coverage ({step.num_tokens} tokens), but the dispatcher "
                                f"chose the {path} path")
            return problems, 0, []
        if path != "plugin":
            return problems, 0, [step.name]
        return check_step(runner, batch, tol, what, owner=owner).problems, 1, []


def test_shape_sweep(case: Any, case_trace: Any, request: Any, contract_notes: list[str]) -> None:
    """The case's dtype and page size: DECODE at each batch size (and one past coverage), VERIFY at each length
    and batch, every context boundary (``sweep.plan``)."""
    from lowlat.forward_batch import ForwardMode

    cov, mode = case.spec.coverage, sweep_mode(request.config)
    steps = plan(cov.max_tokens, case.max_verify_tokens, ForwardMode.DECODE in cov.modes,
                 ForwardMode.VERIFY in cov.modes, case.page_size, case.device, mode, case.max_batch_size)
    steps = [s for s in steps if not s.high_rows and (s.expect == "general" or cov.covers(ForwardMode[s.mode],
                                                                                           s.num_tokens))]
    # CUDA: the case's engine already fits every context (cases.CUDA_CONTEXT_LEN) and a second copy of a real
    # model might not fit the device; CPU: an engine of its own (the case's is kept short for the other tests)
    own = case.device != "cuda"
    runner = _runner(case, case.dtype, case.page_size) if own else request.getfixturevalue("runner")
    try:
        problems, checked, refused = run_steps(runner, steps, case.tolerance,
                                               f"{case.dtype} page {case.page_size}")
    finally:
        if own:
            runner.close()
    contract_notes.append(f"shape_sweeps  {case.id} ({mode}): {checked} plugin steps checked, {len(refused)} refused "
                          f"by supports(){': ' + ', '.join(refused[:6]) if refused else ''}")
    assert checked, f"supports() refused every step of the sweep ({refused[:5]}...): nothing was checked"
    assert not problems, f"{len(problems)} sweep problem(s):\n" + "\n".join(problems[:25])


def test_declared_settings(case: Any, case_trace: Any, request: Any) -> None:
    """Every other declared dtype and page size this machine can run (``sweep.setting_plan``): a declared setting
    must work, not just pass the guard."""
    from lowlat.forward_batch import ForwardMode

    from lowlat_contract.cases import TOLERANCES

    if not case.is_tiny:
        pytest.skip("builds one engine per declared setting: tiny presets only")
    others = _settings(case)[1:]
    if not others:
        pytest.skip(f"the spec declares one dtype ({case.dtype}) and one page size ({case.page_size})")
    cov, mode = case.spec.coverage, sweep_mode(request.config)
    problems = []
    for dtype, page in others:
        steps = setting_plan(cov.max_tokens, case.max_verify_tokens, ForwardMode.DECODE in cov.modes,
                             ForwardMode.VERIFY in cov.modes, page, case.device, mode)
        steps = [s for s in steps if cov.covers(ForwardMode[s.mode], s.num_tokens)]
        try:
            runner = _runner(case, dtype, page)
        except Exception as e:  # a declared setting must build
            problems.append(f"{dtype} page {page}: the engine with the plugin failed to start: "
                            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            continue
        try:
            found, checked, refused = run_steps(runner, steps, TOLERANCES[dtype], f"{dtype} page {page}")
            problems += found
            if not checked:
                problems.append(f"{dtype} page {page}: supports() refused every step ({refused}), so the declared "
                                f"setting serves nothing")
        finally:
            runner.close()
    assert not problems, f"declared settings that do not work ({len(problems)}):\n" + "\n".join(problems[:25])


def test_top_rows(case: Any, case_trace: Any, request: Any) -> None:
    """The sweep plan's ``high_rows`` steps (DECODE at batch M, VERIFY 2 x 2) with the step's requests in the pool's
    top rows, fillers holding the rows below: per-request state sized by coverage's batch instead of the
    engine's ``max_batch_size`` shows (every other step gets rows 0..B-1)."""
    from lowlat.forward_batch import ForwardMode

    cov, mode = case.spec.coverage, sweep_mode(request.config)
    own = case.device != "cuda"
    rows = _rows(case) if own else case.max_batch_size
    steps = [s for s in plan(cov.max_tokens, case.max_verify_tokens, ForwardMode.DECODE in cov.modes,
                             ForwardMode.VERIFY in cov.modes, case.page_size, case.device, mode, rows)
             if s.high_rows and cov.covers(ForwardMode[s.mode], s.num_tokens)]
    if not steps:
        pytest.skip(f"the engine's {rows} rows are all within coverage's batch ({cov.max_tokens})")
    runner = _runner(case, case.dtype, case.page_size, rows) if own else request.getfixturevalue("runner")
    try:
        problems, checked, refused = run_steps(runner, steps, case.tolerance, f"{case.dtype} page {case.page_size}")
    finally:
        if own:
            runner.close()
    assert checked, f"supports() refused every top-rows step ({refused})"
    assert not problems, "steps in the pool's top rows:\n" + "\n".join(problems[:8])


def test_large_attention_scores(case: Any, case_trace: Any, request: Any) -> None:
    """Attention scores in the hundreds (``stress.scale_attention_scores``: q and k x FACTOR on an engine of its
    own, the plugin built from the scaled weights): DECODE and VERIFY steps (``covering``: DECODE) still match
    the general path. The tiny presets' scores stay below about 10, where a kernel right only for small values
    (no running maximum in its softmax, a low-precision accumulator) cannot be told apart. In the case's dtype;
    float32 at its tolerance, bfloat16 and float16 at a bound measured per row from a float32 twin of the
    engine (``conditioning``: such scores are ill-conditioned in 8-10 bits)."""
    from lowlat.forward_batch import ForwardMode

    from lowlat_contract.conditioning import Conditioned, float32_twin, twin_outputs
    from lowlat_contract.harness import rebuild_plugin
    from lowlat_contract.stress import FACTOR, scale_attention_scores

    if not case.is_tiny:
        pytest.skip("scales the weights of an engine of its own: tiny presets only")
    cov = case.spec.coverage
    # DECODE: one request with two keys, two past a 16-key tile, and (last, so the first three keep their prompts
    # and tokens) five with no cached token: the one key of each is its own, and a softmax whose running maximum
    # starts at 0 instead of -inf underflows where that score is below about -100 (mutant softmax_max_init_zero;
    # one such request showed it on one of the three tiny presets, five on all three)
    # (as many of the five as the coverage's DECODE batch allows past the first three)
    fresh = max([n for n in range(6) if cov.covers(ForwardMode.DECODE, 3 + n)], default=0)
    shapes = [(ForwardMode.DECODE, [1, 40, 70] + [0] * fresh, 1),
              (ForwardMode.VERIFY, [33], min(4, case.max_verify_tokens))]
    if sweep_mode(request.config) == "covering":  # a step costs seconds under the interpreter: DECODE only
        shapes = shapes[:1] if cov.covers(ForwardMode.DECODE, len(shapes[0][1])) else shapes[1:]
    shapes = [s for s in shapes if cov.covers(s[0], len(s[1]) * s[2]) and (s[0] is ForwardMode.DECODE or s[2] >= 2)]
    runner = _runner(case, case.dtype, case.page_size)
    twin = None
    problems: list[str] = []
    try:
        scale_attention_scores(runner.model, runner.model_config, FACTOR)
        d = dispatcher_of(runner)
        d.plugin_forward = rebuild_plugin(runner)[0]  # a plugin that packs its weights at build gets the scaled ones
        if case.tolerance.low_precision:  # ill-conditioned in 8-10 bits: the bound is measured (conditioning.py)
            twin = float32_twin(runner, lambda dt: _runner(case, dt, case.page_size, plugin="none"))
        for i, (mode, lens, tpr) in enumerate(shapes):
            tol: Any = case.tolerance
            if twin is not None:
                with Requests.with_prefixes(twin, lens, seed=300 + i) as ref:
                    tol = Conditioned(case.tolerance, twin_outputs(twin, ref.step(mode, tpr)))
            with Requests.with_prefixes(runner, lens, seed=300 + i) as reqs:
                batch = reqs.step(mode, tpr)
                what = f"q/k x {FACTOR:g} (scores x {FACTOR ** 2:g}): {mode.name} {len(lens)}x{tpr} ctx {lens}"
                problems += check_step(runner, batch, tol, what, owner=_owner(reqs)).problems
    finally:
        runner.close()
        if twin is not None:
            twin.close()
    assert shapes, f"coverage ({cov.describe()}) holds none of the stress steps"
    assert not problems, "large attention scores:\n" + "\n".join(problems[:8])
