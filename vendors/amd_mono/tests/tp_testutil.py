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


def config(world: int, model: str = "tiny-llama") -> ModelConfig:
    """``model`` (tiny-llama or tiny-qwen3-moe), with 6 query / 3 KV heads, a 96-wide MLP and 48-wide experts where
    3 ranks must divide them."""
    cfg = get_preset(model)
    return dataclasses.replace(cfg, num_attention_heads=6, num_key_value_heads=3, intermediate_size=96,
                               moe_intermediate_size=48 if cfg.num_experts else 0) if world == 3 else cfg


def rank_params(cfg: ModelConfig, world: int, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """Random parameters of one rank's shapes (values scaled to keep activations O(1))."""
    dm = P.Dims.from_config(cfg, world)
    h, d = dm.hidden, dm.head_dim
    g = torch.Generator().manual_seed(seed)
    shapes = {"model.embed_tokens.weight": (dm.vocab, h), "lm_head.weight": (dm.vocab, h), "model.norm.weight": (h,)}
    for i in range(dm.layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "self_attn.qkv_proj.weight": (dm.qkv_rows, h),
                   p + "self_attn.o_proj.weight": (h, dm.heads * d), p + "post_attention_layernorm.weight": (h,)}
        if dm.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
        if dm.moe_layers[i]:
            e, im = dm.experts, dm.moe_inter
            shapes |= {p + "mlp.gate.weight": (e, h), p + "mlp.experts.w13_weight": (e, 2 * im, h),
                       p + "mlp.experts.w2_weight": (e, h, im)}
        else:
            shapes |= {p + "mlp.gate_up_proj.weight": (2 * dm.inter, h), p + "mlp.down_proj.weight": (h, dm.inter)}
    out = {}
    for k, shp in shapes.items():
        t = torch.rand(shp, generator=g) + 0.5 if len(shp) == 1 else torch.randn(shp, generator=g) / shp[-1] ** 0.5
        out[k] = t.to(dtype)
    return out


def decode_batch(rows: int) -> ForwardBatch:
    """A DECODE batch of ``rows`` requests (only its shape matters: the tests launch K2's stages from o_proj on)."""
    return ForwardBatch.build(ForwardMode.DECODE, torch.zeros(rows, dtype=torch.int64), [3] * rows, [1] * rows,
                              list(range(rows)), torch.arange(rows), torch.device("cpu"))


def make_ranks(world: int, rows: int, dtype: torch.dtype, *, deadline: int | None = None,
               silent: int | None = None, seed: int = 0, model: str = "tiny-llama",
               **opts) -> tuple[list[MonoForward], list[PeerBuffers]]:
    """``world`` MonoForwards of ``model`` (stage-per-launch mode; ``opts``: more MonoOptions) over simulated peer
    buffers; ``silent``: the rank that stores its tiles but never releases its flags (fault injection)."""
    cfg = config(world, model)
    bufs = PeerBuffers.simulated(world, P.MAX_ROWS * cfg.hidden_size, dtype, block=16, deadline=deadline)
    v_l = -(-cfg.vocab_size // world)
    fwds = []
    for r in range(world):
        tp = MonoTP(tp=None, bufs=bufs[r], publish=r != silent, vocab_size=cfg.vocab_size, vocab_start=r * v_l,
                    vocab_rows=v_l)
        fwds.append(make_forward(cfg, rank_params(cfg, world, dtype, seed * 100 + r), dtype, tp, **opts))
    return fwds, bufs


def make_forward(cfg: ModelConfig, params: dict[str, torch.Tensor], dtype: torch.dtype, tp: MonoTP | None,
                 **opts) -> MonoForward:
    """A MonoForward over ``params`` on CPU (stage-per-launch mode unless ``opts`` say otherwise), its KV pool
    attached; ``tp`` None: tp_size 1."""

    def alloc(name, shape, dt):
        return torch.zeros(shape, dtype=dt)

    fwd = MonoForward(model_config=cfg, params=params, dtype=dtype, device=torch.device("cpu"), alloc_workspace=alloc,
                      max_context_len=MAX_CTX, options=MonoOptions(**{"staged": True, **opts}), tp=tp)
    dm = fwd.dims
    fwd.attach_kv_pool(KVPool(num_layers=dm.layers, num_pages=8, page_size=4, num_kv_heads=dm.kv_heads,
                              head_dim=dm.head_dim, dtype=dtype, device=torch.device("cpu"), max_reqs=8,
                              max_context_len=MAX_CTX))
    return fwd


def run_stages(fwds: list[MonoForward], stages: tuple[int, ...], rows: int, layer: int = 0) -> None:
    """Launch each of ``stages`` of layer ``layer``'s K2 on every rank, rank after rank, stage after stage (a
    tp_size 1 forward runs its own K2)."""
    batch = decode_batch(rows)
    for s in stages:
        for fwd in fwds:
            shape = fwd.plan.step_shape(rows, 1)
            name, kernel, items, args, meta = fwd.k2_launch(layer, batch, shape)
            assert name.endswith("_tp") == (fwd.tp is not None) and s in items
            kernel[(items[s],)](*args, STAGE=s, **meta, num_warps=4, num_stages=1)


def set_inputs(fwds, rows: int, dtype: torch.dtype, seed: int, integer: bool = False):
    """The same residual x on every rank, each rank's own attention output; returns (x0, [ao_r])."""
    g = torch.Generator().manual_seed(seed)
    h, ko = fwds[0].dims.hidden, fwds[0].attn_out.shape[1]
    if integer:
        x0 = (torch.randint(-64, 65, (rows, h), generator=g) / 16).to(dtype)
        aos = [torch.randint(-16, 17, (rows, ko), generator=g).to(dtype) for _ in fwds]
    else:
        x0 = torch.randn(rows, h, generator=g).to(dtype)
        aos = [torch.randn(rows, ko, generator=g).to(dtype) for _ in fwds]
    for fwd, ao in zip(fwds, aos):
        fwd.x[:rows] = x0
        fwd.attn_out[:rows] = ao
        for t in (fwd.q, fwd.kv_pool.k_buffers[0], fwd.kv_pool.v_buffers[0]):  # for the tests that run attention
            t.copy_(torch.randn(t.shape, generator=g).to(dtype))
    return x0, aos


def general_reduce(res: torch.Tensor, partials: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The general path: each partial rounded (F.linear's output), the fp32 rank-order sum rounded once, the
    residual added and rounded."""
    acc = partials[0].to(dtype).float()
    for p in partials[1:]:
        acc = acc + p.to(dtype).float()
    return (res.float() + acc.to(dtype).float()).to(dtype)


def check_persistent_k2(stages: tuple[int, ...], waiting: str, *, model: str = "tiny-llama", launch: str | None = None,
                        rows: int = 3) -> None:
    """Rank 0's K2 (of ``model``) as one persistent launch over one program (interpreter), its peer's tiles forged
    from a staged run of both ranks over ``stages`` (rank 1's slots and flags copied, rank 0's own flags cleared):
    x_mid and x bit-identical to the staged run, the tag at the layer's second protocol call. Then the o_proj
    reduce never publishes its amd_mono flags: ``pers.check_errors()`` must raise MonoStageTimeout matching
    ``waiting`` (the stage that waits on the reduce). ``launch``: the K2 launch's expected name, if given."""
    import pytest
    from lowlat_amd_mono.forward import MonoStageTimeout

    world = 2
    staged, bufs_s = make_ranks(world, rows, torch.bfloat16, seed=9, model=model)
    set_inputs(staged, rows, torch.bfloat16, seed=9)
    run_stages(staged, stages, rows)
    assert not torch.isnan(staged[0].x[:rows]).any()
    for attempt in ("same", "never_publish"):
        (pers, *rest), bufs_p = make_ranks(world, rows, torch.bfloat16, seed=9, model=model, staged=False,
                                           deadline_ms=1.0)
        set_inputs([pers, *rest], rows, torch.bfloat16, seed=9)
        bufs_p[0].data.copy_(bufs_s[0].data)
        bufs_p[0].flags.copy_(bufs_s[0].flags)
        bufs_p[0].flags[:, :, 0] = 0  # rank 0 must publish its own tiles again
        pers.step.fill_(5)  # the local step tag (the embedding launch bumps it in a whole step)
        if attempt == "never_publish":
            pers.set_debug(0, never_publish=(P.S_RED_O,))
        assert pers.runner.nprog == 1 and not pers.options.staged
        name, *args = pers.k2_launch(0, decode_batch(rows), pers.plan.step_shape(rows, 1))
        assert launch is None or name == launch
        pers.runner.run(name, *args)
        bufs_p[0].check()
        if attempt == "same":
            pers.check_errors()
            assert torch.equal(pers.x_mid[:rows], staged[0].x_mid[:rows])
            assert torch.equal(pers.x[:rows], staged[0].x[:rows])
            assert bufs_p[0].last_tag == 2
        else:
            with pytest.raises(MonoStageTimeout, match=waiting):
                pers.check_errors()
