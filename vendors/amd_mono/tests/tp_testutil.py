"""Helpers of the amd_mono TP kernel tests: W simulated ranks in one process (``PeerBuffers.simulated``), each a
MonoForward over random shards of the rank's shapes, and K2's stages launched rank after rank (under the
interpreter a launch runs to its end before the next starts, so every rank publishes before any rank reduces)."""

from __future__ import annotations

import dataclasses

import torch
from lowlat.config import ModelConfig
from lowlat.forward_batch import ForwardBatch, ForwardMode
from lowlat.kv_cache import KVPool
from lowlat.loader.presets import get_preset
from lowlat.runtime.peer_buffers import PeerBuffers
from lowlat_amd_mono.forward import MonoForward
from lowlat_amd_mono.kernels import plan as P
from lowlat_amd_mono.kernels.launch import MonoOptions
from lowlat_amd_mono.tp import MonoTP

MAX_CTX = 64


def config(world: int) -> ModelConfig:
    """tiny-llama, with 6 query / 3 KV heads and a 96-wide MLP where 3 ranks must divide them."""
    cfg = get_preset("tiny-llama")
    return dataclasses.replace(cfg, num_attention_heads=6, num_key_value_heads=3, intermediate_size=96) \
        if world == 3 else cfg


def rank_params(cfg: ModelConfig, world: int, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """Random parameters of one rank's shapes (values scaled to keep activations O(1))."""
    dm = P.Dims.from_config(cfg, world)
    h, d = dm.hidden, dm.head_dim
    g = torch.Generator().manual_seed(seed)
    shapes = {"model.embed_tokens.weight": (dm.vocab, h), "lm_head.weight": (dm.vocab, h), "model.norm.weight": (h,)}
    for i in range(dm.layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "self_attn.qkv_proj.weight": (dm.qkv_rows, h),
                   p + "self_attn.o_proj.weight": (h, dm.heads * d), p + "post_attention_layernorm.weight": (h,),
                   p + "mlp.gate_up_proj.weight": (2 * dm.inter, h), p + "mlp.down_proj.weight": (h, dm.inter)}
    out = {}
    for k, shp in shapes.items():
        t = torch.rand(shp, generator=g) + 0.5 if len(shp) == 1 else torch.randn(shp, generator=g) / shp[-1] ** 0.5
        out[k] = t.to(dtype)
    return out


def _batch(rows: int) -> ForwardBatch:
    """A DECODE batch of ``rows`` requests (only its shape matters: the tests launch K2's stages from o_proj on)."""
    return ForwardBatch.build(ForwardMode.DECODE, torch.zeros(rows, dtype=torch.int64), [3] * rows, [1] * rows,
                              list(range(rows)), torch.arange(rows), torch.device("cpu"))


def make_ranks(world: int, rows: int, dtype: torch.dtype, *, deadline: int | None = None,
               silent: int | None = None, seed: int = 0, **opts) -> tuple[list[MonoForward], list[PeerBuffers]]:
    """``world`` MonoForwards (stage-per-launch mode; ``opts``: more MonoOptions) over simulated peer buffers;
    ``silent``: the rank that stores its tiles but never releases its flags (fault injection)."""
    cfg = config(world)
    bufs = PeerBuffers.simulated(world, P.MAX_ROWS * cfg.hidden_size, dtype, block=16, deadline=deadline)
    v_l = -(-cfg.vocab_size // world)
    fwds = []
    for r in range(world):
        tp = MonoTP(tp=None, bufs=bufs[r], publish=r != silent, vocab_size=cfg.vocab_size, vocab_start=r * v_l,
                    vocab_rows=v_l)

        def alloc(name, shape, dt):
            return torch.zeros(shape, dtype=dt)

        fwd = MonoForward(model_config=cfg, params=rank_params(cfg, world, dtype, seed * 100 + r), dtype=dtype,
                          device=torch.device("cpu"), alloc_workspace=alloc, max_context_len=MAX_CTX,
                          options=MonoOptions(**{"staged": True, **opts}), tp=tp)
        dm = fwd.dims
        fwd.attach_kv_pool(KVPool(num_layers=dm.layers, num_pages=8, page_size=4, num_kv_heads=dm.kv_heads,
                                  head_dim=dm.head_dim, dtype=dtype, device=torch.device("cpu"), max_reqs=8,
                                  max_context_len=MAX_CTX))
        fwds.append(fwd)
    return fwds, bufs


def run_stages(fwds: list[MonoForward], stages: tuple[int, ...], rows: int, layer: int = 0) -> None:
    """Launch each of ``stages`` of layer ``layer``'s K2 on every rank, rank after rank, stage after stage."""
    batch = _batch(rows)
    for s in stages:
        for fwd in fwds:
            shape = fwd.plan.step_shape(rows, 1)
            name, kernel, items, args, meta = fwd.k2_launch(layer, batch, shape)
            assert name == "k2_attn_out_mlp_tp" and s in items
            kernel[(items[s],)](*args, STAGE=s, **meta, num_warps=4, num_stages=1)
