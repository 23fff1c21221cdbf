"""Forward outputs: for every covered mode and token count, on odd context lengths, the plugin's logits match
the general forward's within the dtype's tolerance, and greedy decoding picks the general path's tokens.

Shapes: DECODE with 1, 3 and the most requests coverage allows; VERIFY with 2 and with the most tokens per
request, with as many requests as keep T within coverage. Request i's cache holds 1, 18, 35, 4, ... tokens
(prefilled by the general forward). Tolerances: ``lowlat_contract.cases.TOLERANCES`` (docs/contract.md).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lowlat_contract.harness import FORWARD_SHAPES, Requests, compare_greedy, greedy_run, prefix_lens, resolve_shape
from lowlat_contract.oracle import copy_batch, plugin_routing, restore, snapshot
from lowlat_contract.pytest_plugin import sweep_mode
from lowlat_contract.router_ties import routing_excuses

PROMISE = ("For every covered mode and token count, plugin logits match the general forward within the dtype's "
           "tolerance, and greedy decoding gives the general path's tokens.")
pytestmark = pytest.mark.lowlat_contract("forward_outputs", PROMISE)

GREEDY_PROMPT_LENS = (3, 12, 27)
GREEDY_NEW_TOKENS = 8


def _first_shape(case: Any) -> Any:
    for name in FORWARD_SHAPES:
        shape = resolve_shape(name, case)
        if not isinstance(shape, str):
            return shape
    pytest.fail(f"the spec's coverage ({case.spec.coverage.describe()}) holds no DECODE or VERIFY step")


def test_output_convention(case: Any, runner: Any, dispatcher: Any) -> None:
    """forward(batch) returns float32 logits [T, vocab] on the model's device, all finite (ForwardBatch's rule)."""
    shape = _first_shape(case)
    with Requests.with_prefixes(runner, prefix_lens(shape.batch_size)) as reqs:
        batch = reqs.step(shape.mode, shape.tokens_per_req)
        with torch.inference_mode():
            out = dispatcher.plugin_forward.forward(batch)
    assert isinstance(out, torch.Tensor), f"forward returned {type(out).__name__}; the contract is a torch.Tensor"
    want = (batch.num_logit_rows, runner.model_config.vocab_size)
    assert out.dtype == torch.float32, (f"forward returned {out.dtype} logits; the contract is float32 {want} "
                                        f"(cast with .float() before returning)")
    assert tuple(out.shape) == want, f"forward returned logits of shape {tuple(out.shape)}; expected {want}"
    assert out.device.type == runner.device.type, f"logits are on {out.device}; the model runs on {runner.device}"
    assert bool(torch.isfinite(out).all()), "forward returned NaN or inf logits"


@pytest.mark.parametrize("shape_name", FORWARD_SHAPES)
def test_logits_match_general(case: Any, runner: Any, dispatcher: Any, shape_name: str, request: Any) -> None:
    """The plugin's logits for this step shape equal the general forward's within the dtype's tolerance."""
    shape = resolve_shape(shape_name, case)
    if isinstance(shape, str):
        pytest.skip(shape)
    if sweep_mode(request.config) == "covering" and shape_name != "DECODE-b3":
        pytest.skip("covering sweep: the shape sweep checks this shape (batch 1, the most requests, VERIFY 2 and "
                    "the most tokens) through the isolated oracle")
    seed = FORWARD_SHAPES.index(shape_name)
    with Requests.with_prefixes(runner, prefix_lens(shape.batch_size), seed=seed) as reqs:
        batch = reqs.step(shape.mode, shape.tokens_per_req)
        if not dispatcher.plugin_forward.supports(batch):
            pytest.skip(f"supports() refused this {shape_name} step (the dispatcher takes the general path)")
        pristine, snap = copy_batch(batch), snapshot(runner.kv_pool)
        with torch.inference_mode():
            got = dispatcher.run("plugin", batch).clone()
            routing = plugin_routing(dispatcher.plugin_forward)
            restore(runner.kv_pool, snap)  # the oracle starts from the state the plugin saw, not what it wrote
            want, ties = routing_excuses(runner.model, lambda: runner.general_forward(pristine), batch.num_tokens,
                                         routing)
    if want.shape[0] != batch.num_tokens:
        ties = frozenset()  # logit rows are not the step's tokens: no row-to-router mapping
    problem = case.tolerance.check(got, want, f"{shape_name} logits ({shape.batch_size} requests x "
                                              f"{shape.tokens_per_req} tokens)", ties)
    assert problem is None, problem


def test_greedy_tokens_match_general(case: Any, runner: Any, dispatcher: Any) -> None:
    """Greedy decoding with the plugin installed picks the all-general run's tokens (ties within tolerance aside)."""
    from lowlat.runtime.forward_batch import ForwardMode

    cov = case.spec.coverage
    if ForwardMode.DECODE not in cov.modes:
        pytest.skip("DECODE is not in the spec's coverage")
    n = min(len(GREEDY_PROMPT_LENS), cov.max_tokens)
    if n < cov.min_tokens:
        pytest.skip(f"coverage starts at {cov.min_tokens} tokens per step")
    gen = torch.Generator().manual_seed(7)
    vocab = runner.model_config.vocab_size
    prompts = [torch.randint(0, vocab, (k,), generator=gen).tolist() for k in GREEDY_PROMPT_LENS[:n]]
    got = greedy_run(runner, prompts, GREEDY_NEW_TOKENS, force_path=None)
    want = greedy_run(runner, prompts, GREEDY_NEW_TOKENS, force_path=lambda b: "general")
    assert "plugin" in got.paths, f"no step took the plugin path (paths: {got.paths}); the plugin never ran"
    problems = compare_greedy(got, want, case.tolerance)
    assert not problems, "greedy tokens differ from the general path's:\n" + "\n".join(problems)
