"""VERIFY steps: through the ModelRunner they equal k+1 DECODE steps; through Engine.verify they keep greedy
decoding exact and the KV cache consistent (CPU, tiny presets)."""

from __future__ import annotations

import pytest
import torch
from lowlat.config import EngineConfig
from lowlat.runtime import Engine, ForwardMode, SamplingParams


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen3"])
def engine(request):
    e = Engine(EngineConfig(model=request.param, device="cpu", max_context_len=64, max_batch_size=4, page_size=4,
                            max_verify_tokens=5))
    yield e
    e.close()


def test_runner_verify_equals_decode_steps(engine):
    runner = engine.runner
    pool = runner.kv_pool
    prompts = [[5, 6, 7, 8, 9, 10, 11], [200, 3, 44]]
    feeds = [[12, 13, 14, 15], [45, 46, 47, 48]]  # pending token + 3 drafts per request
    rows_v = [pool.alloc_req() for _ in prompts]
    rows_d = [pool.alloc_req() for _ in prompts]
    try:
        for rows in (rows_v, rows_d):
            runner.forward(runner.prepare_batch(ForwardMode.PREFILL, rows, [0, 0], prompts))
        lens = [len(p) for p in prompts]
        verify = runner.forward(runner.prepare_batch(ForwardMode.VERIFY, rows_v, lens, feeds))
        assert verify.dtype == torch.float32 and verify.shape == (8, runner.model_config.vocab_size)
        decode = []
        for j in range(4):
            batch = runner.prepare_batch(ForwardMode.DECODE, rows_d, [n + j for n in lens], [[f[j]] for f in feeds])
            decode.append(runner.forward(batch))
        expect = torch.stack(decode, dim=1).reshape(8, -1)  # request-major, like the VERIFY rows
        torch.testing.assert_close(verify, expect, rtol=1e-4, atol=1e-4)
        for layer in range(pool.num_layers):  # the same K/V landed in both requests' slots
            sv = [pool.slots_of(r, n + 4) for r, n in zip(rows_v, lens)]
            sd = [pool.slots_of(r, n + 4) for r, n in zip(rows_d, lens)]
            for a, b in zip(sv, sd):
                torch.testing.assert_close(pool.k_buffers[layer][a], pool.k_buffers[layer][b], rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(pool.v_buffers[layer][a], pool.v_buffers[layer][b], rtol=1e-5, atol=1e-5)
    finally:
        for r in rows_v + rows_d:
            pool.free_req(r)


def _start(engine, prompt, n):
    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=n, stop_at_eos=False))
    engine.step()  # PREFILL: first token
    return rid


def _finish(engine):
    done = []
    while engine.has_unfinished():
        done += engine.step()
    return done


def test_engine_verify_accepts_the_greedy_continuation(engine):
    prompts = [[1, 2, 3, 4], [90, 91]]
    full = [c.token_ids for c in engine.generate(prompts, SamplingParams(max_new_tokens=10, stop_at_eos=False))]
    engine.stats.reset()
    rids = [_start(engine, p, 10) for p in prompts]  # two PREFILL steps
    res = engine.verify({r: f[1:4] for r, f in zip(rids, full)})
    assert res.accepted == {r: f[1:5] for r, f in zip(rids, full)} and res.finished == []
    done = {c.request_id: c.token_ids for c in _finish(engine)}
    assert [done[r] for r in rids] == full
    verify = engine.stats.by_mode[ForwardMode.VERIFY]
    assert verify.steps == 1 and verify.tokens == 8


def test_engine_verify_rejects_wrong_drafts_and_truncates_kv(engine):
    prompt = [7, 7, 8, 9, 10]
    full = engine.generate([prompt], SamplingParams(max_new_tokens=9, stop_at_eos=False))[0].token_ids
    pool = engine.runner.kv_pool
    free = pool.free_pages
    rid = _start(engine, prompt, 9)
    wrong = (full[2] + 1) % 256
    res = engine.verify({rid: [full[1], wrong, 0, 0]})
    assert res.accepted == {rid: full[1:3]}  # one draft kept, then the model's own pick
    (req,) = engine.scheduler.running
    assert req.num_computed == len(prompt) + 2
    assert pool.free_pages == free - -(-(len(prompt) + 2) // pool.page_size)  # pages past the kept tokens freed
    assert [c.token_ids for c in _finish(engine)] == [full]


def test_verify_finishes_requests_at_max_new_tokens(engine):
    prompt = [3, 1, 4, 1, 5]
    full = engine.generate([prompt], SamplingParams(max_new_tokens=4, stop_at_eos=False))[0].token_ids
    rid = _start(engine, prompt, 4)
    res = engine.verify({rid: full[1:3]})
    assert res.accepted == {rid: full[1:4]}
    assert [c.token_ids for c in res.finished] == [full] and not engine.has_unfinished()


def test_verify_rejects_bad_requests(engine):
    rid = _start(engine, [1, 2, 3], 5)
    try:
        with pytest.raises(ValueError, match="max_verify_tokens"):
            engine.verify({rid: [1, 2, 3, 4, 5]})
        with pytest.raises(ValueError, match="not decoding"):
            engine.verify({rid + 100: [1]})
        with pytest.raises(ValueError, match="max_new_tokens"):
            engine.verify({rid: [1, 2, 3, 4]})
        with pytest.raises(ValueError, match="outside the vocabulary"):
            engine.verify({rid: [1, 10**6]})
        with pytest.raises(ValueError, match="at least one"):
            engine.verify({})
        assert engine.scheduler.running[0].num_computed == 3  # nothing ran
    finally:
        _finish(engine)
