"""Epilogue publishing at tp_size > 1: a row-parallel GEMM's output tiles go straight to every rank.

At TP each rank's o_proj / down GEMM computes a partial ``[T, H]`` (its slice of the reduction). Instead of
storing it and all-reducing it in a separate launch, the GEMM's epilogue (``EPILOGUE == 3``, "publish") rounds each
``[T, BLOCK_N]`` tile to the activation dtype (as ``F.linear`` rounds before the general path's all-reduce) and
publishes it through ``lowlat.plugin.peer.publish_tile``: the tile lands at elements ``row * H + col`` of this
rank's slot in every rank's peer buffer, and flag ``tile = program's column tile`` is released on every rank. The
next launch, ``tp_reduce.reduce_rows``, waits for those flags tile by tile, sums the ranks in order and adds the
residual (and the next norm). A program publishes only its own tile, so tiles go out while other tiles are still
computing; nothing is written to the GEMM's ``out``.

The tag: the GEMM reads the device tag (``device_tag``) after its PDL wait; the reduce that ends the call reads
the same tag and advances it (``finish_call``). Design source: the issue's reference design (NVIDIA plugin:
epilogue stores into peer buffers with step-tagged flags, consumer started early through PDL).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

try:
    from lowlat.plugin.peer import device_tag, publish_tile
except ImportError:  # a core before plugin API 4: specs.py keeps tp_size at 1, so EPILOGUE 3 never compiles

    @triton.jit
    def device_tag(tag_ptr, host_tag):
        tl.static_assert(False, "epilogue publishing needs lowlat's plugin API 4 (lowlat.plugin.peer)")

    @triton.jit
    def publish_tile(v, offs, mask, data_ptrs, flag_ptrs, tag, rank, cap, cap_tiles, tile, publish,
                     WORLD: tl.constexpr):
        tl.static_assert(False, "epilogue publishing needs lowlat's plugin API 4 (lowlat.plugin.peer)")

from lowlat_nvidia_mega.kernels.rounding import to_act

PUBLISH = 3  # EPILOGUES["publish"]


@dataclass(frozen=True)
class PeerTarget:
    """Where a "publish" epilogue sends its tiles: this rank's ``PeerBuffers`` (``binding.peer_buffers``).

    ``publish`` False stores the tiles but never releases their flags: fault injection (a rank that never
    arrives), so every rank's ``reduce_rows`` gives up at its deadline naming this rank.
    """

    bufs: Any
    publish: bool = True

    @property
    def cap_tiles(self) -> int:
        """Flag tiles per parity (``ceil(capacity / block)``): the largest column-tile count a GEMM may publish."""
        return -(-self.bufs.capacity // self.bufs.block)


def peer_launch_args(peer: PeerTarget | None, dummy: torch.Tensor) -> dict[str, Any]:
    """The publish arguments of a GEMM launch (placeholders that are never read when ``peer`` is None)."""
    if peer is None:
        return dict(data_ptrs=dummy, flag_ptrs=dummy, tag_ptr=dummy, rank=0, cap=0, cap_tiles=0, publish=0, WORLD=1)
    b = peer.bufs
    return dict(data_ptrs=b.data_ptrs, flag_ptrs=b.flag_ptrs, tag_ptr=b.tag_state, rank=b.rank, cap=b.capacity,
                cap_tiles=peer.cap_tiles, publish=int(peer.publish), WORLD=b.world)


def check_publish(peer: PeerTarget | None, epilogue: str, out: torch.Tensor, n_tiles: int) -> None:
    """Refuse a "publish" launch without a target, a target for another epilogue, or a tile grid or ``out`` the
    buffers cannot hold (naming the sizes).

    Raises:
        ValueError: as above.
    """
    if (epilogue == "publish") != (peer is not None):
        raise ValueError("epilogue 'publish' takes peer=PeerTarget(...) and no other epilogue does; got epilogue "
                         f"{epilogue!r} with peer={'given' if peer is not None else 'None'}")
    if peer is None:
        return
    b = peer.bufs
    if out.dtype != b.dtype or out.device != b.device or out.numel() > b.capacity or n_tiles > peer.cap_tiles:
        raise ValueError(f"publishing {tuple(out.shape)} {out.dtype} in {n_tiles} tiles needs peer buffers of that "
                         f"dtype on {out.device} with >= {out.numel()} elements and >= {n_tiles} flag tiles; these "
                         f"hold {b.capacity} x {b.dtype} on {b.device} in {peer.cap_tiles} tiles")


@triton.jit
def publish_epilogue(acc, offs_m, offs_n, mask, N, dt: tl.constexpr, data_ptrs, flag_ptrs, tag_ptr, rank, cap,
                     cap_tiles, tile, publish, WORLD: tl.constexpr):
    """Round the fp32 tile ``acc`` [rows, BLOCK_N] to ``dt`` and publish it as column tile ``tile`` of a [T, N]
    output (``lowlat.plugin.peer.publish_tile``) under the current device tag."""
    tag = device_tag(tag_ptr, 0)
    publish_tile(to_act(acc, dt), offs_m[:, None] * N + offs_n[None, :], mask, data_ptrs, flag_ptrs, tag, rank, cap,
                 cap_tiles, tile, publish, WORLD)
