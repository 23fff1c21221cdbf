"""A lowlat path's inputs (rows, slots, random KV) and its graph-replay branch, with graphs emulated on a CPU."""

from __future__ import annotations

import pytest
import torch
from lowlat.bench.config import BenchConfig, Shape
from lowlat.bench.lowlat_path import eager_pass, engine_config, fill_kv_random, input_sets, measure_shape
from lowlat.forward_batch import ForwardMode
from lowlat.runtime.cuda_graph_runner import CudaGraphRunner
from lowlat.runtime.model_runner import ModelRunner

CFG = BenchConfig.with_defaults("cpu", batch_sizes=(1, 2), verify_tokens=3, context=20, input_sets=3, warmup=1,
                                iters=2, page_size=8)


@pytest.fixture(scope="module")
def runner():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    r = ModelRunner(engine_config(CFG, "tiny-llama", "general", None), show_progress=False)
    fill_kv_random(r.kv_pool, seed=0)
    yield r
    r.close()
    torch.set_num_threads(n)


def test_input_sets_use_their_own_requests_and_slots(runner):
    pool = runner.kv_pool
    assert pool.max_reqs == 2 * 3 + 1  # largest batch x input sets, plus the dummy row
    assert float(pool.k_buffers[0].float().std()) > 0.5 and float(pool.v_buffers[1].float().std()) > 0.5
    free = pool.free_rows
    batches, rows = input_sets(runner, Shape(ForwardMode.VERIFY, 2, 3), CFG, seed=1)
    assert len(batches) == 3 and len(set(rows)) == 6 and pool.free_rows == free - 6
    slots = torch.cat([b.out_cache_loc for b in batches])
    assert slots.unique().numel() == 3 * 2 * 3  # every new token has its own slot
    for b in batches:
        assert b.forward_mode is ForwardMode.VERIFY and b.tokens_per_req == 3 and b.seq_lens.tolist() == [23, 23]
        assert b.positions.tolist() == [20, 21, 22] * 2
        for r in b.req_pool_indices.tolist():  # the cached context has slots too (its K/V are the random ones)
            assert (pool.req_to_token[r, :23] > 0).all()
    assert not torch.equal(batches[0].input_ids, batches[1].input_ids)
    for r in rows:
        pool.free_req(r)
    assert pool.free_rows == free


class _EagerGraph:
    """Stands in for a CUDAGraph on a CPU: replay reruns the forward on the static batch into the fixed output."""

    def __init__(self, forward_fn, batch, out):
        self.forward_fn, self.batch, self.out = forward_fn, batch, out
        self.replays = 0

    def replay(self):
        self.replays += 1
        with torch.inference_mode():  # a real graph replay runs no autograd at all
            self.out.copy_(self.forward_fn(self.batch))


def test_measure_shape_times_forward_and_pure_replay(runner):
    shape = Shape(ForwardMode.DECODE, 2, 1)
    graphs = CudaGraphRunner(device=runner.device, dummy_row=runner.dummy_row, max_batch_size=2,
                             max_verify_tokens=1, vocab_size=runner.model_config.vocab_size)
    key = next(k for k in graphs.keys() if k.batch_size == 2 and k.mode is ForwardMode.DECODE)
    with torch.inference_mode():
        static = graphs._fill_dummy(key)
        out = runner.forward_fn(static).clone()
    graphs.graphs[key], graphs.outputs[key] = _EagerGraph(runner.forward_fn, static, out), out
    runner.graph_runner = graphs
    batches, rows = input_sets(runner, shape, CFG, seed=2)
    try:
        m = measure_shape(runner, batches, CFG, runner.device)
        assert m.launches is None
        assert eager_pass(runner, batches, runner.device, m, routing=False) is None
    finally:
        runner.graph_runner = None
        for r in rows:
            runner.kv_pool.free_req(r)
    assert m.graphed and m.ran_on == "general" and m.step.n == 2 and m.repeat.n == 2
    assert m.replay is not None and m.replay.n == 2
    assert graphs.graphs[key].replays == 1 + 1 + 2 * 2 + 1 + 2 + 2  # probe, warm-up, 2 runs, refill, replays
    assert m.launches is not None and m.launches > 0
