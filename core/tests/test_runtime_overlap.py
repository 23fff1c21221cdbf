"""The overlapped step loop (lowlat.runtime.overlap) against plain steps: the same tokens, stops, KV pages, streamed
steps and statistics, at batch 1 and 4, on the general path and with the contract suite's reference plugin, with
emulated CUDA graphs, after aborts and under TP 2 (CPU, tiny presets: the device work is synchronous here, the code
path is the one CUDA runs)."""

from __future__ import annotations

import pytest
import torch
from _graphs_util import emulated_graphs
from lowlat.config import ConfigError, EngineConfig
from lowlat.runtime import Engine, ForwardMode, SamplingParams
from plugin_dists import activate

PROMPTS = [list(range(1, 12)), [300, 5, 17], list(range(40, 70)), [9]]
LENGTHS = [9, 4, 12, 2]  # different ends: requests leave the batch at different steps
KW = dict(model="tiny-llama", device="cpu", dtype="float32", max_context_len=96, max_batch_size=4, page_size=4)


def params(batch: int, **kw) -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=n, stop_at_eos=False, **kw) for n in LENGTHS[:batch]]


def engine(overlap: bool, **kw) -> Engine:
    e = Engine(EngineConfig(overlap=overlap, **{**KW, **kw}))
    assert (e.overlap is not None) == overlap
    return e


def run(overlap: bool, prompts, plist, **kw):
    """Tokens, finish reasons, the streamed steps and DECODE step count of one generate; checks KV pages return."""
    with engine(overlap, **kw) as e:
        pool = e.runner.kv_pool
        free = pool.free_pages, pool.free_rows
        seen = []
        e.step_observer = lambda s: seen.append((s.mode, [(r.rid, tuple(r.output_ids)) for r in s.requests]))
        got = e.generate(prompts, plist)
        assert (pool.free_pages, pool.free_rows) == free and not e.has_unfinished()
        assert e.overlap is None or e.overlap.pending is None
        return ([c.token_ids for c in got], [c.finish_reason for c in got], seen,
                e.stats.by_mode[ForwardMode.DECODE].steps)


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_identity_general_path(batch):
    plain = run(False, PROMPTS[:batch], params(batch), plugin="none")
    assert run(True, PROMPTS[:batch], params(batch), plugin="none") == plain


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_identity_reference_plugin(reference_plugin, batch):
    plain = run(False, PROMPTS[:batch], params(batch), plugin="none")
    with engine(True, plugin=reference_plugin) as e:
        got = [c.token_ids for c in e.generate(PROMPTS[:batch], params(batch))]
        assert got == plain[0]
        assert e.stats.paths_as_dict()["plugin"]["DECODE"]["steps"] == plain[3]


def test_continuous_batching_identity():
    """More prompts than rows (max_batch_size 2) and a chunked prompt: requests join as others leave. Tokens and each
    request's streamed lengths equal plain steps'; a joining request's PREFILL comes after the step in flight."""
    out = {}
    for overlap in (False, True):
        toks, reasons, seen, _ = run(overlap, PROMPTS, params(4), max_batch_size=2, chunked_prefill_size=8)
        streams = {}
        for _, reqs in seen:
            for rid, ids in reqs:
                streams.setdefault(rid, []).append(ids)
        out[overlap] = toks, reasons, streams
    assert out[True] == out[False]


def test_seeded_sampling_identity():
    plist = params(4, temperature=0.8, top_k=50, seed=5)
    assert run(True, PROMPTS, plist) == run(False, PROMPTS, plist)
    mixed = [params(1)[0], *params(4, temperature=1.0, top_p=0.9)[1:3], params(4)[3]]  # greedy and sampled rows
    assert run(True, PROMPTS, mixed) == run(False, PROMPTS, mixed)


def test_eos_and_length_stops_identical():
    """EOS at different steps (one request stops while the step after it is in flight), length stops, and
    max_new_tokens 1 (prompt only) and 2 (one DECODE step)."""
    full = run(False, PROMPTS, params(4))[0]
    eos = {full[0][2], full[2][5]}
    plist = [SamplingParams(max_new_tokens=n) for n in (9, 1, 12, 2)]
    out = {}
    for overlap in (False, True):
        with engine(overlap) as e:
            e.eos_ids = frozenset(eos)
            pool = e.runner.kv_pool
            free = pool.free_pages, pool.free_rows
            out[overlap] = [(c.token_ids, c.finish_reason) for c in e.generate(PROMPTS, plist)]
            assert (pool.free_pages, pool.free_rows) == free
    assert out[True] == out[False]
    assert [r for _, r in out[True]][:3] == ["eos", "length", "eos"]


