"""Engine.abort frees a request's KV pages at once (waiting or running), and step_observer sees each step's tokens."""

from __future__ import annotations

from lowlat.config import EngineConfig
from lowlat.runtime import Engine, SamplingParams


def test_abort_running_and_waiting_frees_pages_and_others_go_on():
    cfg = EngineConfig(model="tiny-llama", device="cpu", max_context_len=64, max_batch_size=1, page_size=4)
    with Engine(cfg) as e:
        pool = e.runner.kv_pool
        free = pool.free_pages
        params = SamplingParams(max_new_tokens=20, stop_at_eos=False)
        seen: list[tuple[int, int]] = []
        e.step_observer = lambda step: seen.extend((r.rid, len(r.output_ids)) for r in step.requests)
        a, b, c = (e.add_request([1, 2, 3], params) for _ in range(3))
        e.step()
        e.step()
        assert pool.free_pages < free and seen[-1] == (a, 2)
        assert e.abort(a) and e.abort(b)  # a runs, b waits (batch of one)
        assert not e.abort(a) and not e.abort(12345)
        done = []
        while e.has_unfinished():
            done += e.step()
        assert [x.request_id for x in done] == [c] and len(done[0].token_ids) == 20
        assert pool.free_pages == free
        assert seen[-1] == (c, 20)
