"""Speculative decoding with tensor parallelism on CPU: two spawned gloo ranks, every drafter, the general path and
the reference plugin, give plain TP-1 greedy decoding's tokens; the adaptive switch agrees over the ranks."""

from __future__ import annotations

import pytest
import torch
from lowlat.config import EngineConfig
from lowlat.runtime import Engine, SamplingParams
from plugin_dists import activate

PROMPTS = [[1, 2, 3, 4, 1, 2, 3], [9, 8, 7], [5, 5, 5, 5, 5, 5], [100, 200, 300, 100, 200, 7, 8, 9, 10]]
PARAMS = [SamplingParams(max_new_tokens=n, stop_at_eos=False) for n in (14, 9, 16, 7)]
KW = dict(model="tiny-qwen3", device="cpu", dtype="float32", max_context_len=64, max_batch_size=4, page_size=4)


@pytest.fixture(scope="module")
def plain():
    with Engine(EngineConfig(plugin="none", **KW)) as e:
        return {b: [c.token_ids for c in e.generate(PROMPTS[:b], PARAMS[:b])] for b in (1, 4)}


@pytest.fixture
def tp_env(tmp_path, monkeypatch):
    from lowlat_contract.fixtures import install_fixture_plugins

    monkeypatch.setenv("LOWLAT_TP_TIMEOUT", "60")
    site = tmp_path / "site"
    install_fixture_plugins(site, ["reference"])
    activate(site, monkeypatch)
    monkeypatch.setenv("PYTHONPATH", str(site))  # the spawned ranks discover the plugin too
    monkeypatch.setenv("LOWLAT_PLUGINS", "reference")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize(("method", "plugin", "adaptive"), [
    ("ngram", "none", True), ("ngram", "reference", False), ("draft:tiny-llama", "none", False),
    ("draft:tiny-qwen3", "reference", False), ("simulated:3", "none", True)])
def test_tp2_speculative_greedy_equals_plain(plain, tp_env, method, plugin, adaptive):
    cfg = EngineConfig(tp_size=2, plugin=plugin, speculative_method=method, speculative_adaptive=adaptive, **KW)
    with Engine(cfg) as e:
        pool = e.runner.kv_pool
        free = pool.free_pages
        for b in (1, 4):
            got = [c.token_ids for c in e.generate(PROMPTS[:b], PARAMS[:b])]
            if not method.startswith("simulated"):  # simulated text is not the model's: only the cost is real
                assert got == plain[b]
            assert pool.free_pages == free
        spec = e.speculator.as_dict(e)
        assert spec["verify_steps"] > 0
        if plugin != "none":
            assert spec["verify_steps_by_path"].get("plugin", 0) > 0
