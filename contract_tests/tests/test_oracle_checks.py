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
