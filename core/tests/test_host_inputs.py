"""Incremental step inputs (BatchBuilder / StepInputs), KVPool.alloc_slot and the copy-free graph replay path:
each gives exactly what the general path (make_batch, alloc_slots, copies into the graph buffers) gives."""

from __future__ import annotations

import pytest
import torch
from _graphs_util import emulated_graphs
from lowlat.config import EngineConfig
from lowlat.runtime import Engine, ForwardMode, KVPool, KVPoolExhausted, SamplingParams
from lowlat.runtime.cuda_graph_runner import CudaGraphRunner, GraphKey
from lowlat.runtime.scheduler import Request, Scheduler, make_batch
from lowlat.runtime.step_inputs import BatchBuilder, StepInputs

pytestmark = pytest.mark.gpu  # also run on a GPU: python bench/gpu_jobs.py gpu-tests

FIELDS = ("input_ids", "positions", "seq_lens", "req_pool_indices", "out_cache_loc", "extend_lens", "extend_start_loc")


def _pool(pages=40, page_size=4, max_reqs=6, ctx=64):
    return KVPool(num_layers=1, num_pages=pages, page_size=page_size, num_kv_heads=1, head_dim=2,
                  dtype=torch.float32, device="cpu", max_reqs=max_reqs, max_context_len=ctx)


def _assert_same_batch(got, want):
    for name in FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.tolist() == b.tolist(), name
    assert got.forward_mode is want.forward_mode and got.tokens_per_req == want.tokens_per_req
    assert got.seq_lens_cpu == want.seq_lens_cpu and got.extend_lens_cpu == want.extend_lens_cpu


def test_kv_pool_alloc_slot_equals_alloc_slots():
    a, b = _pool(), _pool()
    ra, rb = a.alloc_req(), b.alloc_req()
    a.alloc_slots(ra, 3)
    b.alloc_slots(rb, 3)
    slots = []
    for pos in range(3, 14):  # crosses three page boundaries
        slots.append(a.alloc_slot(ra, pos))
    want = b.alloc_slots(rb, 14).tolist()
    assert slots == want and a.num_allocated(ra) == 14 and a.free_pages == b.free_pages
    idx = torch.tensor([ra * a.max_context_len + p for p in range(3, 14)])
    a.write_slots(idx, torch.tensor(slots, dtype=torch.int32))
    assert torch.equal(a.req_to_token, b.req_to_token)
    with pytest.raises(ValueError, match="next position is not 13"):
        a.alloc_slot(ra, 13)


def test_kv_pool_alloc_slot_errors():
    pool = _pool(pages=3, page_size=2, ctx=8)  # 2 usable pages
    row = pool.alloc_req()
    pool.alloc_slots(row, 4)
    with pytest.raises(KVPoolExhausted, match="out of pages"):
        pool.alloc_slot(row, 4)
    assert pool.num_allocated(row) == 4
    pool.free_req(row)
    small = _pool(ctx=3)
    row = small.alloc_req()
    small.alloc_slots(row, 3)
    with pytest.raises(ValueError, match="exceeds max_context_len=3"):
        small.alloc_slot(row, 3)


def test_builder_equals_make_batch_as_the_batch_changes():
    """DECODE and VERIFY batches, growing, shrinking and switching tokens per request, across page boundaries."""
    a, b = _pool(), _pool()
    builder = BatchBuilder(a, StepInputs(device="cpu", max_batch_size=5, max_tokens_per_req=4, dummy_row=5))
    rows = [a.alloc_req() for _ in range(5)]
    assert rows == [b.alloc_req() for _ in range(5)]
    lens = [3, 1, 6, 2, 7]
    for r, n in zip(rows, lens):
        a.alloc_slots(r, n)
        b.alloc_slots(r, n)
    gen = torch.Generator().manual_seed(0)
    plan = [(ForwardMode.DECODE, 1, 5), (ForwardMode.DECODE, 1, 5), (ForwardMode.DECODE, 1, 2),
            (ForwardMode.VERIFY, 3, 2), (ForwardMode.VERIFY, 3, 4), (ForwardMode.DECODE, 1, 4),
            (ForwardMode.VERIFY, 4, 1), (ForwardMode.DECODE, 1, 5), (ForwardMode.DECODE, 1, 3)]
    for mode, tpr, n in plan:
        toks = torch.randint(0, 100, (n * tpr,), generator=gen).tolist()
        got = builder.build(mode, rows[:n], lens[:n], toks, tpr)
        want = make_batch(b, mode, rows[:n], lens[:n], [toks[i * tpr:(i + 1) * tpr] for i in range(n)])
        _assert_same_batch(got, want)
        assert torch.equal(a.req_to_token, b.req_to_token) and a.free_pages == b.free_pages
        lens[:n] = [p + tpr for p in lens[:n]]


