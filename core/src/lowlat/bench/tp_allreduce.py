"""The all-reduce alone, per message size, on one rank of ``lowlat.bench.tp_bench``: NCCL against the one-shot peer.

Sizes: ``T x hidden`` elements in the model dtype for each batch size T (a DECODE step's row-parallel output),
then ``cfg.ar_kib`` KiB messages. Two ways per size:

* ``nccl``: ``torch.distributed.all_reduce`` on the default group (NCCL on GPUs, gloo on CPU), in place on a zero
  tensor (the sum stays zero, so values never grow; NCCL's time does not depend on them);
* ``peer``: core's ``PeerBuffers.rendezvous`` + ``peer_all_reduce`` (device tag, ``out`` separate from ``x``).

On CUDA each way is captured ``cfg.ar_calls`` times into one CUDA graph, and each replay is timed with CUDA events
(µs per call = replay time / calls); on CPU each call is timed eagerly with ``time.perf_counter``. Before timing,
one eager call of each way on ``x = rank + 1`` is checked against ``W (W + 1) / 2`` (a wrong sum is an error,
not a number).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lowlat.bench.measure import describe_error
from lowlat.bench.timing import summarize, synchronize, time_steps, warm_up


def agree(err: str | None, sync: Any, world: int) -> str | None:
    """None when no rank reports an error, else every rank's error ("rank r: ...") joined: the same on every rank."""
    errs: list[Any] = [None] * world
    dist.all_gather_object(errs, err, group=sync)
    bad = [(r, e) for r, e in enumerate(errs) if e]
    if not bad:
        return None
    if len({e for _, e in bad}) == 1 and len(bad) == world:
        return bad[0][1]
    return "; ".join(f"rank {r}: {e}" for r, e in bad)


def barrier(device: torch.device, sync: Any) -> None:
    """Finish this rank's queued device work, then wait for every rank (gloo, the group's timeout)."""
    synchronize(device)
    dist.barrier(group=sync)


def sizes(cfg: Any, hidden: int, elem: int) -> list[tuple[str, int]]:
    """(label, elements) per message: ``T x hidden`` for each batch size, then each KiB size (rounded down)."""
    out = [(f"{t} x {hidden}", t * hidden) for t in cfg.batch_sizes]
    out += [(f"{k} KiB", max(1, k * 1024 // elem)) for k in cfg.ar_kib]
    return list(dict.fromkeys(out))


def _timed(fn: Any, cfg: Any, device: torch.device, sync: Any) -> dict[str, Any]:
    """µs per call of ``fn`` (Stats dict in µs): a CUDA graph of ``cfg.ar_calls`` calls on CUDA, eager on CPU."""

    calls = cfg.ar_calls if device.type == "cuda" else 1
    if device.type == "cuda":
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # every rank issues the same calls, warm-up included
            for _ in range(3):
                fn()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        barrier(device, sync)
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()

        def step(i: int) -> None:
            graph.replay()
    else:

        def step(i: int) -> None:
            fn()

    warm_up(step, cfg.ar_warmup, device)
    barrier(device, sync)
    ms = time_steps(step, cfg.ar_iters, device)
    barrier(device, sync)
    return {**summarize([1e3 * m / calls for m in ms]).as_dict(), "calls_per_sample": calls}


def _check_sum(got: torch.Tensor, world: int, way: str) -> None:
    want = world * (world + 1) / 2
    if not bool((got.float() == want).all()):
        raise RuntimeError(f"{way} all-reduce of rank + 1 over {world} ranks gave {got.float().unique()[:4].tolist()}, "
                           f"expected {want}")


def measure_all_reduce(cfg: Any, ctx: Any, sync: Any) -> dict[str, Any]:
    """Every size, both ways: ``{"dtype", "hidden", "sizes": [{"label", "elements", "bytes", "nccl_us",
    "peer_us"} ...], "peer_error"}``; a way that fails at a size has ``<way>_error`` instead of its figures
    (agreed over ranks: each size ends on every rank, so no rank waits on a failed peer)."""
    from lowlat.config import DTYPES
    from lowlat.kernels.peer_allreduce import peer_all_reduce
    from lowlat.loader import resolve_model
    from lowlat.runtime.peer_buffers import PeerBuffers

    device, world, rank = ctx.device, cfg.world, ctx.tp.rank
    dtype = DTYPES[cfg.dtype]
    hidden = resolve_model(cfg.model).hidden_size
    elem = torch.empty((), dtype=dtype).element_size()
    todo = sizes(cfg, hidden, elem)
    out: dict[str, Any] = {"dtype": cfg.dtype, "hidden": hidden, "sizes": [], "peer_error": None}
    bufs, err = None, None
    try:
        bufs = PeerBuffers.rendezvous(ctx.tp, max(n for _, n in todo), dtype, device=device)
    except Exception as e:
        err = describe_error(e)
    out["peer_error"] = agree(err, sync, world)
    try:
        for label, n in todo:
            rec: dict[str, Any] = {"label": label, "elements": n, "bytes": n * elem}
            xn = torch.full((n,), float(rank + 1), dtype=dtype, device=device)  # NCCL sums in place
            xp, y = xn.clone(), torch.empty_like(xn)
            ways = {"nccl": lambda x=xn: dist.all_reduce(x)}
            if bufs is not None and out["peer_error"] is None:
                ways["peer"] = lambda x=xp, y=y: peer_all_reduce(x, bufs, out=y)
            for way, fn in ways.items():
                fig, err = None, None
                try:
                    if way == "nccl":
                        fn()
                        _check_sum(xn, world, way)
                        xn.zero_()  # timed on zeros: the sum stays zero
                    else:
                        fn()
                        bufs.check()  # type: ignore[union-attr]
                        _check_sum(y, world, way)
                    fig = _timed(fn, cfg, device, sync)
                    if way == "peer":
                        bufs.check()  # type: ignore[union-attr]
                except Exception as e:
                    err = describe_error(e)
                bad = agree(err, sync, world)
                rec[f"{way}_us" if not bad else f"{way}_error"] = fig if not bad else bad
            out["sizes"].append(rec)
    finally:
        if bufs is not None:
            bufs.close()
    return out
