"""Speculative decoding in the engine loop: greedy output equals plain decoding token for token for every drafter,
at batch 1 and 4, on the general path and with the contract suite's reference plugin; KV pages come back
(CPU, tiny presets; each engine starts in about a second)."""

from __future__ import annotations

import dataclasses

import pytest
from lowlat.config import ConfigError, EngineConfig
from lowlat.runtime import Engine, ForwardMode, SamplingParams

# Repetitive and plain prompts: the n-gram drafter finds matches in some, none in others.
PROMPTS = [[1, 2, 3, 4, 1, 2, 3], [9, 8, 7], [5, 5, 5, 5, 5, 5], [100, 200, 300, 100, 200, 7, 8, 9, 10]]
LENGTHS = [23, 17, 30, 12]  # different ends: requests leave the batch at different steps
DRAFTERS = ["ngram", "draft:tiny-qwen3", "draft:tiny-llama"]  # tiny-llama drafting itself: every draft kept
KW = dict(model="tiny-llama", device="cpu", dtype="float32", max_context_len=96, max_batch_size=4, page_size=4)


def params(batch: int) -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=n, stop_at_eos=False) for n in LENGTHS[:batch]]


@pytest.fixture(scope="module")
def plain() -> dict[tuple[str, int], list[list[int]]]:
    """Plain greedy decoding (no speculation) per (plugin, batch)."""
    out = {}
    with Engine(EngineConfig(plugin="none", **KW)) as e:
        for b in (1, 4):
            out[b] = [c.token_ids for c in e.generate(PROMPTS[:b], params(b))]
    return out


def run_spec(method: str, batch: int, plugin: str = "none", **kw):
    with Engine(EngineConfig(plugin=plugin, speculative_method=method, speculative_adaptive=False, **KW, **kw)) as e:
        pool = e.runner.kv_pool
        free = pool.free_pages, pool.free_rows
        modes = []
        drafter = e.speculator.drafter
        if hasattr(drafter, "runner"):  # record the draft model's step modes
            forward = drafter.runner.forward
            drafter.runner.forward = lambda b: (modes.append(b.forward_mode), forward(b))[1]
        got = [c.token_ids for c in e.generate(PROMPTS[:batch], params(batch))]
        if modes:  # prompts by PREFILL, the steady state by 2-row VERIFY steps and k - 1 DECODE steps each
            assert {ForwardMode.PREFILL, ForwardMode.VERIFY, ForwardMode.DECODE} == set(modes)
            assert modes.count(ForwardMode.DECODE) >= modes.count(ForwardMode.VERIFY)
        assert (pool.free_pages, pool.free_rows) == free  # rolled-back and finished requests leak no page
        if hasattr(drafter, "runner"):  # the draft model's own pool too
            dpool = drafter.runner.kv_pool
            assert dpool.free_pages == drafter.initial_free_pages and not drafter.states
        return got, e.speculator.as_dict(e), e.stats.paths_as_dict()


@pytest.mark.parametrize("method", DRAFTERS)
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_identity_general_path(plain, method, batch):
    got, spec, paths = run_spec(method, batch)
    assert got == plain[batch]
    assert spec["verify_steps"] > 0 and paths["general"]["VERIFY"]["steps"] == spec["verify_steps"]
    # k stays 5 to the end: requests near max_new_tokens verify 6 rows too (Scheduler.slack promises their KV)
    assert paths["general"]["VERIFY"]["tokens"] == 6 * spec["request_steps"]
    if method == "draft:tiny-llama":  # the target drafting itself: every draft is kept
        assert spec["accepted"] == spec["drafted"] and spec["acceptance_length"] == 6.0


@pytest.mark.parametrize("method", DRAFTERS)
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_identity_reference_plugin(plain, reference_plugin, method, batch):
    got, spec, paths = run_spec(method, batch, plugin=reference_plugin)
    assert got == plain[batch]
    by_path = spec["verify_steps_by_path"]  # the plugin covers 16 tokens a step: 4 x 6 rows go to the general path
    assert by_path["plugin"] > 0 and sum(by_path.values()) == spec["verify_steps"]
    assert paths["plugin"]["VERIFY"]["steps"] == by_path["plugin"]


def test_ngram_prompt_lookup_keeps_drafts_on_repetitive_text(plain):
    got, spec, _ = run_spec("ngram", 4)
    assert got == plain[4] and spec["accepted"] > 0
    assert sum(spec["accept_hist"]) == spec["emitted"] - spec["accepted"]  # one histogram entry per request-step


def test_eos_inside_accepted_drafts_stops_there():
    eos_prompt = [3, 3, 3, 3]
    with Engine(EngineConfig(plugin="none", **KW)) as e:
        full = e.generate([eos_prompt], SamplingParams(max_new_tokens=20, stop_at_eos=False))[0].token_ids
    stop = full[5]  # pretend the 6th token is EOS: generation must end right there, even mid-VERIFY
    with Engine(EngineConfig(plugin="none", speculative_method="draft:tiny-llama", speculative_adaptive=False,
                             **KW)) as e:
        e.eos_ids = frozenset({stop})  # requests take the engine's EOS ids when added
        c = e.generate([eos_prompt], SamplingParams(max_new_tokens=20))[0]
        assert c.token_ids == full[:full.index(stop) + 1] and c.finish_reason == "eos"


