"""Variants: for every checkpoint variant core's general path supports (``lowlat.models.variants
.SUPPORTED_VARIANTS``, read when the suite runs), the plugin either refuses it up front, with a reason, or
matches the general path on it.

A refusal is the guard failing on a requirement with a non-empty reason (e.g. ``model=(("attention_bias",
(False,)),)``) or ``check_model`` raising a lowlat plugin error after load. Otherwise the variant's tiny config is
written as a checkpoint directory (``lowlat.loader.synthetic.write_checkpoint``), an engine with the plugin is
built on it, and DECODE and VERIFY steps go through the isolated oracle. Variants without overrides are the
case's own model and are covered by the other contracts. The suite adds one shape variant per architecture of
its own (``ODD_DIMS``: three layers, vocabulary 500, intermediate size 80), which core's general path serves
like any other size.
"""

from __future__ import annotations

from typing import Any

import pytest

from lowlat_contract.harness import Requests
from lowlat_contract.oracle import check_step
from lowlat_contract.pytest_plugin import sweep_mode

PROMISE = ("For every model variant core's general path supports, the plugin's guard refuses it with a reason, or "
           "the plugin matches the general path on it.")
pytestmark = pytest.mark.lowlat_contract("variants", PROMISE)


ODD_DIMS = {"num_hidden_layers": 3, "vocab_size": 500, "intermediate_size": 80}
"""The suite's own shape variant of each tiny preset: a third layer (per-layer tables of two entries), a vocabulary
and an intermediate size that are no multiple of 64 or 128 (the tail tile of an LM-head or MLP kernel); the
tiny presets have 2 layers, vocabulary 512 and intermediate size 128, where such defects cannot show. The MoE
preset also gets an expert intermediate size of 40."""


def _variants() -> list[Any]:
    try:
        from lowlat.models.variants import SUPPORTED_VARIANTS, Variant
    except ImportError:  # a core without the list: nothing to enumerate
        return []
    odd = [Variant("llama-odd-dims", "tiny-llama", dict(ODD_DIMS)), Variant("qwen3-odd-dims", "tiny-qwen3",
           dict(ODD_DIMS)), Variant("moe-odd-dims", "tiny-qwen3-moe", {**ODD_DIMS, "moe_intermediate_size": 40})]
    return odd + [v for v in SUPPORTED_VARIANTS if v.overrides]  # odd first: they exercise every kernel's tails


VARIANTS = _variants()


def for_other_architecture(case: Any, name: str) -> bool:
    """Whether variant ``name`` is of another architecture than ``case``'s: such a pair is not collected
    (``contracts/conftest.py`` drops it), so a run lists only the variants each case can be checked on."""
    v = next((v for v in VARIANTS if v.name == name), None)
    return v is not None and getattr(case, "architecture", None) not in (None, v.config().architecture)


def _steps(case: Any, mode: str) -> list[tuple[Any, int, int]]:
    """(mode, requests, tokens per request) of the steps run on a variant the plugin accepts."""
    from lowlat.forward_batch import ForwardMode

    cov = case.spec.coverage
    m = cov.max_tokens
    want = [(ForwardMode.DECODE, min(3, m), 1)]
    if mode == "full":  # covering: one DECODE step (a variant changes weights and shapes, not step shapes)
        want += [(ForwardMode.VERIFY, 1, min(m, case.max_verify_tokens)), (ForwardMode.DECODE, m, 1),
                 (ForwardMode.VERIFY, max(1, m // 2), 2)]
    return [s for s in want if s[2] <= case.max_verify_tokens and cov.covers(s[0], s[1] * s[2])
            and not (s[0] is ForwardMode.VERIFY and s[2] < 2)]


@pytest.mark.parametrize("name", [v.name for v in VARIANTS] or ["none"])
def test_variant_refused_or_matches(case: Any, case_trace: Any, name: str, tmp_path: Any, request: Any) -> None:
    """The guard (or check_model) refuses this variant with a reason, or the plugin matches the general path."""
    from lowlat.loader.synthetic import write_checkpoint
    from lowlat.platform import detect_platform
    from lowlat.plugin import LowlatPluginError
    from lowlat.runtime import ModelRunner
    from lowlat.runtime.plugin_host import evaluate

    v = next((v for v in VARIANTS if v.name == name), None)
    if v is None:
        pytest.skip("this core lists no model variants (lowlat.models.variants.SUPPORTED_VARIANTS)")
    if not case.is_tiny:
        pytest.skip("variants are tiny configs: checked on the tiny preset's case")
    config = v.config()
    if config.architecture != case.architecture:  # not collected (for_other_architecture); kept for direct calls
        pytest.skip(f"variant {name} is for {config.architecture}; this case is {case.architecture}")
    trace = evaluate(case.plugin, case.spec, detect_platform(case.device), case.engine_config(), config)
    if not trace.passed:
        empty = [r.requirement for r in trace.failures if not r.reason.strip()]
        assert not empty, f"{name}: the guard refuses it without a reason on {empty}"
        return  # refused up front, with a reason
    ckpt = write_checkpoint(config, tmp_path / name, seed=0, dtype=case.dtype)
    try:
        runner = ModelRunner(case.engine_config(model=str(ckpt)), show_progress=False)
    except LowlatPluginError as e:  # check_model refused after load
        assert str(e).strip(), f"{name}: check_model refused it without a reason"
        return
    problems = []
    try:
        for i, (mode, b, tpr) in enumerate(_steps(case, sweep_mode(request.config))):
            with Requests.with_prefixes(runner, [1, 17, 33, 4, 21, 38, 7, 24][:b], seed=60 + i) as reqs:
                batch = reqs.step(mode, tpr)
                problems += check_step(runner, batch, case.tolerance, f"{name}: {mode.name} {b}x{tpr}").problems
    finally:
        runner.close()
    assert not problems, (f"the plugin accepts variant {name} ({v.overrides}) but does not match the general path "
                          f"on it; refuse it in the spec (requirements.model) or check_model, with a reason:\n"
                          + "\n".join(problems[:8]))
