"""lowlat.plugin.ReferenceStep: it equals the general path, every stage is on its path, one override is enough."""

from __future__ import annotations

import pytest
import torch
from lowlat import EngineConfig, ForwardMode
from lowlat.plugin import STAGES, PluginBinding, PluginBuildError, ReferenceStep, bind_params
from lowlat.runtime.model_runner import ModelRunner


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen3-moe"])
def runner(request):
    cfg = EngineConfig(model=request.param, device="cpu", dtype="float32", plugin="none", max_batch_size=4,
                       max_context_len=64)
    r = ModelRunner(cfg)
    yield r
    r.close()


def binding(r: ModelRunner, params: dict | None = None) -> PluginBinding:
    b = PluginBinding(plugin="t", model_config=r.model_config, engine_config=r.config, device=r.device,
                      dtype=r.dtype, params=params or dict(r.model.named_parameters(remove_duplicate=False)))
    b.attach_kv_pool(r.kv_pool)
    return b


def run_step(r: ModelRunner, step: ReferenceStep | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One VERIFY step (2 requests x 3 tokens, after a prefill): its logits and the K/V rows it stored."""
    pool = r.kv_pool
    rows = [pool.alloc_req() for _ in range(2)]
    try:
        with torch.inference_mode():
            r.forward(r.prepare_batch(ForwardMode.PREFILL, rows, [0, 0], [[3, 4, 5, 6], [7, 8]]))
            batch = r.prepare_batch(ForwardMode.VERIFY, rows, [4, 2], [[9, 10, 11], [12, 13, 14]])
            snap = [t.clone() for t in pool.k_buffers + pool.v_buffers]
            out = r.general_forward(batch) if step is None else step.forward(batch)
            kv = [t[batch.out_cache_loc].clone() for t in pool.k_buffers + pool.v_buffers]
            for t, s in zip(pool.k_buffers + pool.v_buffers, snap):
                t.copy_(s)
        return out, kv
    finally:
        for row in rows:
            pool.free_req(row)


def test_reference_step_matches_the_general_path(runner):
    want, want_kv = run_step(runner, None)
    got, got_kv = run_step(runner, ReferenceStep(binding(runner)))
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for a, b in zip(got_kv, want_kv):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def _perturbed(stage: str, calls: list[str]) -> type[ReferenceStep]:
    """A ReferenceStep whose ``stage`` calls the reference's and scales its result by 1.5 (and counts calls)."""

    def override(self, *args):  # type: ignore[no-untyped-def]
        calls.append(stage)
        out = getattr(ReferenceStep, stage)(self, *args)
        if stage == "qkv_rope_store":
            return out * 1.5  # q only: the stored K/V stay the reference's
        if stage == "add_norm":
            return out[0], out[1] * 1.5
        return out * 1.5

    return type(f"Perturbed_{stage}", (ReferenceStep,), {stage: override})


@pytest.mark.parametrize("stage", STAGES)
def test_every_stage_is_on_the_path(runner, stage):
    """Overriding any one stage changes the step (or the stage does not apply to this model: moe/mlp)."""
    moe = any(lp.is_moe for lp in bind_params(binding(runner)).layers)
    dense = any(not lp.is_moe for lp in bind_params(binding(runner)).layers)
    if (stage == "moe" and not moe) or (stage == "mlp" and not dense):
        pytest.skip(f"{runner.config.model} has no {stage} layer")
    if stage == "sample":  # only a DECODE step that wants ids reaches it (plugin API 3)
        return _sample_stage_is_on_the_path(runner)
    calls: list[str] = []
    base, _ = run_step(runner, ReferenceStep(binding(runner)))
    got, _ = run_step(runner, _perturbed(stage, calls)(binding(runner)))
    assert calls, f"stage {stage} was never called"
    assert not torch.allclose(got, base), f"scaling stage {stage}'s output did not change the logits"


def _sample_stage_is_on_the_path(r: ModelRunner) -> None:
    """A DECODE step that wants greedy ids calls ``sample`` once, and its ids are the general path's argmax."""
    from lowlat.runtime.sampling import SamplingParams
    from lowlat.runtime.sampling_inputs import SamplingInputs

    calls: list[torch.Size] = []

    class CountingSample(ReferenceStep):
        def sample(self, logits, info):  # type: ignore[no-untyped-def]
            calls.append(logits.shape)
            return super().sample(logits, info)

    pool = r.kv_pool
    rows = [pool.alloc_req() for _ in range(2)]
    try:
        with torch.inference_mode():
            r.forward(r.prepare_batch(ForwardMode.PREFILL, rows, [0, 0], [[3, 4, 5, 6], [7, 8]]))
            batch = r.prepare_batch(ForwardMode.DECODE, rows, [4, 2], [[9], [12]])
            want = r.general_forward(batch).argmax(dim=-1)
            si = SamplingInputs(device=r.device, max_rows=2, vocab=r.model_config.vocab_size)
            batch.sampling = si.fill([SamplingParams(), SamplingParams()], [1, 2], [4, 2])
            batch.logits_required = False
            ids = CountingSample(binding(r)).forward(batch)
    finally:
        for row in rows:
            pool.free_req(row)
    assert len(calls) == 1, f"stage sample was called {len(calls)} times"
    assert ids.dtype == torch.int64 and torch.equal(ids, want), (ids, want)


def test_a_one_stage_plugin_overrides_only_that_stage(runner):
    """norm runs once per layer norm plus the final norm: 2 L + 1 calls per step, all through the override."""
    seen: list[tuple[int, ...]] = []

    class CountingNorm(ReferenceStep):
        def norm(self, x, weight):  # type: ignore[no-untyped-def]
            seen.append(tuple(x.shape))
            return super().norm(x, weight)

    base, base_kv = run_step(runner, ReferenceStep(binding(runner)))
    got, got_kv = run_step(runner, CountingNorm(binding(runner)))
    assert len(seen) == 2 * runner.model_config.num_hidden_layers + 1
    assert all(len(s) == 2 for s in seen), "norm receives 2-D [T, H] inputs"
    assert torch.equal(got, base) and all(torch.equal(a, b) for a, b in zip(got_kv, base_kv))


def test_bind_params_names_a_missing_parameter(runner):
    params = dict(runner.model.named_parameters(remove_duplicate=False))
    del params["model.layers.1.post_attention_layernorm.weight"]
    with pytest.raises(PluginBuildError, match="model.layers.1.post_attention_layernorm.weight"):
        bind_params(binding(runner, params))


def test_bind_params_names_a_misshapen_parameter(runner):
    params = dict(runner.model.named_parameters(remove_duplicate=False))
    params["model.norm.weight"] = params["model.norm.weight"][:-1]
    with pytest.raises(PluginBuildError, match=r"model.norm.weight has shape"):
        bind_params(binding(runner, params))


def test_layer_params_are_the_loaded_tensors(runner):
    """No copies: the binder's tensors share storage with the general model's parameters."""
    b = binding(runner)
    mp = bind_params(b)
    assert mp.layers[0].qkv.data_ptr() == b.params["model.layers.0.self_attn.qkv_proj.weight"].data_ptr()
    assert mp.final_norm.data_ptr() == b.params["model.norm.weight"].data_ptr()