def test_config_validation():
    with pytest.raises(ConfigError, match="not one of"):
        EngineConfig(speculative_method="medusa")
    with pytest.raises(ConfigError, match="max_verify_tokens"):
        EngineConfig(speculative_method="ngram", num_draft_tokens=8)
    with pytest.raises(ConfigError, match="longest possible"):
        EngineConfig(speculative_method="simulated:7", num_draft_tokens=4)
    c = EngineConfig(speculative=True, max_verify_tokens=3)
    assert c.speculative_spec.kind == "ngram" and c.draft_tokens == 2
    off = dataclasses.replace(c, speculative=False)  # the contract suite turns the feature off like this
    assert not off.speculative and off.speculative_spec is None
    assert EngineConfig(speculative_method="draft:/x").speculative and EngineConfig().draft_tokens == 5


def test_step_api_and_verify_api_still_work_with_speculation():
    with Engine(EngineConfig(plugin="none", speculative_method="ngram", speculative_adaptive=False, **KW)) as e:
        rid = e.add_request(PROMPTS[0], SamplingParams(max_new_tokens=12, stop_at_eos=False))
        done = []
        while e.has_unfinished():
            done += e.step()
        assert [c.request_id for c in done] == [rid]
        assert e.stats.by_mode[ForwardMode.VERIFY].steps == e.speculator.stats.verify_steps > 0


def test_a_failing_drafter_fails_the_engine_cleanly():
    with Engine(EngineConfig(plugin="none", speculative_method="ngram", speculative_adaptive=False, **KW)) as e:
        pool = e.runner.kv_pool
        free = pool.free_pages

        def boom(requests, k):
            raise RuntimeError("drafter exploded")

        e.speculator.drafter.propose = boom
        with pytest.raises(RuntimeError, match="drafter exploded"):
            e.generate(PROMPTS[:2], params(2))
        assert pool.free_pages == free and not e.has_unfinished()
        with pytest.raises(RuntimeError, match="failed in an earlier step"):
            e.generate(PROMPTS[:1], params(1))


@pytest.mark.parametrize("method", ["ngram", "draft:tiny-qwen3"])
def test_greedy_requests_in_a_sampled_batch_stay_exact(plain, method):
    """A batch mixing greedy and sampled requests takes rejection sampling; its greedy rows are point masses."""
    mixed = [SamplingParams(max_new_tokens=LENGTHS[i], stop_at_eos=False,
                            temperature=0.0 if i % 2 == 0 else 0.9, seed=i) for i in range(4)]
    with Engine(EngineConfig(plugin="none", speculative_method=method, speculative_adaptive=False, **KW)) as e:
        free = e.runner.kv_pool.free_pages
        got = [c.token_ids for c in e.generate(PROMPTS, mixed)]
        assert e.runner.kv_pool.free_pages == free and e.speculator.stats.verify_steps > 0
    assert got[0] == plain[4][0] and got[2] == plain[4][2]
    assert [len(t) for t in got] == LENGTHS


def test_draft_rows_of_requests_that_left_unannounced_are_reused():
    """A request that leaves without a completion (an abort) must not keep its draft row from a newcomer."""
    kw = {**KW, "max_batch_size": 1}
    with Engine(EngineConfig(plugin="none", speculative_method="draft:tiny-qwen3", speculative_adaptive=False,
                             **kw)) as e:
        drafter = e.speculator.drafter
        a = e.add_request(PROMPTS[0], SamplingParams(max_new_tokens=20, stop_at_eos=False))
        for _ in range(3):
            e.step()
        assert a in drafter.states
        (req,) = e.scheduler.running
        e.scheduler._finish(req, 0.0)  # what an abort does: the request leaves, no Completion
        b = e.add_request(PROMPTS[1], SamplingParams(max_new_tokens=12, stop_at_eos=False))
        while e.has_unfinished():
            e.step()
        assert a not in drafter.states and b not in drafter.states
        assert drafter.pool.free_pages == drafter.initial_free_pages


@pytest.mark.parametrize("method", ["ngram", "draft:tiny-qwen3", "draft:tiny-llama"])
def test_continuous_batching_and_chunked_prefill_stay_exact(method):
    """More requests than rows, prompts prefilled in chunks: requests join a speculating batch mid-way."""
    prompts = [PROMPTS[i % 4] * (1 + i % 3) for i in range(6)]
    ps = [SamplingParams(max_new_tokens=9 + 3 * i, stop_at_eos=False) for i in range(6)]
    kw = {**KW, "max_batch_size": 2, "chunked_prefill_size": 5}
    with Engine(EngineConfig(plugin="none", **kw)) as e:
        want = [c.token_ids for c in e.generate(prompts, ps)]
    with Engine(EngineConfig(plugin="none", speculative_method=method, speculative_adaptive=False, **kw)) as e:
        free = e.runner.kv_pool.free_pages
        assert [c.token_ids for c in e.generate(prompts, ps)] == want
        assert e.runner.kv_pool.free_pages == free and e.speculator.stats.verify_steps > 0
        drafter = e.speculator.drafter
        if hasattr(drafter, "runner"):
            assert not drafter.states and drafter.pool.free_pages == drafter.initial_free_pages
