"""Peer buffers across processes (``PeerBuffers.rendezvous``): each rank is a spawned process of a gloo group.

CPU: two processes, shared-memory files, the one-launch kernel under the Triton interpreter in each process (the
two interpreters run at once, so each process's waits see the other's pushes). GPU (``python bench/gpu_jobs.py
gpu-tests``): two processes sharing cuda:0 through CUDA IPC; their kernels time-slice on one GPU, so the
deadline is a generous 5 s. Still not two GPUs: no NVLink. One spawned pair per scenario (a module fixture), one
behaviour per test. Mutation pass: bench/scripts/mutate_peer_allreduce.py.
"""

from __future__ import annotations

import queue
import time
from typing import Any

import _peer_xproc_worker as worker
import pytest
import torch
from _peer_util import DEV
from _procs import wait_no_children

pytestmark = pytest.mark.gpu  # also run on a GPU: python bench/gpu_jobs.py gpu-tests


def run_ranks(tmp_path_factory: pytest.TempPathFactory, scenario: str, timeout_s: float = 90.0
              ) -> dict[int, dict[str, Any]]:
    """Spawn ranks 0 and 1 running ``scenario``; return what each saw (a rank that puts nothing maps to {})."""
    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.Queue()
    init = f"file://{tmp_path_factory.mktemp('rdzv') / 'store'}"
    procs = [ctx.Process(target=worker.main, args=(r, init, scenario, DEV.type, results), daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    seen: dict[int, dict[str, Any]] = {0: {}, 1: {}}
    deadline = time.monotonic() + timeout_s
    got = 0
    try:
        while got < 2 and time.monotonic() < deadline:
            try:
                rank, out = results.get(timeout=0.2)
            except queue.Empty:
                if any(p.is_alive() for p in procs):
                    continue
                try:  # every rank has exited (one that died put nothing): what is left is in the pipe already
                    rank, out = results.get(timeout=1.0)
                except queue.Empty:
                    break
            seen[rank], got = out, got + 1
    finally:
        for p in procs:
            p.join(max(0.1, min(10.0, deadline - time.monotonic())))
            if p.is_alive():
                p.kill()
                p.join(5)
        results.close()
        results.join_thread()
    assert not wait_no_children(10), "a rank process was left behind"
    assert time.monotonic() < deadline, f"scenario {scenario!r} ran past {timeout_s} s"
    for r, out in seen.items():
        assert "crash" not in out, f"rank {r}:\n{out['crash']}"
    return seen


@pytest.fixture(scope="module")
def main_run(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    return run_ranks(tmp_path_factory, "main")


def test_consecutive_one_launch_sums_are_the_rank_order_sum_bit_identical_on_both_ranks(main_run) -> None:
    """Four calls with the device tag (no host tag), each a different size: each rank's result is the float32
    rank-order sum of both inputs (every rank makes both, seeded), the ranks' bits agree, the tag advances."""
    for r in (0, 1):
        assert main_run[r]["exact"] == [True] * worker.CALLS, (r, main_run[r]["exact"])
        assert main_run[r]["tags"] == list(range(1, worker.CALLS + 1))
    assert main_run[0]["sums"] == main_run[1]["sums"]


def test_a_rank_that_never_publishes_stops_the_other_within_its_deadline(main_run) -> None:
    """Rank 1 stores but never publishes: rank 0 raises PeerWaitTimeout naming rank 1 and the reduce stage within
    its small deadline, its output is NaN; rank 1 (its own slot missing) times out too."""
    for r in (0, 1):
        t = main_run[r]["timeout"]
        assert (t["peer"], t["stage"], t["site"], t["nan"]) == (1, 1, 11, True), t
        assert f"rank {r} timed out in stage 'reduce' waiting for rank 1's push" in t["message"], t["message"]
        assert t["seconds"] < 5.0, t
    assert "this rank's own push" in main_run[1]["timeout"]["message"]


def test_buffers_come_through_the_allocator_and_the_tables_hold_this_rank_itself(main_run) -> None:
    """alloc is called once per buffer (it returns non-zero tensors: flags, record and tag are zeroed after);
    the own slot of each table is this rank's own buffer; no shared-memory file outlives the exchange; close."""
    for r in (0, 1):
        out = main_run[r]
        assert sorted(out["alloc_names"]) == ["peer_ctl", "peer_data", "peer_flags", "peer_tag"]
        assert out["zeroed"] == [0, 0, 0], out["zeroed"]  # nonzero entries of flags, record, tag
        assert out["own_ptrs"] == (True, True) and out["leftover_files"] == [] and out["closed"]


def test_ranks_asking_for_different_buffers_all_refuse_naming_the_field(main_run) -> None:
    for r in (0, 1):
        assert "the ranks disagree on 'capacity': rank 0: 64, rank 1: 128" in main_run[r]["mismatch"]
        assert "TPInfo says rank" in main_run[r]["wrong_tpinfo"]


def test_an_allocation_failure_on_one_rank_fails_every_rank_at_once(main_run) -> None:
    for r in (0, 1):
        msg = main_run[r]["alloc_failed"]
        assert "a rank failed before the exchange" in msg and "rank 1: could not allocate its buffers" in msg, msg
        assert "MemoryError: no room for peer_data" in msg and "rank 0:" not in msg, msg


def test_a_rank_that_died_before_the_exchange_fails_the_other_clearly_and_soon(tmp_path_factory) -> None:
    """Rank 1 exits after joining the group; rank 0's rendezvous raises PeerExchangeError naming itself and the
    step, well within the group's timeout (gloo sees the closed connection) and never hangs."""
    seen = run_ranks(tmp_path_factory, "die")
    name, msg, seconds = seen[0]["error"]
    assert name == "PeerExchangeError", (name, msg)
    assert "rank 0 of 2 failed in step 'share'" in msg and "Another rank died" in msg, msg
    assert seconds < worker.GROUP_TIMEOUT_S + 5, seconds


def test_a_rank_that_never_arrives_fails_the_other_at_the_group_timeout(tmp_path_factory) -> None:
    """Rank 1 is alive but never calls rendezvous: rank 0 raises PeerExchangeError at the group's timeout (3 s
    here), not later."""
    seen = run_ranks(tmp_path_factory, "absent")
    name, msg, seconds = seen[0]["error"]
    assert name == "PeerExchangeError" and "rank 0 of 2 failed in step 'share'" in msg, (name, msg)
    assert worker.ABSENT_TIMEOUT_S - 0.5 < seconds < worker.ABSENT_TIMEOUT_S + 5, seconds


def test_rendezvous_refuses_a_group_of_one() -> None:
    from lowlat.distributed import TPInfo
    from lowlat.runtime.peer_buffers import PeerBuffers

    with pytest.raises(ValueError, match=r"world must be in \[2, 8\]"):
        PeerBuffers.rendezvous(TPInfo(0, 1), 64, torch.float32, device="cpu")
