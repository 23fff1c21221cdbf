"""The hf peer: skipped with a reason on a CPU; its model, static cache and steps checked eagerly at tiny shapes."""

from __future__ import annotations

import functools

import pytest
import torch
from lowlat.bench import peers
from lowlat.bench.config import BenchConfig, Shape
from lowlat.bench.lowlat_path import engine_config
from lowlat.bench.measure import Measurement
from lowlat.forward_batch import ForwardMode
from lowlat.loader.presets import get_preset

pytest.importorskip("transformers")

CPU = torch.device("cpu")
D1, D2, D4 = (Shape(ForwardMode.DECODE, b, 1) for b in (1, 2, 4))
V1 = Shape(ForwardMode.VERIFY, 1, 3)


def _cfg(**kw: object) -> BenchConfig:
    base = dict(batch_sizes=(1, 2), verify_tokens=3, context=12, input_sets=2, warmup=0, iters=2, copy_bytes=1 << 20)
    base.update(kw)
    return BenchConfig.with_defaults("cpu", **base)


def test_skipped_with_a_reason_on_cpu():
    reason = peers.unavailable_reason(CPU)
    assert reason is not None and "CUDA" in reason
    res = peers.run_hf_path(_cfg(), "tiny-llama", get_preset("tiny-llama"), [D1, V1], (2, 1), CPU,
                            want_routing=False, log=lambda line: None)
    assert set(res) == {2, 1}
    assert all(res[d].rows[s] == reason for d in (2, 1) for s in (D1, V1))


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3-moe"])
def test_static_cache_steps_eagerly(preset):
    mc = get_preset(preset)
    peer = peers.HFPeer(mc, num_layers=2, device=CPU, dtype=torch.bfloat16, seed=0)
    assert peer.config.num_hidden_layers == 2 and peer.config.vocab_size == mc.vocab_size
    assert type(peer.model).__name__ == mc.architecture
    assert all(p.dtype == torch.bfloat16 for p in peer.model.parameters())
    for shape in (D2, V1):
        step = peers.HFStep(peer, shape, context=12, input_sets=2, seed=1, compile=False)
        kv = peers.cache_tensors(step.cache)
        assert len(kv) == 4 and kv[0].shape[0] == shape.batch_size and kv[0].shape[2] == 12 + shape.tokens_per_req
        assert float(kv[0].float().std()) > 0.5  # random K/V, not zeros
        with torch.no_grad():
            for i in range(3):  # repeated steps stay at positions 12..12+t (the cache length is reset)
                step.before(i)
                logits = step.run(i)
                assert logits.shape == (shape.batch_size, shape.tokens_per_req, mc.vocab_size)
                assert torch.isfinite(logits.float()).all()
        for layer in getattr(step.cache, "layers", []):
            if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor):
                assert int(layer.cumulative_length) == 12 + shape.tokens_per_req
        if mc.is_moe:
            union = peers.hf_routing(step)
            k = mc.num_experts_per_tok
            assert len(union) == 2 and all(k <= u <= min(mc.num_experts, k * shape.num_tokens) for u in union)
        step.close()


def test_plan_order_and_batch_filters():
    cfg = _cfg(batch_sizes=(1, 2, 4), hf_layer_batch_sizes=(1, 2))
    plan = peers.hf_plan(cfg, [D1, D2, D4, V1], (2, 1), 2)
    assert plan == [(1, D1), (1, D2), (2, D1), (2, V1), (2, D4), (2, D2)]
    narrowed = peers.hf_plan(_cfg(batch_sizes=(1, 2, 4), hf_batch_sizes=(4,)), [D1, D2, D4, V1], None, 2)
    assert narrowed == [(2, D4), (2, V1)]


def _eager_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let run_hf_path run on a CPU without torch.compile (the GPU path's control flow, eagerly)."""
    monkeypatch.setattr(peers, "unavailable_reason", lambda device: None)
    monkeypatch.setattr(peers, "HFStep", functools.partial(peers.HFStep, compile=False))


def test_run_hf_path_measures_rows_and_routing(monkeypatch):
    _eager_peer(monkeypatch)
    mc = get_preset("tiny-qwen3-moe")
    cfg = _cfg(batch_sizes=(1, 2), hf_batch_sizes=(1,))
    lines: list[str] = []
    res = peers.run_hf_path(cfg, "tiny-qwen3-moe", mc, [D1, D2, V1], (2, 1), CPU, want_routing=True,
                            log=lines.append)
    full, half = res[2], res[1]
    for shape in (D1, V1):
        m = full.rows[shape]
        assert isinstance(m, Measurement) and m.ran_on == "hf" and m.step.n == 2 and m.compile_s is not None
        assert m.launches is not None and m.launches > 0
    assert "not in --hf-batch-sizes" in full.rows[D2]
    assert isinstance(half.rows[D1], Measurement) and "--hf-layer-batch-sizes" in half.rows[V1]
    assert set(full.routing) == {D1, V1} and full.routing[D1] == [2.0, 2.0]
    assert full.routing_source.startswith("transformers model")
    assert any("transformers model built" in line for line in lines)


def test_run_hf_path_respects_its_time_budget(monkeypatch):
    _eager_peer(monkeypatch)
    res = peers.run_hf_path(_cfg(hf_budget_s=0.0), "tiny-llama", get_preset("tiny-llama"), [D1, V1], None, CPU,
                            want_routing=False, log=lambda line: None)
    assert all("hf time budget" in res[2].rows[s] for s in (D1, V1))


def test_engine_config_of_a_lowlat_path():
    cfg = _cfg(batch_sizes=(1, 8), input_sets=4, context=100)
    ec = engine_config(cfg, "tiny-llama", "general", None)
    assert ec.plugin == "none" and ec.max_batch_size == 32 and ec.max_context_len == 103
    assert ec.max_verify_tokens == 3 and ec.num_layers is None and ec.dtype == "bfloat16" and ec.cuda_graph
    ep = engine_config(cfg, "tiny-llama", "nvidia_mega", 1)
    assert ep.plugin == "nvidia_mega" and ep.num_layers == 1
    decode_only = engine_config(_cfg(modes=(ForwardMode.DECODE,)), "tiny-llama", "general", None)
    assert decode_only.max_verify_tokens == 1 and decode_only.max_context_len == 13
