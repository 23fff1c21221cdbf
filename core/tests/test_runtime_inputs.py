"""Bad inputs raise clear errors before anything runs; a failed start leaves nothing behind."""

from __future__ import annotations

import pytest
import torch
from lowlat.config import ConfigError, EngineConfig
from lowlat.runtime import Engine, ModelRunner, SamplingParams


@pytest.fixture(scope="module")
def engine():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    e = Engine(EngineConfig(model="tiny-llama", device="cpu", max_context_len=32, max_batch_size=2))
    yield e
    e.close()
    torch.set_num_threads(n)


@pytest.mark.parametrize("prompts, exc, msg", [
    ([[1, 2, 512]], ValueError, r"prompt 0 has token id 512 outside the vocabulary \[0, 512\)"),
    ([[3], [-1]], ValueError, "prompt 1 has token id -1 outside"),
    ([[]], ValueError, "prompt 0 is empty"),
    ([""], ValueError, "prompt 0 is empty"),
    ([list(range(30))], ValueError, "prompt 0 has 30 tokens; with max_new_tokens=4 that exceeds max_context_len=32"),
    ("just a string", TypeError, "list of strings"),
    ([[1, 2.5]], TypeError, "prompt 0 must be a string or a list of int"),
    ([], ValueError, "no prompts"),
])
def test_bad_prompts_raise_before_anything_runs(engine, prompts, exc, msg):
    steps = engine.stats.total_steps
    with pytest.raises(exc, match=msg):
        engine.generate(prompts, SamplingParams(max_new_tokens=4))
    assert not engine.has_unfinished() and engine.stats.total_steps == steps
    assert engine.runner.kv_pool.free_rows == engine.runner.kv_pool.max_reqs - 1


def test_params_must_match_prompts(engine):
    with pytest.raises(TypeError, match="one per prompt"):
        engine.generate([[1], [2]], [SamplingParams()])


def test_generate_needs_an_idle_engine(engine):
    engine.add_request([1, 2], SamplingParams(max_new_tokens=2))
    try:
        with pytest.raises(RuntimeError, match="add_request"):
            engine.generate([[1]])
    finally:
        while engine.has_unfinished():
            engine.step()
    assert engine.generate([[1]], SamplingParams(max_new_tokens=2))[0].token_ids  # still usable


def test_unknown_model_and_bad_config():
    with pytest.raises(ConfigError, match="neither a directory"):
        Engine(EngineConfig(model="no-such-model", device="cpu"))
    with pytest.raises(ConfigError, match="max_batch_size"):
        EngineConfig(max_batch_size=0)


def test_failed_start_frees_everything(monkeypatch):
    seen = []

    def boom(self):
        seen.append(self)
        raise RuntimeError("KV sizing failed")

    monkeypatch.setattr(ModelRunner, "init_kv_pool", boom)
    with pytest.raises(RuntimeError, match="KV sizing failed"):
        Engine(EngineConfig(model="tiny-llama", device="cpu", max_context_len=32))
    (runner,) = seen
    assert runner.model is None and runner.kv_pool is None and runner.graph_runner is None


def test_closed_engine_refuses_work():
    e = Engine(EngineConfig(model="tiny-llama", device="cpu", max_context_len=32, max_batch_size=1))
    e.close()
    e.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        e.generate([[1]])
