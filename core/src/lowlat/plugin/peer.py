"""Cross-rank tiles for plugin kernels at tp_size > 1 (plugin API 4).

A plugin's build asks ``binding.peer_buffers(capacity, dtype)`` for this rank's ``PeerBuffers`` (every rank's
buffers mapped into every rank, allocated as accounted workspace, with the engine's wait deadline). Its kernels
then move tiles between ranks with the device functions below, whose protocol (layout, tags, parities, memory
order, deadlines, the error record) is ``lowlat.kernels.peer_allreduce``'s module docstring:

* ``device_tag(tag_state, 0)``: the call's tag, read by every program of every launch of the call, after the PDL
  wait (the previous call's last launch bumped it);
* ``publish_tile(v, offs, mask, ...)``: from an epilogue, store a tile into this rank's slot of every rank's
  ``data`` and release its flag ``flags[parity, tile, rank]`` on every rank;
* ``wait_tiles(own_flags + (parity * cap_tiles + tile) * WORLD, ...)``: poll one or ``NT`` consecutive tiles'
  flags with acquire loads until every rank published them, bounded by the deadline (a wait that gives up writes
  the error record that the engine turns into ``PeerWaitTimeout`` after the step, naming the rank, the awaited
  peer and the ``site`` the kernel passed);
* ``finish_call(tag_state, tag, nprog)``: at the end of the call's last launch, advance the device tag (so a call
  captures in a CUDA graph and each replay takes the next tag).

Sums are made in rank order in float32 by the waiting kernel, so every rank computes bit-identical values.
``peer_all_reduce`` is the whole one-launch all-reduce over the same buffers (e.g. for an embedding's partial
rows); ``all_gather_last_dim`` concatenates every rank's tensor along its last dim (``torch.distributed``, e.g. the
logits of a vocabulary-parallel LM head).
"""

from lowlat.distributed import TPInfo, all_gather_last_dim
from lowlat.kernels.peer_allreduce import (
    CTL_FIELDS,
    TAG_CYCLE,
    TIMER_NS,
    TIMER_POLLS,
    PeerBuffers,
    device_tag,
    finish_call,
    next_tag,
    peer_all_reduce,
    peer_push,
    peer_reduce,
    publish_tile,
    wait_tiles,
)

__all__ = ["CTL_FIELDS", "TAG_CYCLE", "TIMER_NS", "TIMER_POLLS", "PeerBuffers", "TPInfo", "all_gather_last_dim",
           "device_tag", "finish_call", "next_tag", "peer_all_reduce", "peer_push", "peer_reduce", "publish_tile",
           "wait_tiles"]