def test_step_api_abort_and_late_requests():
    """Low-level step(): a request aborted while the step after it is in flight gets no token after the abort,
    a request added mid-run joins (a plain PREFILL step, once the step in flight is read), and every request's
    stream and tokens are those of plain steps."""
    logs = {}
    for overlap in (False, True):
        with engine(overlap) as e:
            pool = e.runner.kv_pool
            free = pool.free_pages, pool.free_rows
            seen = []
            e.step_observer = lambda s, seen=seen: seen.extend((r.rid, len(r.output_ids)) for r in s.requests)
            p = SamplingParams(max_new_tokens=10, stop_at_eos=False)
            a, b = e.add_request(PROMPTS[0], p), e.add_request(PROMPTS[1], p)
            done = []
            for _ in range(4):
                done += e.step()
            assert e.abort(a) and not e.abort(a)
            n_a = max(n for rid, n in seen if rid == a)
            c = e.add_request(PROMPTS[2], p)
            while e.has_unfinished():
                done += e.step()
            assert max(n for rid, n in seen if rid == a) == n_a  # nothing of a after the abort
            assert (pool.free_pages, pool.free_rows) == free
            streams = {rid: [n for r, n in seen if r == rid] for rid in (a, b, c)}
            logs[overlap] = ([(x.request_id, x.token_ids) for x in done], streams)
            assert [x[0] for x in logs[overlap][0]] == [b, c]
    # Per request the same stream; across requests c's prefill comes one step() later (after the step in flight).
    assert logs[True] == logs[False]


def test_verify_after_overlapped_steps_drains_first():
    """verify() reads the DECODE step in flight first (one token more than plain steps have after as many step()
    calls), then verifies from there: the accepted ids and the whole output are plain greedy decoding's."""
    p = SamplingParams(max_new_tokens=12, stop_at_eos=False)
    full = run(False, PROMPTS[:1], [p])[0][0]
    for overlap in (False, True):
        with engine(overlap) as e:
            rid = e.add_request(PROMPTS[0], p)
            for _ in range(3):
                e.step()
            req = e.scheduler.running[0]
            res = e.verify({rid: full[4:6] if overlap else full[3:5]})  # overlap: token 4 was in flight
            assert req.output_ids[-len(res.accepted[rid]):] == res.accepted[rid] == full[len(req.output_ids) - 3:
                                                                                        len(req.output_ids)]
            assert len(req.output_ids) == (7 if overlap else 6)  # both drafts kept, plus the bonus token
            done = []
            while e.has_unfinished():
                done += e.step()
            assert done[0].token_ids == full


def test_emulated_graphs_read_device_ids_from_fixed_buffers(monkeypatch):
    """Through graphs whose fixed buffers are the scheduler's, the device-side id copy lands in the graph's input:
    every DECODE step replays, nothing is copied in, and the tokens equal plain eager steps."""
    want = run(False, PROMPTS, params(4))[0]
    with engine(True, max_verify_tokens=3) as e:
        runner = e.runner
        graphs = emulated_graphs(runner, max_batch_size=4, max_verify_tokens=3)
        copies = []
        real_copy = graphs._copy_in
        monkeypatch.setattr(graphs, "_copy_in", lambda batch, key: (copies.append(key), real_copy(batch, key)))
        got = [c.token_ids for c in e.generate(PROMPTS, params(4))]
        decode = e.stats.by_mode[ForwardMode.DECODE]
        assert decode.graph_steps == decode.steps > 0 and copies == []
        runner.graph_runner = None
    assert got == want


def test_logits_observer_sees_kept_rows_only():
    """logits_observer gets each kept step's logits with the plain step's rows (a discarded row never shows)."""
    full = run(False, PROMPTS[:2], params(2))[0]
    rows = {}
    for overlap in (False, True):
        with engine(overlap) as e:
            e.eos_ids = frozenset({full[0][2]})
            seen = []
            e.logits_observer = lambda s, lg, seen=seen: seen.append([(r.rid, int(lg[i].argmax()))
                                                                      for i, r in zip(s.sample_rows, s.sample_reqs)])
            e.generate(PROMPTS[:2], [SamplingParams(max_new_tokens=8), SamplingParams(max_new_tokens=8)])
            rows[overlap] = seen
    assert rows[True] == rows[False]


