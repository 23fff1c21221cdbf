"""Scheduler policy (chunk budget, admission, page promises) and KV pool sizing, without a model."""

from __future__ import annotations

import pytest
import torch
from lowlat.runtime import ForwardMode, KVPool, SamplingParams
from lowlat.runtime.memory import KVMemoryError, plan_kv_pool
from lowlat.runtime.scheduler import Request, RequestState, Scheduler


def _pool(pages=20, page_size=4, max_reqs=5, ctx=64):
    return KVPool(num_layers=1, num_pages=pages, page_size=page_size, num_kv_heads=1, head_dim=2,
                  dtype=torch.float32, device="cpu", max_reqs=max_reqs, max_context_len=ctx)


def _req(rid, n_prompt, n_new=4):
    return Request(rid, list(range(1, n_prompt + 1)), SamplingParams(max_new_tokens=n_new), None)


def _run_step(s, step, tok=7):
    return s.update(step, {r.rid: [tok] for r in step.sample_reqs}, now=1.0)


def test_prefill_chunks_share_the_token_budget():
    s = Scheduler(_pool(), max_batch_size=4, chunked_prefill_size=8)
    s.add(_req(0, 13))
    s.add(_req(1, 5))
    step = s.schedule()
    assert step.mode is ForwardMode.PREFILL and step.batch.extend_lens_cpu == [8]
    assert step.sample_reqs == []  # prompt not done: nothing sampled
    _run_step(s, step)
    step = s.schedule()  # the rest of request 0, then 3 tokens of request 1
    assert [r.rid for r in step.requests] == [0, 1] and step.batch.extend_lens_cpu == [5, 3]
    assert step.batch.positions.tolist()[:5] == list(range(8, 13))
    assert [r.rid for r in step.sample_reqs] == [0] and step.sample_rows == [0]
    _run_step(s, step)
    step = s.schedule()
    assert step.mode is ForwardMode.PREFILL and step.batch.extend_lens_cpu == [2]
    _run_step(s, step)
    step = s.schedule()
    assert step.mode is ForwardMode.DECODE and step.batch.input_ids.tolist() == [7, 7]
    assert step.batch.seq_lens_cpu == [14, 6]


def test_admission_respects_batch_limit_and_page_promises():
    pool = _pool(pages=9, page_size=4)  # 8 usable pages
    s = Scheduler(pool, max_batch_size=2, chunked_prefill_size=100)
    for rid in range(3):
        s.add(_req(rid, 6, n_new=7))  # 12 cached tokens = 3 pages each
    step = s.schedule()
    assert [r.rid for r in step.requests] == [0, 1]  # batch limit 2
    _run_step(s, step)
    assert s.waiting[0].rid == 2
    # finish request 0; request 2 then fits next to request 1 (2 pages held, 1 more promised)
    s.running[0].params = SamplingParams(max_new_tokens=2)
    finished = _run_step(s, s.schedule())
    assert [r.rid for r in finished] == [0] and finished[0].state is RequestState.FINISHED
    step = s.schedule()
    assert step.mode is ForwardMode.PREFILL and [r.rid for r in step.requests] == [2]


def test_pages_are_promised_before_admission():
    pool = _pool(pages=7, page_size=4)  # 6 usable pages
    s = Scheduler(pool, max_batch_size=4, chunked_prefill_size=100)
    s.add(_req(0, 2, n_new=15))  # 16 cached tokens -> 4 pages, only 1 allocated at first
    s.add(_req(1, 2, n_new=15))
    step = s.schedule()
    assert [r.rid for r in step.requests] == [0]  # 6 - 4 promised < 4
    assert pool.free_pages == 5


def test_request_larger_than_the_pool_is_refused():
    s = Scheduler(_pool(pages=3, page_size=4), max_batch_size=2, chunked_prefill_size=100)
    with pytest.raises(ValueError, match="KV pool holds 2 pages"):
        s.add(_req(0, 8, n_new=4))


def test_abort_all_frees_everything():
    pool = _pool()
    s = Scheduler(pool, max_batch_size=4, chunked_prefill_size=100)
    s.add(_req(0, 9))
    s.add(_req(1, 3))
    s.schedule()
    s.abort_all()
    assert pool.free_pages == 19 and pool.free_rows == 5 and not s.has_unfinished()


def test_kv_plan_cpu_is_the_cap():
    plan = plan_kv_pool(bytes_per_token=100, page_size=16, max_batch_size=3, max_context_len=40,
                        device=torch.device("cpu"), kv_cache_fraction=0.5)
    assert plan.num_pages == 3 * 3 + 1 == plan.cap_pages and plan.budget_bytes is None
    assert plan.num_tokens == 9 * 16 and plan.total_bytes == 10 * 1600


def test_kv_plan_cuda_uses_free_memory_fraction_and_cap():
    kw = dict(bytes_per_token=1000, page_size=10, max_batch_size=4, max_context_len=100,
              device=torch.device("cuda"), kv_cache_fraction=0.5)
    small = plan_kv_pool(**kw, free_bytes=500_000, reserved_bytes=100_000)  # budget 200 kB = 20 pages
    assert small.num_pages == 20 and small.budget_bytes == 200_000
    big = plan_kv_pool(**kw, free_bytes=10**9)
    assert big.num_pages == big.cap_pages == 41
    with pytest.raises(KVMemoryError, match="max_context_len=100 needs 10"):
        plan_kv_pool(**kw, free_bytes=150_000)
