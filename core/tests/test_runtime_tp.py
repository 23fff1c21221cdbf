"""Tensor parallelism on CPU: two spawned gloo ranks give the same tokens as one rank; a dead worker is an error."""

from __future__ import annotations

import pytest
import torch
from lowlat.config import EngineConfig
from lowlat.runtime import Engine, SamplingParams, WorkerError


def test_tp2_generate_equals_tp1_and_dead_worker_raises(monkeypatch):
    monkeypatch.setenv("LOWLAT_TP_TIMEOUT", "60")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    prompts = [[1, 2, 3, 4, 5], [70, 80, 90], list(range(20, 37))]
    params = [SamplingParams(max_new_tokens=6, stop_at_eos=False),
              SamplingParams(max_new_tokens=5, temperature=0.9, top_k=40, seed=7, stop_at_eos=False),
              SamplingParams(max_new_tokens=4, stop_at_eos=False)]
    kw = dict(model="tiny-qwen3", device="cpu", max_context_len=48, max_batch_size=2, page_size=4,
              chunked_prefill_size=8)
    try:
        with Engine(EngineConfig(**kw)) as one:
            ref = [c.token_ids for c in one.generate(prompts, params)]
        two = Engine(EngineConfig(tp_size=2, **kw))
        try:
            assert two.runner.tp.size == 2 and two.runner.num_kv_heads == 2
            assert [c.token_ids for c in two.generate(prompts, params)] == ref
            rid = two.add_request(prompts[0], params[0])  # the low-level API is mirrored too
            done = []
            while two.has_unfinished():
                done += two.step()
            assert [c.request_id for c in done] == [rid] and done[0].token_ids == ref[0]
            worker = two._workers.procs[0]
            worker.kill()
            worker.join(10)
            with pytest.raises(WorkerError, match="exited unexpectedly"):
                two.generate(prompts[:1], params[0])
        finally:
            two.close()
        assert not torch.distributed.is_initialized()
    finally:
        torch.set_num_threads(n)