def test_logits_observer_sees_only_the_steps_that_need_logits():
    """With ``logits_needed``, the overlapped loop keeps (and shows) logits only for the steps that need them, the
    plain loop's rows for those; the other steps' outputs are read in place (``fresh=False``), never kept."""
    with engine(True) as e:
        seen, fresh = [], []
        forward = e.runner.forward

        def spy(batch, **kw):
            fresh.append(kw.get("fresh", True))
            return forward(batch, **kw)

        e.runner.forward = spy
        e.logits_observer = lambda s, lg: seen.append(len(s.requests))
        e.logits_needed = lambda s: len(fresh) % 2 == 1  # every other launch, as the server's logprobs may
        e.generate(PROMPTS[:2], [SamplingParams(max_new_tokens=9, stop_at_eos=False)] * 2)
    decode = [f for f in fresh[1:]]  # the first forward is the prefill (plain step: a copy)
    assert True in decode and False in decode, decode
    assert len(seen) == sum(decode) + 1, (seen, fresh)  # + the prefill, which the plain step shows


def test_nan_in_a_decode_step_raises_at_its_read(monkeypatch):
    """The non-finite guard (step_guard) rides on the late read: a NaN DECODE step fails the engine, naming it."""
    from lowlat.runtime.step_guard import NonFiniteLogits

    with engine(True) as e:
        rid = e.add_request(PROMPTS[0], SamplingParams(max_new_tokens=8))
        e.step()  # the prompt, plain
        with torch.no_grad():
            e.runner.model.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
        with pytest.raises(NonFiniteLogits, match=r"DECODE.*non-finite"):
            e.step()
        assert not e.has_unfinished() and e.overlap.pending is None and rid is not None
        with pytest.raises(RuntimeError, match="failed in an earlier step.*NonFiniteLogits"):
            e.step()


def test_stuck_launch_misses_the_step_deadline(tmp_path, monkeypatch):
    """A plugin forward that blocks in an overlapped launch hits the step deadline (the launch runs under the
    engine's watchdog, as a plain step's forward does)."""
    import sys
    import time

    from fault_fakes import fault_source
    from lowlat.runtime.deadline import StepDeadlineExceeded
    from plugin_dists import make_plugin_dist

    site = tmp_path / "site"
    activate(site, monkeypatch)
    make_plugin_dist(site, "stuck", fault_source("stuck_forward"))
    monkeypatch.setenv("LOWLAT_PLUGINS", "stuck")
    monkeypatch.setenv("LOWLAT_STEP_TIMEOUT", "1.5")
    e = engine(True, plugin="stuck")
    try:
        t0 = time.monotonic()
        with pytest.raises(StepDeadlineExceeded, match=r"DECODE.*plugin 'stuck'.*1.5 s"):
            e.generate(PROMPTS[:2], params(2))
        assert time.monotonic() - t0 < 10 and e.overlap.pending is None
    finally:
        sys.modules["_lowlat_test_stuck"].RELEASE.set()
        e.close()


def test_config_and_cli():
    assert EngineConfig(device="cpu").resolved_overlap is False
    assert EngineConfig(device="cpu", overlap=True).resolved_overlap is True
    assert EngineConfig(device="cpu", overlap=True, speculative_method="ngram").resolved_overlap is False
    with pytest.raises(ConfigError, match="overlap must be a bool or None"):
        EngineConfig(overlap="yes")
    import argparse

    from lowlat.cli.run import add_arguments, engine_config_from_args

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    assert engine_config_from_args(ap.parse_args(["--no-overlap"])).overlap is False
    assert engine_config_from_args(ap.parse_args([])).overlap is None


