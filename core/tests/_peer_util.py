"""Helpers of the peer all-reduce tests (test_peer_allreduce.py, test_peer_device_tag.py, test_peer_xproc.py):
the device, the sizes, simulated ranks, inputs whose float32 sum depends on the order of the additions, and the
rank-order sum they must equal."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from lowlat.kernels.peer_allreduce import CTL_FIELDS
from lowlat.runtime.peer_buffers import PeerBuffers

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: the interpreter (conftest.py)
CPU = DEV.type == "cpu"
N, CAP, BLOCK = 40, 64, 16  # 3 tiles, the last one partial; room for 4
DEADLINE = 25 if CPU else 200_000_000  # polls under the interpreter (~0.1 s here), 0.2 s on a GPU
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def make(world: int, dtype: torch.dtype = torch.float32, deadline: int = DEADLINE, **kw) -> list[PeerBuffers]:
    return PeerBuffers.simulated(world, CAP, dtype, device=DEV, block=BLOCK, deadline=deadline, **kw)


def inputs(world: int, dtype: torch.dtype, seed: int = 0, n: int = N) -> list[torch.Tensor]:
    """One contribution per rank, magnitudes a factor 4 apart from rank to rank: the float32 sum depends on the
    order of the additions, so a reduction in another order gives other bits."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=g) * 4.0 ** r).to(DEV, dtype) for r in range(world)]


def rank_order_sum(xs: list[torch.Tensor]) -> torch.Tensor:
    """(((x0 + x1) + x2) + ...) in float32, cast once to the inputs' dtype. Triton 3.9's interpreter casts
    float32 -> bf16 by truncation (the GPU and torch round to nearest even), so on CPU bf16 is truncated here too."""
    acc = torch.zeros(xs[0].shape, dtype=torch.float32, device=xs[0].device)
    for x in xs:
        acc = acc + x.float()
    if xs[0].device.type == "cpu" and xs[0].dtype == torch.bfloat16:
        return (acc.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)
    return acc.to(xs[0].dtype)


def record(b: PeerBuffers) -> dict[str, int]:
    return dict(zip(CTL_FIELDS, b.ctl.tolist(), strict=True))


@contextmanager
def guard(bufs: list[PeerBuffers], seconds: float = 30.0) -> Iterator[None]:
    """Fails the test if a wait ignores its deadline: after ``seconds`` a thread sets every rank's abort word
    (-1), which stops the interpreted waits, and the test fails instead of hanging. No help on a GPU (the write
    queues behind the kernel); there the device deadline is the only bound."""
    fired = threading.Event()

    def stop() -> None:
        fired.set()
        for b in bufs:
            b.ctl[0] = -1

    timer = threading.Timer(seconds, stop)
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
    assert not fired.is_set(), f"a wait ignored its deadline: the test stopped it after {seconds} s"