def test_builder_refuses_what_it_cannot_build():
    pool = _pool()
    builder = BatchBuilder(pool, StepInputs(device="cpu", max_batch_size=2, max_tokens_per_req=2, dummy_row=5))
    rows = [pool.alloc_req() for _ in range(3)]
    assert not builder.fits(3, 1) and not builder.fits(1, 3) and builder.fits(2, 2)
    with pytest.raises(ValueError, match="cannot build 3 requests"):
        builder.build(ForwardMode.DECODE, rows, [0, 0, 0], [1, 2, 3])
    with pytest.raises(ValueError, match="not DECODE with 2 tokens"):
        builder.build(ForwardMode.DECODE, rows[:1], [0], [1, 2], 2)
    with pytest.raises(ValueError, match="not PREFILL"):
        builder.build(ForwardMode.PREFILL, rows[:1], [0], [1])


@pytest.mark.parametrize("mode, tpr, n", [(ForwardMode.DECODE, 1, 9), (ForwardMode.VERIFY, 3, 9),
                                          (ForwardMode.DECODE, 1, 3)])
@pytest.mark.parametrize("before", ["other_shape", "more_rows"])
def test_built_buffers_equal_the_copy_path_padding(mode, tpr, n, before):
    """What a replay finds in place after a build equals what copying the same batch in (and padding it) gives.

    Graphs exist for 1..8 and 10 requests, so 9 requests run padded to 10. The build before it had another
    shape (one request, one token) or all 10 requests with the same tokens per request (its rows must be re-padded).
    """
    a, b = _pool(max_reqs=11), _pool(max_reqs=11)
    fast, slow = (CudaGraphRunner(device=torch.device("cpu"), dummy_row=10, max_batch_size=10, max_verify_tokens=3,
                                  vocab_size=16) for _ in range(2))
    builder = BatchBuilder(a, fast.inputs)
    rows = [a.alloc_req() for _ in range(10)]
    assert rows == [b.alloc_req() for _ in range(10)]
    m, k = (1, 1) if before == "other_shape" else (10, tpr)
    builder.build(mode if k > 1 else ForwardMode.DECODE, rows[:m], [0] * m, [9] * (m * k), k)
    for r in rows[:m]:
        b.alloc_slots(r, k)
    lens = [k] * m + [0] * (10 - m)
    toks = list(range(1, n * tpr + 1))
    got = builder.build(mode, rows[:n], lens[:n], toks, tpr)
    want = make_batch(b, mode, rows[:n], lens[:n], [toks[i * tpr:(i + 1) * tpr] for i in range(n)])
    _assert_same_batch(got, want)
    key = GraphKey(mode, fast._padded[n], tpr)
    slow._copy_in(want, key)
    t, bs = key.num_tokens, key.batch_size
    assert bs == (10 if n == 9 else n)
    for name in FIELDS:
        size = bs if name in ("seq_lens", "req_pool_indices", "extend_lens", "extend_start_loc") else t
        assert getattr(fast, name)[:size].tolist() == getattr(slow, name)[:size].tolist(), name
    assert fast.inputs.layout == (n, tpr) and got.input_ids.data_ptr() == fast.input_ids.data_ptr()
    assert slow.inputs.layout is None