def test_tp2_overlap_equals_tp1_plain(monkeypatch):
    monkeypatch.setenv("LOWLAT_TP_TIMEOUT", "60")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    kw = dict(model="tiny-qwen3", max_context_len=48, max_batch_size=2, chunked_prefill_size=8)
    plist = [SamplingParams(max_new_tokens=6, stop_at_eos=False),
             SamplingParams(max_new_tokens=5, temperature=0.9, top_k=40, seed=7, stop_at_eos=False),
             SamplingParams(max_new_tokens=4, stop_at_eos=False)]
    prompts = [[1, 2, 3, 4, 5], [70, 80, 90], list(range(20, 37))]
    try:
        want = run(False, prompts, plist, **kw)[:2]
        with engine(True, tp_size=2, **kw) as two:
            assert two.runner.tp.size == 2
            got = two.generate(prompts, plist)
            assert ([c.token_ids for c in got], [c.finish_reason for c in got]) == want
            rid = two.add_request(prompts[0], plist[0])  # step() and abort() mirrored with a step in flight
            other = two.add_request(prompts[1], plist[1])
            done = []
            for _ in range(3):
                done += two.step()
            assert two.abort(other)
            while two.has_unfinished():
                done += two.step()
            assert [c.request_id for c in done] == [rid] and done[0].token_ids == want[0][0]
            rid = two.add_request(prompts[0], plist[0])  # verify() drains the step in flight on every rank
            for _ in range(3):
                two.step()
            res = two.verify({rid: want[0][0][4:5]})  # tokens 0..3 are read, 4 is drafted: kept, 5 is the bonus
            assert res.accepted[rid] == want[0][0][4:6] and [c.request_id for c in res.finished] == [rid]
    finally:
        torch.set_num_threads(n)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("plugin", ["none", "reference"])
def test_cuda_overlap_equals_plain(plugin, request):
    """On CUDA (graphs, pinned read-back, events): the same tokens, stops and pages as plain steps, batch 1 and 4,
    general path and the reference plugin, every DECODE step a graph replay. Run by ``gpu_jobs.py gpu-tests``."""
    if plugin == "reference":
        request.getfixturevalue("reference_plugin")
    # float32: after an EOS the overlapped step still holds the stopped row, so its batch is one larger than the
    # plain step's; in bf16 a different batch size may flip a near-tie (e2e_tpot checks bf16 without EOS stops).
    kw = dict(device="cuda", dtype="float32", plugin=plugin, max_context_len=256)
    full = run(False, PROMPTS, params(4), **kw)[0]
    eos = {full[0][2], full[2][5]}
    for batch in (1, 4):
        plist = [SamplingParams(max_new_tokens=n) for n in LENGTHS[:batch]]
        out = {}
        for overlap in (False, True):
            with engine(overlap, **kw) as e:
                e.eos_ids = frozenset(eos)
                pool = e.runner.kv_pool
                free = pool.free_pages, pool.free_rows
                got = e.generate(PROMPTS[:batch], plist)
                assert (pool.free_pages, pool.free_rows) == free
                decode = e.stats.by_mode[ForwardMode.DECODE]
                assert decode.graph_steps == decode.steps > 0
                out[overlap] = [(c.token_ids, c.finish_reason) for c in got]
        assert out[True] == out[False]


def test_only_single_device_graph_replays_skip_the_watchdog_thread():
    """OverlapLoop._inline: a launch is enqueued on the engine's thread only for a CUDA-graph replay on one device
    with no TP workers; everything else (CPU, eager steps, TP) keeps the watchdog (test_stuck_launch_...)."""
    from types import SimpleNamespace

    from lowlat.runtime.overlap import OverlapLoop

    def inline(cuda: bool, replay: bool, tp: int = 1, workers: object = None) -> bool:
        loop = OverlapLoop.__new__(OverlapLoop)
        loop._cuda = cuda
        loop.engine = SimpleNamespace(config=SimpleNamespace(tp_size=tp), _workers=workers,
                                      runner=SimpleNamespace(will_replay=lambda batch: replay))
        return loop._inline(SimpleNamespace(batch=None))

    assert inline(True, True)
    assert not inline(False, True) and not inline(True, False)
    assert not inline(True, True, tp=2) and not inline(True, True, workers=object())


def test_will_replay_says_what_forward_does():
    """ModelRunner.will_replay is True exactly when forward replays a graph (last_graphed after it)."""
    with engine(True, max_verify_tokens=3) as e:
        runner = e.runner
        row = runner.kv_pool.alloc_req()
        runner.forward(runner.prepare_batch(ForwardMode.PREFILL, [row], [0], [PROMPTS[0]]))
        batch = runner.prepare_batch(ForwardMode.DECODE, [row], [len(PROMPTS[0])], [[5]])
        assert not runner.will_replay(batch)
        runner.forward(batch)
        assert not runner.last_graphed
        emulated_graphs(runner, max_batch_size=4, max_verify_tokens=3)
        assert runner.will_replay(batch)
        runner.forward(batch)
        assert runner.last_graphed
        runner.graph_runner = None
        runner.kv_pool.free_req(row)
