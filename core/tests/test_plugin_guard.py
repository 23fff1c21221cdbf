"""The guard: every requirement evaluated with a reason, against simulated machines."""

from __future__ import annotations

import pytest
from lowlat.config import EngineConfig
from lowlat.forward_batch import ForwardMode
from lowlat.loader.presets import get_preset
from lowlat.platform import Platform
from lowlat.plugin import Coverage, ModelSpec, PlatformRequirement, Requirements
from lowlat.runtime.plugin_host import evaluate

H200 = Platform("cuda", "NVIDIA H200", (9, 0), None, 1, False, "3.6.0")
A100 = Platform("cuda", "NVIDIA A100", (8, 0), None, 1, False, "3.6.0")
MI300 = Platform("rocm", "AMD Instinct MI300X", None, "gfx942", 8, False, "3.6.0")
CPU = Platform("cpu", "cpu")
CPU_INTERP = Platform("cpu", "cpu", triton_interpreter=True)


def spec(check_environment=None, **req) -> ModelSpec:
    base = dict(
        platforms=(PlatformRequirement("cuda", min_capability=(9, 0)), PlatformRequirement("rocm", archs=("gfx942",)),
                   PlatformRequirement("cpu", triton_interpreter=True)),
        dtypes=frozenset({"bfloat16"}),
    )
    base.update(req)
    return ModelSpec(
        architecture="LlamaForCausalLM",
        requirements=Requirements(**base),
        coverage=Coverage(modes=frozenset({ForwardMode.DECODE}), max_tokens=8),
        build="x:build",
        check_environment=check_environment,
    )


def result(trace, name):
    return next(r for r in trace.results if r.requirement == name)


@pytest.mark.parametrize(("platform", "ok"), [(H200, True), (A100, False), (MI300, True), (CPU, False),
                                              (CPU_INTERP, True)])
def test_platform(platform, ok):
    r = result(evaluate("p", spec(), platform), "platform")
    assert (r.status == "pass") == ok
    if not ok:
        assert "needs platform cuda with capability >= 9.0" in r.reason
        assert f"this machine: {platform.describe()}" in r.reason


def test_cpu_reason_reads_like_the_docs():
    s = spec(platforms=(PlatformRequirement("cuda", min_capability=(9, 0)),))
    reason = result(evaluate("p", s, CPU), "platform").reason
    assert reason == "needs platform cuda with capability >= 9.0; this machine: cpu"


def test_engine_requirements_each_with_reason():
    s = spec(tp_sizes=frozenset({1}), page_sizes=frozenset({16, 64}), features_refused=frozenset({"speculative"}))
    model = get_preset("tiny-llama")
    good = evaluate("p", s, H200, EngineConfig(dtype="bfloat16"), model)
    assert good.passed, good.format()
    bad = evaluate("p", s, H200, EngineConfig(dtype="float16", tp_size=2, page_size=1, speculative=True), model)
    assert not bad.passed
    assert {r.requirement for r in bad.failures} == {"dtype", "tp_size", "page_size", "features"}
    assert "needs dtype bfloat16; the engine runs float16" in result(bad, "dtype").reason
    assert "needs tp_size in [1]; the engine has 2" == result(bad, "tp_size").reason
    assert "refuses feature speculative" in result(bad, "features").reason


def test_required_feature_cuda_graph_is_off_on_cpu():
    s = spec(features_required=frozenset({"cuda_graph"}))
    r = result(evaluate("p", s, CPU_INTERP, EngineConfig(dtype="bfloat16")), "features")
    assert r.status == "fail" and "needs feature cuda_graph on" in r.reason


def test_model_requirements_and_architecture():
    model = get_preset("tiny-qwen3")
    s = spec(model=(("head_dim", (64, 128)),))
    t = evaluate("p", s, H200, EngineConfig(dtype="bfloat16"), model)
    assert "spec serves LlamaForCausalLM; the model is Qwen3ForCausalLM" in result(t, "architecture").reason
    assert result(t, "model.head_dim").reason == f"needs one of [64, 128]; the model has {model.head_dim}"


def test_library_versions():
    t = evaluate("p", spec(libraries=(("pluggy", ">=1.0"), ("pluggy", "<0.1"), ("no-such-dist", ">=1"))), H200)
    libs = [r for r in t.results if r.requirement.startswith("library")]
    assert [r.status for r in libs] == ["pass", "fail", "fail"]
    assert "pip install 'pluggy<0.1'" in libs[1].reason and "not installed" in libs[2].reason


def test_missing_context_is_skipped_not_failed():
    t = evaluate("p", spec(), H200)
    assert t.passed
    assert {r.status for r in t.results if r.requirement in ("dtype", "architecture")} == {"skip"}


def test_trace_format_lists_every_requirement():
    t = evaluate("p", spec(), CPU, EngineConfig(dtype="float32"), get_preset("tiny-llama"))
    text = t.format()
    assert text.startswith("p / LlamaForCausalLM: FAIL")
    assert "[fail] platform" in text and "[fail] dtype" in text and "[pass] architecture" in text


def test_dtype_auto_without_a_model_is_float32_on_a_cpu_and_unknown_on_a_gpu():
    # lowlat plugins on a CPU: --dtype auto computes in float32 whatever the model, so a bfloat16-only plugin fails
    # here as `lowlat run --plugin NAME` would (it said "skip: depends on the model" and the row read as a pass)
    r = result(evaluate("p", spec(), CPU_INTERP, EngineConfig()), "dtype")
    assert r.status == "fail" and "the engine runs float32, what --dtype auto computes in on a CPU" in r.reason
    fp32 = spec(dtypes=frozenset({"float32"}))
    assert result(evaluate("p", fp32, CPU_INTERP, EngineConfig()), "dtype").status == "pass"
    assert result(evaluate("p", spec(), H200, EngineConfig()), "dtype").status == "skip"  # the checkpoint's dtype


CALLS: list[str] = []


def env_ok() -> None:
    CALLS.append("ok")


def env_bad() -> None:
    raise ValueError("LOWLAT_X_TILE: '3' must be a power of two; unset it or pass 4")


def test_check_environment_runs_in_the_guard_and_a_refusal_fails_it_with_the_message():
    CALLS.clear()
    ok = evaluate("p", spec(check_environment=f"{__name__}:env_ok"), H200)
    assert ok.passed and result(ok, "environment").status == "pass" and CALLS == ["ok"]
    bad = evaluate("p", spec(check_environment=f"{__name__}:env_bad"), H200)
    assert not bad.passed
    want = "ValueError: LOWLAT_X_TILE: '3' must be a power of two; unset it or pass 4"
    assert result(bad, "environment").reason == want
    assert "environment: ValueError: LOWLAT_X_TILE" in bad.summary()


def test_check_environment_that_cannot_import_fails_naming_the_path_and_is_skipped_without_its_libraries():
    t = evaluate("p", spec(check_environment="no_such_module_xyz:check"), H200)
    r = result(t, "environment")
    assert r.status == "fail" and "cannot import no_such_module_xyz:check" in r.reason
    t = evaluate("p", spec(check_environment=f"{__name__}:env_bad", libraries=(("no-such-dist", ">=1"),)), H200)
    assert result(t, "environment").status == "skip"  # not run (it would fail) without its libraries
    assert [r.requirement for r in t.failures] == ["library no-such-dist>=1"]


def test_spec_without_check_environment_has_no_environment_row_and_a_bad_path_is_refused():
    assert all(r.requirement != "environment" for r in evaluate("p", spec(), H200).results)
    with pytest.raises(Exception, match="check_environment must be an import path"):
        spec(check_environment="no_colon")
