"""The general forward's row-parallel all-reduces through peer buffers (``EngineConfig.all_reduce = "peer"``).

``ModelRunner`` at ``tp_size > 1`` with ``all_reduce="peer"``: before the model is built it puts a
``PeerAllReduce`` into the TPInfo every layer holds (``TPInfo.peer``); after the weights load, before the KV pool
is sized (so the buffers count as used memory), ``PeerAllReduce.open`` makes the group's ``PeerBuffers``
(``PeerBuffers.rendezvous``: a collective of every rank), sized for the largest DECODE or VERIFY step,
``max_batch_size x max_verify_tokens`` rows of ``hidden_size`` in the model's dtype. Each row-parallel call site
(``lowlat.distributed.all_reduce`` with a site: o_proj ``2 * layer``, down_proj or the MoE experts
``2 * layer + 1``) then sums through the one-launch ``peer_all_reduce`` with the device tag (capturable in CUDA
graphs) when its message fits, and through torch.distributed when it does not (PREFILL chunks of more rows):
the ranks run the same batches, so every rank takes the same path at every site.

Deadline: each wait gives up after half the step's deadline (``resolved_step_timeout_s``, so the precise error
comes before the step's own), at most 5 s on CUDA (nanoseconds, ``DEFAULT_DEADLINE_NS``); on CPU in polls of the
Triton interpreter, counted at ``CPU_POLLS_PER_S`` (a floor of the poll rate, so the wait ends first; there a rank's
host work between steps can keep its peers waiting for seconds). A wait that gave up leaves NaN in its output, so the
step's logits are not finite; the engine's finiteness check (``lowlat.runtime.step_guard.checked_picks``) calls
``check`` first, which raises the ``PeerWaitTimeout`` naming the rank, the peer and the call site.

"peer" has not been measured on a machine of two GPUs yet, so "nccl" stays the default.
"""

from __future__ import annotations

import torch

from lowlat.config import EngineConfig, ModelConfig
from lowlat.distributed import TPInfo
from lowlat.kernels.peer_allreduce import TIMER_NS, TIMER_POLLS, check_launchable, peer_all_reduce
from lowlat.runtime.peer_buffers import DEFAULT_DEADLINE_NS, Alloc, PeerBuffers

__all__ = ["CPU_POLLS_PER_S", "PeerAllReduce", "peer_capacity", "peer_factory", "wait_bound"]

# A floor of the interpreter's polls per second, so that a CPU wait gives up before the step's own deadline: 350-480
# were measured on a busy 2-core CPU (peer_buffers' docstring), under 200 with two TP ranks beside a test suite (the
# step deadline then fired first and the run ended with StepDeadlineExceeded, not the PeerWaitTimeout naming the site).
# At 400 polls/s a wait thus gives up after a quarter of its nominal time, still far above a step's work.
CPU_POLLS_PER_S = 100


def peer_capacity(config: EngineConfig, model_config: ModelConfig) -> int:
    """Elements per rank the buffers hold: the largest DECODE/VERIFY step's rows x hidden_size."""
    return config.max_batch_size * config.max_verify_tokens * model_config.hidden_size


def wait_bound(config: EngineConfig, device: torch.device) -> tuple[int, int]:
    """(timer, deadline) of every cross-rank wait: half the step deadline (``resolved_step_timeout_s``), at most
    ``DEFAULT_DEADLINE_NS`` on CUDA (nanoseconds), in interpreter polls on CPU (``CPU_POLLS_PER_S``)."""
    seconds = config.resolved_step_timeout_s / 2
    if device.type == "cuda":
        return TIMER_NS, max(1, int(min(seconds * 1e9, DEFAULT_DEADLINE_NS)))
    return TIMER_POLLS, max(1, int(seconds * CPU_POLLS_PER_S))


def peer_factory(tp: TPInfo, config: EngineConfig, device: torch.device):  # type: ignore[no-untyped-def]
    """The ``PluginBinding.peer_buffers`` rendezvous of this rank (plugin API 4): ``factory(capacity, dtype, block,
    alloc) -> PeerBuffers``, with the engine's ``wait_bound``.

    Raises (from the factory): ValueError: a CPU without TRITON_INTERPRET=1, sizes out of range, ranks asking for
    different buffers. PeerExchangeError: as ``PeerBuffers.rendezvous``.
    """
    def factory(capacity: int, dtype: torch.dtype, block: int, alloc: Alloc) -> PeerBuffers:
        check_launchable(device, "a plugin's peer buffers (tp_size > 1) on a CPU")
        timer, deadline = wait_bound(config, device)
        return PeerBuffers.rendezvous(tp, capacity, dtype, device=device, alloc=alloc, block=block,
                                      deadline=deadline, timer=timer)

    return factory


class PeerAllReduce:
    """``TPInfo.peer`` of a runner with ``all_reduce="peer"``: ``(x, site) -> x summed in place, or None``.

    Attributes:
        bufs: this rank's ``PeerBuffers`` once ``open`` ran (None before: every call returns None).
        calls: how many sums went through the peer buffers (for tests and reports).
    """

    def __init__(self) -> None:
        self.bufs: PeerBuffers | None = None
        self.calls = 0

    def open(self, tp: TPInfo, config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype,
             device: torch.device, alloc: Alloc | None = None) -> None:
        """Make the group's buffers (a collective: every rank calls it at the same point of its start-up).

        Raises:
            ValueError: a CPU without TRITON_INTERPRET=1 (before any collective: every rank has the same
                environment), or as ``PeerBuffers.rendezvous``. PeerExchangeError: as ``PeerBuffers.rendezvous``.
        """
        check_launchable(device, "all_reduce='peer' (--all-reduce peer) on a CPU")
        timer, deadline = wait_bound(config, device)
        self.bufs = PeerBuffers.rendezvous(tp, peer_capacity(config, model_config), dtype, device=device,
                                           alloc=alloc, deadline=deadline, timer=timer)

    def __call__(self, x: torch.Tensor, site: int) -> torch.Tensor | None:
        b = self.bufs
        if b is None or not b.fits(x):
            return None
        self.calls += 1
        return peer_all_reduce(x, b, out=x, site=site)

    def check(self) -> None:
        """Raise ``PeerWaitTimeout`` when a wait of this rank gave up (a host read of the error record)."""
        if self.bufs is not None and not self.bufs.closed:
            self.bufs.check()

    def close(self) -> None:
        if self.bufs is not None:
            self.bufs.close()
