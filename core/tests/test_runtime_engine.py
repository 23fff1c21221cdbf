"""Engine.generate against a hand-written step loop over model.forward, continuous batching, chunked prefill,
seeded sampling, KV bookkeeping and step statistics (CPU, tiny presets)."""

from __future__ import annotations

import pytest
import torch
from lowlat.config import EngineConfig
from lowlat.loader import open_weights, resolve_model
from lowlat.models import build_model
from lowlat.runtime import Engine, ForwardBatch, ForwardMode, KVPool, SamplingParams

CTX = 96


def make_engine(model: str = "tiny-llama", **kw) -> Engine:
    kw = {"device": "cpu", "max_context_len": CTX, "max_batch_size": 4, "page_size": 4, **kw}
    return Engine(EngineConfig(model=model, **kw))


@pytest.fixture(scope="module")
def engine():
    e = make_engine()
    yield e
    e.close()


def manual_greedy(model_name: str, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding by hand: one PREFILL of the whole prompt, then DECODE steps, straight on model.forward."""
    cfg = resolve_model(model_name)
    model = build_model(cfg, dtype=torch.float32, device="cpu", max_context_len=CTX)
    _, weights = open_weights(model_name, cfg, seed=0, dtype=torch.float32, device="cpu")
    model.load_weights(weights)
    pool = KVPool(num_layers=cfg.num_hidden_layers, num_pages=CTX // 8 + 2, page_size=8,
                  num_kv_heads=model.local_kv_heads, head_dim=cfg.head_dim, dtype=torch.float32, device="cpu",
                  max_reqs=1, max_context_len=CTX)
    row = pool.alloc_req()
    batch = ForwardBatch.build(ForwardMode.PREFILL, prompt, [0], [len(prompt)], [row],
                               pool.alloc_slots(row, len(prompt)), "cpu")
    out = [int(model(batch, pool)[0].argmax())]
    while len(out) < n:
        cached = len(prompt) + len(out) - 1
        batch = ForwardBatch.build(ForwardMode.DECODE, [out[-1]], [cached], [1], [row],
                                   pool.alloc_slots(row, cached + 1), "cpu")
        out.append(int(model(batch, pool)[0].argmax()))
    return out


PROMPTS = [list(range(1, 12)), [300, 5, 17], list(range(40, 70)), [9], list(range(100, 119))]


@pytest.mark.parametrize("model_name", ["tiny-llama", "tiny-qwen3-moe"])
def test_greedy_generate_equals_manual_loop(model_name):
    with make_engine(model_name) as e:
        got = e.generate(PROMPTS[:2], SamplingParams(max_new_tokens=7, stop_at_eos=False))
    for prompt, c in zip(PROMPTS[:2], got):
        assert c.token_ids == manual_greedy(model_name, prompt, 7)
        assert c.prompt_token_ids == prompt and c.finish_reason == "length"


def test_continuous_batching_equals_each_alone(engine):
    params = [SamplingParams(max_new_tokens=n, stop_at_eos=False) for n in (9, 3, 6, 12, 4)]
    alone = [engine.generate([p], sp)[0].token_ids for p, sp in zip(PROMPTS, params)]
    with make_engine(max_batch_size=2) as small:  # 5 requests through 2 slots: they join and leave
        together = small.generate(PROMPTS, params)
        assert small.stats.by_mode[ForwardMode.PREFILL].steps >= 3
    assert [c.token_ids for c in together] == alone
    assert [len(c.token_ids) for c in together] == [9, 3, 6, 12, 4]


def test_chunked_prefill_equals_unchunked(engine):
    params = SamplingParams(max_new_tokens=5, stop_at_eos=False)
    whole = [c.token_ids for c in engine.generate(PROMPTS, params)]
    with make_engine(chunked_prefill_size=7) as chunked:
        got = [c.token_ids for c in chunked.generate(PROMPTS, params)]
        prefill = chunked.stats.by_mode[ForwardMode.PREFILL]
        assert prefill.steps >= sum(len(p) for p in PROMPTS) // 7
        assert prefill.tokens == sum(len(p) for p in PROMPTS)
    assert got == whole


def test_seeded_sampling_is_reproducible(engine):
    def run(seed, top_k=0, top_p=1.0):
        sp = SamplingParams(max_new_tokens=10, temperature=1.0, top_k=top_k, top_p=top_p, seed=seed,
                            stop_at_eos=False)
        return [c.token_ids for c in engine.generate(PROMPTS[:3], sp)]

    assert run(11) == run(11)
    assert run(11) != run(12)
    assert run(5, top_k=20, top_p=0.9) == run(5, top_k=20, top_p=0.9)
    # a seeded request gives the same tokens alone and batched with others
    sp = SamplingParams(max_new_tokens=10, temperature=0.7, seed=3, stop_at_eos=False)
    alone = engine.generate([PROMPTS[1]], sp)[0].token_ids
    mixed = engine.generate([PROMPTS[0], PROMPTS[1]], [SamplingParams(max_new_tokens=4), sp])[1].token_ids
    assert alone == mixed


def test_kv_pool_is_free_after_generate(engine):
    pool = engine.runner.kv_pool
    pages, rows = pool.free_pages, pool.free_rows
    assert pages == pool.num_slots // pool.page_size - 1 and rows == pool.max_reqs - 1  # page 0, dummy row
    engine.generate(PROMPTS, SamplingParams(max_new_tokens=6))
    assert (pool.free_pages, pool.free_rows) == (pages, rows)
    assert not engine.has_unfinished()


def test_eos_stops_and_is_kept(engine):
    first = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=6, stop_at_eos=False))[0].token_ids
    eos = engine.eos_ids
    try:
        engine.eos_ids = frozenset({first[2]})
        c = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=6))[0]
        ignore = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=6, stop_at_eos=False))[0]
    finally:
        engine.eos_ids = eos
    stop = first.index(first[2])
    assert c.token_ids == first[:stop + 1] and c.finish_reason == "eos"
    assert ignore.token_ids == first


def test_step_api_and_stats(engine):
    engine.stats.reset()
    a = engine.add_request(PROMPTS[0], SamplingParams(max_new_tokens=3, stop_at_eos=False))
    b = engine.add_request("hello", SamplingParams(max_new_tokens=5, stop_at_eos=False))
    done = {}
    steps = 0
    while engine.has_unfinished():
        for c in engine.step():
            done[c.request_id] = c
        steps += 1
    assert engine.step() == []
    assert sorted(done) == [a, b] and len(done[b].token_ids) == 5
    assert done[b].prompt_token_ids == engine.tokenizer.encode("hello")
    s = engine.stats.by_mode
    assert s[ForwardMode.PREFILL].steps == 1 and s[ForwardMode.DECODE].steps == 4 == steps - 1
    assert s[ForwardMode.DECODE].tokens == 2 + 2 + 1 + 1
    assert engine.stats.total_steps == steps and s[ForwardMode.DECODE].ms_per_step > 0
    for c in done.values():
        assert c.prefill_s > 0 and c.decode_s > 0 and c.decode_tokens_per_s > 0 and c.queue_s >= 0


def test_text_prompts_round_trip(engine):
    c = engine.generate(["The quick brown fox"], SamplingParams(max_new_tokens=4))[0]
    assert c.prompt_token_ids == list(b"The quick brown fox")
    assert c.text == engine.tokenizer.decode(c.token_ids)
