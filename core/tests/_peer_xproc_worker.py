"""One rank of test_peer_xproc.py: a spawned process that joins a 2-rank gloo group, runs a scenario with
``PeerBuffers.rendezvous`` and the one-launch ``peer_all_reduce``, and puts what it saw on a queue.

On CPU the kernels run under the Triton interpreter (TRITON_INTERPRET=1 is inherited from the test process); on
CUDA both ranks share cuda:0 (CUDA IPC within one device) and the deadline is %globaltimer nanoseconds.
"""

from __future__ import annotations

import datetime
import os
import time
import traceback
from typing import Any

GROUP_TIMEOUT_S = 20  # the gloo group's timeout: bounds every exchange step
CALLS = 4


def _scenario_main(tp: Any, device: Any, out: dict[str, Any]) -> None:
    """Bad inputs first, then a good rendezvous, CALLS consecutive sums with the device tag, a rank that never
    publishes, close."""
    import torch
    import torch.distributed as dist
    from _peer_util import inputs, rank_order_sum
    from lowlat.distributed import TPInfo
    from lowlat.kernels.peer_allreduce import peer_all_reduce
    from lowlat.runtime.peer_buffers import PeerBuffers, PeerExchangeError, PeerWaitTimeout

    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    cap, block = 64, 16
    try:
        PeerBuffers.rendezvous(TPInfo(1 - tp.rank, 2), cap, dtype, device=device, block=block)
    except ValueError as e:
        out["wrong_tpinfo"] = str(e)
    try:  # rank 1 asks for twice the capacity: every rank must refuse, naming the field
        PeerBuffers.rendezvous(tp, cap * (1 + tp.rank), dtype, device=device, block=block)
    except ValueError as e:
        out["mismatch"] = str(e)

    def failing(name: str, shape: tuple[int, ...], dt: torch.dtype) -> torch.Tensor:
        raise MemoryError(f"no room for {name}")

    try:  # rank 1's allocator fails: it tells rank 0 in the exchange, so both fail now, not at the timeout
        PeerBuffers.rendezvous(tp, cap, dtype, device=device, block=block, alloc=failing if tp.rank else None)
    except PeerExchangeError as e:
        out["alloc_failed"] = str(e)
    names: list[str] = []

    def alloc(name: str, shape: tuple[int, ...], dt: torch.dtype) -> torch.Tensor:
        names.append(name)
        return torch.full(shape, 7, dtype=dt, device=device)  # not zero: flags, record and tag must be zeroed

    deadline = 5_000_000_000 if cuda else 4_000
    bufs = PeerBuffers.rendezvous(tp, cap, dtype, device=device, block=block, deadline=deadline, alloc=alloc)
    out["alloc_names"] = names
    out["zeroed"] = [int(t.count_nonzero()) for t in (bufs.flags, bufs.ctl, bufs.tag_state)]
    out["leftover_files"] = [f for f in os.listdir("/dev/shm") if f.startswith(f"lowlat-peer-{os.getpid()}-")] \
        if os.path.isdir("/dev/shm") else []
    out["own_ptrs"] = (bufs.data_ptrs[tp.rank].item() == bufs.data.data_ptr(),
                       bufs.flag_ptrs[tp.rank].item() == bufs.flags.data_ptr())
    out["sums"], out["exact"], out["tags"] = [], [], []
    for k in range(CALLS):
        xs = inputs(2, dtype, seed=100 + k, n=40 + 8 * k)  # every rank makes both inputs: they know the answer
        xs = [x.to(device) for x in xs]
        dist.barrier()
        got = peer_all_reduce(xs[tp.rank], bufs)
        bufs.check()
        out["sums"].append(got.float().cpu().tolist())
        out["exact"].append(torch.equal(got, rank_order_sum(xs)))
        out["tags"].append(bufs.last_tag)
    # Fault injection: rank 1 stores its data but never publishes; a small deadline.
    bufs.deadline = 200_000_000 if cuda else 40  # 0.2 s, or 40 polls (~0.1 s)
    x = inputs(2, dtype, seed=9)[tp.rank].to(device)
    dist.barrier()
    t0 = time.monotonic()
    got = peer_all_reduce(x, bufs, site=11, publish=tp.rank != 1)
    try:
        bufs.check()
    except PeerWaitTimeout as e:
        out["timeout"] = {"message": str(e), "peer": e.peer, "stage": e.stage, "site": e.site,
                          "seconds": time.monotonic() - t0, "nan": bool(torch.isnan(got).all())}
    dist.barrier()
    bufs.close()
    out["closed"] = bufs.closed


def _scenario_die(tp: Any, device: Any, out: dict[str, Any]) -> None:
    """Rank 1 dies after joining the group, before the exchange; rank 0 must fail with a clear error."""
    import torch
    from lowlat.runtime.peer_buffers import PeerBuffers

    if tp.rank == 1:
        os._exit(3)
    time.sleep(0.5)  # rank 1 is gone by now
    t0 = time.monotonic()
    try:
        PeerBuffers.rendezvous(tp, 64, torch.float32, device=device, block=16)
    except Exception as e:
        out["error"] = (type(e).__name__, str(e), time.monotonic() - t0)


def _scenario_absent(tp: Any, device: Any, out: dict[str, Any]) -> None:
    """Rank 1 stays alive but never calls rendezvous (it sleeps past the group's timeout, ABSENT_TIMEOUT_S);
    rank 0 must fail at that timeout."""
    import torch
    from lowlat.runtime.peer_buffers import PeerBuffers

    if tp.rank == 1:
        time.sleep(ABSENT_TIMEOUT_S + 1.5)
        return
    t0 = time.monotonic()
    try:
        PeerBuffers.rendezvous(tp, 64, torch.float32, device=device, block=16)
    except Exception as e:
        out["error"] = (type(e).__name__, str(e), time.monotonic() - t0)


ABSENT_TIMEOUT_S = 3
SCENARIOS = {"main": (_scenario_main, GROUP_TIMEOUT_S), "die": (_scenario_die, GROUP_TIMEOUT_S),
             "absent": (_scenario_absent, ABSENT_TIMEOUT_S)}  # scenario -> (function, the group's timeout in s)


def main(rank: int, init_method: str, scenario: str, device_type: str, results: Any) -> None:
    """Join the group as ``rank`` of 2, run ``scenario``, put (rank, what it saw) on ``results``."""
    import torch
    import torch.distributed as dist
    from lowlat.distributed import TPInfo

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    try:
        fn, timeout_s = SCENARIOS[scenario]
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=timeout_s))
        device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
        fn(TPInfo(rank, 2, None), device, out)
    except BaseException:
        out["crash"] = traceback.format_exc()
    results.put((rank, out))
    if dist.is_initialized():
        dist.destroy_process_group()
