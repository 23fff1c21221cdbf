"""A lowlat path's inputs (rows, slots, random KV) and its graph-replay branch, with graphs emulated on a CPU."""

from __future__ import annotations

import pytest
import torch
from lowlat.bench.config import BenchConfig, Shape
from lowlat.bench.input_sets import FED_BUILT, FED_COPIED, free_rows, input_sets
from lowlat.bench.lowlat_path import eager_pass, engine_config, fill_kv_random, measure_shape
from lowlat.forward_batch import ForwardMode
from lowlat.runtime.cuda_graph_runner import CudaGraphRunner
from lowlat.runtime.model_runner import ModelRunner
from lowlat.runtime.step_inputs import StepInputs

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
    sets = input_sets(runner, Shape(ForwardMode.VERIFY, 2, 3), CFG, seed=1)
    batches, rows = sets.batches, sets.rows
    assert sets.fed == FED_BUILT and len(batches) == 3 and len(set(rows)) == 6 and pool.free_rows == free - 6
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
    sets = input_sets(runner, shape, CFG, seed=2)
    try:
        m = measure_shape(runner, sets, CFG, runner.device)
        assert m.launches is None
        assert eager_pass(runner, sets.batches, runner.device, m, routing=False) is None
    finally:
        runner.graph_runner = None
        free_rows(runner, sets.rows)
    assert m.inputs == FED_BUILT and m.graphed and m.ran_on == "general" and m.step.n == 2 and m.repeat.n == 2
    assert m.replay is not None and m.replay.n == 2
    assert graphs.graphs[key].replays == 1 + 1 + 2 * 2 + 1 + 2 + 2  # probe, warm-up, 2 runs, refill, replays
    assert m.launches is not None and m.launches > 0


@pytest.mark.parametrize("shape", [Shape(ForwardMode.DECODE, 2, 1), Shape(ForwardMode.VERIFY, 2, 3)],
                         ids=lambda s: s.label)
def test_each_step_restores_its_set_into_the_step_inputs_as_the_engine_builds_it(runner, shape):
    """A step puts its set's inputs, padding rows and KV slot entries in place (what BatchBuilder.build does), so
    a graph replay would copy nothing, and the forward gives the standalone batch's logits."""
    inputs, r2t = runner.step_inputs, runner.kv_pool.req_to_token
    sets = input_sets(runner, shape, CFG, seed=3)
    try:
        for i in (1, 0, 2, 4):  # any order: set i mod 3
            want = sets.batches[i % 3]
            rows = want.req_pool_indices.repeat_interleave(shape.tokens_per_req).tolist()
            pos = want.positions.tolist()
            for r, p in zip(rows, pos):
                r2t[r, p] = 0  # the step writes each new token's slot into req_to_token again
            inputs.invalidate()  # as a copy into the graph's buffers (another shape's step) leaves them
            got = sets.step(i)
            assert got.input_ids.data_ptr() == inputs.input_ids.data_ptr()
            assert inputs.layout == (2, shape.tokens_per_req)
            for name in ("input_ids", "positions", "out_cache_loc", "seq_lens", "req_pool_indices", "extend_lens",
                         "extend_start_loc"):
                assert torch.equal(getattr(got, name), getattr(want, name)), (i, name)
            assert got.seq_lens_cpu == want.seq_lens_cpu == [20 + shape.tokens_per_req] * 2
            assert inputs.req_pool_indices[2:].eq(runner.dummy_row).all()  # rows past the batch are padding
            assert [int(r2t[r, p]) for r, p in zip(rows, pos)] == want.out_cache_loc.tolist()
            with torch.inference_mode():
                torch.testing.assert_close(runner.forward(got), runner.forward(want), rtol=0, atol=0)
    finally:
        free_rows(runner, sets.rows)


def test_a_shape_the_step_inputs_cannot_hold_gets_standalone_batches(runner, monkeypatch):
    small = StepInputs(device=runner.device, max_batch_size=2, max_tokens_per_req=1, dummy_row=runner.dummy_row)
    for step_inputs, shape in ((None, Shape(ForwardMode.DECODE, 2, 1)), (small, Shape(ForwardMode.VERIFY, 2, 3))):
        monkeypatch.setattr(runner, "step_inputs", step_inputs)
        sets = input_sets(runner, shape, CFG, seed=4)
        try:
            assert sets.fed == FED_COPIED and sets.step(4) is sets.batches[1]
            assert sets.batches[1].positions.tolist() == [20 + j for j in range(shape.tokens_per_req)] * 2
        finally:
            free_rows(runner, sets.rows)
