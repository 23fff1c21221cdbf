"""CUDA graphs: replay equals eager for DECODE and VERIFY (GPU only), plus the capture plan (anywhere)."""

from __future__ import annotations

import pytest
import torch
from lowlat.config import EngineConfig
from lowlat.runtime import Engine, ForwardMode, SamplingParams
from lowlat.runtime.cuda_graph_runner import CudaGraphRunner, GraphKey, capture_batch_sizes

pytestmark = pytest.mark.gpu  # also run on a GPU: python bench/gpu_jobs.py gpu-tests

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


def test_capture_batch_sizes():
    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(8) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert capture_batch_sizes(30) == [1, 2, 3, 4, 5, 6, 7, 8, 16, 24, 30]


def test_graph_runner_refuses_cpu():
    runner = CudaGraphRunner(device=torch.device("cpu"), dummy_row=0, max_batch_size=2, max_verify_tokens=2,
                             vocab_size=8)
    with pytest.raises(ValueError, match="CUDA device"):
        runner.capture(lambda batch: batch.input_ids)


class _EagerGraph:
    """Stands in for a CUDAGraph on CPU: 'replay' reruns the forward on the static batch into the fixed output."""

    def __init__(self, forward_fn, batch, out):
        self.forward_fn, self.batch, self.out = forward_fn, batch, out

    def replay(self):
        self.out.copy_(self.forward_fn(self.batch))


def test_padded_static_batches_equal_eager_on_cpu():
    """The replay path's buffer filling and padding (dummy row, slot 0) with graphs emulated eagerly."""
    with _engine(False, device="cpu", max_batch_size=10) as e:
        runner, pool = e.runner, e.runner.kv_pool
        graphs = CudaGraphRunner(device=pool.device, dummy_row=runner.dummy_row, max_batch_size=10,
                                 max_verify_tokens=4, vocab_size=runner.model_config.vocab_size)
        used = [GraphKey(ForwardMode.DECODE, 10, 1), GraphKey(ForwardMode.VERIFY, 2, 3),
                GraphKey(ForwardMode.VERIFY, 10, 4)]
        assert set(used) <= set(graphs.keys())
        for key in used:
            batch = graphs._fill_dummy(key)
            out = runner.forward_fn(batch).clone()
            graphs.graphs[key] = _EagerGraph(runner.forward_fn, batch, out)
            graphs.outputs[key] = out
        seen = []
        graphs.replay_hooks.append(lambda key, batch: seen.append(key))
        runner.graph_runner = graphs
        _check_replay_equals_eager(runner, ForwardMode.DECODE, 1, 9)  # padded to 10
        _check_replay_equals_eager(runner, ForwardMode.VERIFY, 3, 2)
        _check_replay_equals_eager(runner, ForwardMode.VERIFY, 4, 9)
        assert seen[0] == GraphKey(ForwardMode.DECODE, 10, 1) and seen[-1] == GraphKey(ForwardMode.VERIFY, 10, 4)
        runner.graph_runner = None


def _engine(graphs: bool, **kw) -> Engine:
    kw = {"model": "tiny-llama", "device": "cuda", "dtype": "float32", "max_context_len": 128, "page_size": 4,
          "max_batch_size": 10, "max_verify_tokens": 4, "cuda_graph": graphs, **kw}
    return Engine(EngineConfig(**kw))


@needs_cuda
def test_graphs_are_captured_for_decode_and_verify():
    with _engine(True) as e:
        g = e.runner.graph_runner
        assert g.batch_sizes == [1, 2, 3, 4, 5, 6, 7, 8, 10]
        keys = set(g.graphs)
        assert {GraphKey(ForwardMode.DECODE, b, 1) for b in g.batch_sizes} <= keys
        assert {GraphKey(ForwardMode.VERIFY, b, t) for b in g.batch_sizes for t in (2, 3, 4)} <= keys
        assert len(keys) == 9 * 4


def _check_replay_equals_eager(runner, mode, tpr, batch_size):
    pool = runner.kv_pool
    rows = [pool.alloc_req() for _ in range(batch_size)]
    gen = torch.Generator().manual_seed(batch_size * 10 + tpr)
    prompts = [torch.randint(0, 500, (int(n),), generator=gen).tolist()
               for n in torch.randint(1, 40, (batch_size,), generator=gen)]
    runner.forward(runner.prepare_batch(ForwardMode.PREFILL, rows, [0] * batch_size, prompts))
    lens = [len(p) for p in prompts]
    for _ in range(3):  # fresh inputs across replays
        feeds = [torch.randint(0, 500, (tpr,), generator=gen).tolist() for _ in rows]
        batch = runner.prepare_batch(mode, rows, lens, feeds)
        assert runner.graph_runner.can_run(batch)
        eager = runner.forward_fn(batch).clone()
        k_before = [k.clone() for k in pool.k_buffers]
        graphed = runner.forward(batch)
        assert runner.last_graphed
        torch.testing.assert_close(graphed, eager, rtol=1e-4, atol=1e-4)
        untouched = torch.ones(pool.num_slots, dtype=torch.bool, device=pool.device)
        untouched[batch.out_cache_loc] = False
        untouched[0] = False  # the dummy slot padded rows write to
        for before, after in zip(k_before, pool.k_buffers):
            assert torch.equal(before[untouched], after[untouched])
        lens = [n + tpr for n in lens]
    for r in rows:
        pool.free_req(r)


@needs_cuda
@pytest.mark.parametrize("mode, tpr, batch_size", [(ForwardMode.DECODE, 1, 3), (ForwardMode.DECODE, 1, 9),
                                                   (ForwardMode.VERIFY, 3, 2), (ForwardMode.VERIFY, 4, 9)])
def test_replay_equals_eager(mode, tpr, batch_size):
    with _engine(True) as e:
        _check_replay_equals_eager(e.runner, mode, tpr, batch_size)


@needs_cuda
def test_generate_with_graphs_equals_eager():
    prompts = [[1, 2, 3], list(range(10, 40)), [7] * 5, [300, 301]]
    params = SamplingParams(max_new_tokens=12, stop_at_eos=False)
    with _engine(False) as eager_engine:
        want = [c.token_ids for c in eager_engine.generate(prompts, params)]
    with _engine(True) as e:
        got = [c.token_ids for c in e.generate(prompts, params)]
        decode = e.stats.by_mode[ForwardMode.DECODE]
        assert decode.graph_steps == decode.steps > 0
        rid = e.add_request([5, 6, 7], params)
        e.step()
        res = e.verify({rid: [1, 2]})
        assert len(res.accepted[rid]) >= 1 and e.stats.by_mode[ForwardMode.VERIFY].graph_steps == 1
        while e.has_unfinished():
            e.step()
    assert got == want