def test_update_decode_equals_update():
    def run(fast):
        pool = _pool()
        s = Scheduler(pool, max_batch_size=4, chunked_prefill_size=100)
        for rid, n_new in enumerate((3, 5, 4)):
            s.add(Request(rid, [1, 2, 3 + rid], SamplingParams(max_new_tokens=n_new), None, frozenset({99})))
        step = s.schedule()
        s.update(step, {r.rid: [7] for r in step.sample_reqs}, now=1.0)
        log = []
        t = 0
        while s.has_unfinished():
            step = s.schedule()
            assert step.mode is ForwardMode.DECODE and step.greedy
            t += 1
            toks = [99 if (t == 2 and r.rid == 1) else t for r in step.requests]
            done = s.update_decode(step, toks, 2.0) if fast else \
                s.update(step, {r.rid: [x] for r, x in zip(step.requests, toks)}, 2.0)
            log.append(([r.rid for r in step.requests], [(r.rid, r.output_ids, r.finish_reason) for r in done]))
        return log, pool.free_pages, pool.free_rows

    assert run(True) == run(False)
    with pytest.raises(ValueError, match="one token per request"):
        s = Scheduler(_pool(), max_batch_size=2, chunked_prefill_size=8)
        s.add(Request(0, [1, 2], SamplingParams(), None))
        s.update_decode(s.schedule(), [1], 0.0)


def _engine(**kw):
    return Engine(EngineConfig(model="tiny-llama", device="cpu", dtype="float32", max_context_len=96, page_size=4,
                               max_batch_size=10, max_verify_tokens=3, **kw))


def test_emulated_graphs_on_shared_inputs_equal_eager(monkeypatch):
    """Engine steps through graphs whose fixed buffers are the scheduler's: no copies, same tokens as eager.

    Nine requests (padded to the captured 10) that finish at different steps, then a VERIFY step.
    """
    prompts = [[1, 2, 3], list(range(10, 30)), [7] * 5, [300, 301], [4], [9, 8, 7, 6], [50] * 3, [60, 61], [2] * 7]
    params = [SamplingParams(max_new_tokens=n, stop_at_eos=False) for n in (9, 4, 7, 12, 3, 5, 6, 2, 8)]
    with _engine() as e:
        want = [c.token_ids for c in e.generate(prompts, params)]
        rid = e.add_request([5, 6, 7], params[0])
        e.step()
        want_verify = e.verify({rid: [1, 2]}).accepted[rid]
        while e.has_unfinished():
            e.step()
    with _engine() as e:
        runner = e.runner
        graphs = emulated_graphs(runner, max_batch_size=10, max_verify_tokens=3)
        copies, padded = [], []
        graphs.replay_hooks.append(lambda key, batch: padded.append(key.batch_size - batch.batch_size))
        real_copy = graphs._copy_in
        monkeypatch.setattr(graphs, "_copy_in", lambda batch, key: (copies.append(key), real_copy(batch, key)))
        got = [c.token_ids for c in e.generate(prompts, params)]
        decode = e.stats.by_mode[ForwardMode.DECODE]
        assert decode.graph_steps == decode.steps > 0 and copies == [] and max(padded) == 1
        rid = e.add_request([5, 6, 7], params[0])
        e.step()
        assert e.verify({rid: [1, 2]}).accepted[rid] == want_verify and copies == []
        while e.has_unfinished():
            e.step()
        runner.graph_runner = None
    assert got == want


def test_host_overhead_bench_runs():
    from lowlat.bench.host_overhead import format_table, measure_host_overhead

    out = measure_host_overhead(batch_sizes=(1, 2), steps=3, warmup=1, repeats=1)
    assert set(out["host_ms"]) == {"graph", "eager"}
    assert all(set(row) == {1, 2} and all(ms > 0 for ms in row.values()) for row in out["host_ms"].values())
    table = format_table(out, out)
    assert "ratio" in table and "1.0x" in table


def test_host_overhead_loops_measures_plain_before_and_overlapped_after(capsys):
    import json

    from lowlat.bench.host_overhead import main, measure_host_overhead

    assert main(["--loops", "--steps", "3", "--repeats", "1", "--batch-sizes", "1", "--paths", "graph",
                 "--clock", "thread", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (out["before"]["overlap"], out["after"]["overlap"]) == (False, True)
    assert out["before"]["clock"] == out["after"]["clock"] == "thread"
    assert out["before"]["host_ms"]["graph"]["1"] > 0 and out["after"]["host_ms"]["graph"]["1"] > 0
    with pytest.raises(SystemExit):
        main(["--loops", "--overlap"])
    assert "leave out --overlap" in capsys.readouterr().err
    with pytest.raises(ValueError, match="clock"):
        measure_host_overhead(steps=1, clock="cpu")
