"""The isolated oracle's checkers (oracle.py) and the routing comparison (router_ties.py) catch what they name:
a mutation pass on each (a write outside out_cache_loc, a bitwise-only change, an in-place input edit, a
changed req_to_token, a routing difference)."""

from __future__ import annotations

import torch
from lowlat.forward_batch import ForwardBatch, ForwardMode
from lowlat.kv_cache import KVPool
from lowlat_contract.oracle import copy_batch, input_edits, restore, snapshot, stray_writes
from lowlat_contract.router_ties import routing_diff_rows


def _pool() -> KVPool:
    pool = KVPool(num_layers=2, num_pages=4, page_size=4, num_kv_heads=1, head_dim=2, dtype=torch.float32,
                  device="cpu", max_reqs=2, max_context_len=8)
    for b in [*pool.k_buffers, *pool.v_buffers]:
        b.normal_()
    return pool


def test_writes_at_out_cache_loc_only_pass_and_any_other_slot_fails() -> None:
    pool = _pool()
    snap = snapshot(pool)
    loc = torch.tensor([5, 6])
    pool.k_buffers[0][loc] = 1.0
    pool.v_buffers[1][loc] = 2.0
    assert stray_writes(pool, snap, loc) == []
    pool.k_buffers[1][7] += 1.0
    problems = stray_writes(pool, snap, loc, owner=lambda s: "a cached token of request 1")
    assert len(problems) == 1 and "layer 1 K" in problems[0] and "7 (a cached token of request 1)" in problems[0]


def test_a_bitwise_only_change_counts_as_a_write() -> None:
    pool = _pool()
    pool.v_buffers[0][3] = 0.0
    snap = snapshot(pool)
    pool.v_buffers[0][3] = -0.0  # == 0.0, but another bit pattern: a write
    assert stray_writes(pool, snap, torch.tensor([5]))


def test_req_to_token_edits_fail_and_restore_undoes_everything() -> None:
    pool = _pool()
    snap = snapshot(pool)
    pool.req_to_token[0, 0] = 9
    pool.k_buffers[0].zero_()
    assert any("req_to_token" in p for p in stray_writes(pool, snap, torch.tensor([1])))
    restore(pool, snap)
    assert stray_writes(pool, snap, torch.tensor([1])) == []


def test_in_place_input_edits_are_named() -> None:
    batch = ForwardBatch.build(ForwardMode.DECODE, [3, 4], [2, 5], [1, 1], [0, 1], torch.tensor([9, 10]), "cpu")
    pristine = copy_batch(batch)
    assert input_edits(batch, pristine) == []
    batch.positions.add_(1)
    batch.seq_lens_cpu[0] = 0
    assert input_edits(batch, pristine) == ["positions", "seq_lens_cpu"]
    assert pristine.positions.tolist() == [2, 5], "the copy does not share storage"


def test_routing_differences_are_sets_of_experts_per_row() -> None:
    general = [torch.tensor([[0, 1], [2, 3], [4, 5]])]
    same_order_swapped = [torch.tensor([[1, 0], [2, 3], [4, 6]])]
    assert routing_diff_rows(general, same_order_swapped) == {2}
    assert routing_diff_rows(general * 2, [general[0], torch.tensor([[0, 2], [2, 3], [4, 5]])]) == {0}


def test_a_routing_difference_is_excused_only_at_a_router_near_tie() -> None:
    """With the plugin's routing known (``last_routing()``), a bfloat16 row is excused only where the two paths'
    experts differ *and* the general path's router had a near-tie there: a selection that differs away from any
    tie is a defect (expert ids off by one, another layer's router, an earlier layer's error moving the router's
    input), not rounding."""
    from lowlat.config import EngineConfig
    from lowlat.runtime import ModelRunner
    from lowlat_contract.harness import Requests, prefix_lens
    from lowlat_contract.oracle import copy_batch
    from lowlat_contract.router_ties import RoutingRecorder, routing_excuses

    runner = ModelRunner(EngineConfig(model="tiny-qwen3-moe", device="cpu", dtype="bfloat16", plugin="none",
                                      max_batch_size=8, max_context_len=128, cuda_graph=False, seed=0),
                         show_progress=False)
    try:
        with Requests.with_prefixes(runner, prefix_lens(8), seed=5) as reqs:
            batch = reqs.step(ForwardMode.VERIFY, 2)
            t = batch.num_tokens
            forward = lambda: runner.general_forward(copy_batch(batch))  # noqa: E731
            rec = RoutingRecorder(runner.model)
            with rec:
                forward()
            experts = runner.model_config.num_experts
            shifted = [(ids + 1) % experts for ids in rec.topk]  # every row's experts differ in every layer
            assert routing_excuses(runner.model, forward, t, rec.topk)[1] == frozenset()
            assert routing_excuses(runner.model, forward, t, shifted)[1] == frozenset(rec.near_ties)
            assert len(rec.near_ties) < t, "every row a near-tie: the check proves nothing"
            one = [ids.clone() for ids in rec.topk]
            one[-1][0] = (one[-1][0] + 1) % experts
            assert routing_excuses(runner.model, forward, t, one)[1] == frozenset(rec.near_ties) & {0}
    finally:
        runner.close()
