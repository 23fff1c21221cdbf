"""``build(binding) -> MegaForward``: the entry the ModelSpecs name ("lowlat_nvidia_mega.build:build").

Runs after the general model's weights are loaded and before the KV pool is sized. It takes views of the
loaded parameters (no weight copies: the kernels read the brief's layouts directly), picks launch plans for
every GEMM shape and the attention's for every (batch, rows per request) from ``kernels.tuned_plans`` (measured
tables, else heuristics; no autotuning, so nothing tunes during CUDA-graph capture), allocates every
intermediate once through ``binding.alloc_workspace`` (so the memory is accounted before the KV pool is sized)
and registers for the KV pool with ``binding.on_kv_pool_ready``.
"""

from __future__ import annotations

import difflib
import os
from typing import Any

import torch
from lowlat.plugin import PluginBuildError

from lowlat_nvidia_mega.forward import LayerWeights, MegaForward, Workspaces
from lowlat_nvidia_mega.kernels.attention import AttnPlan, partial_numel
from lowlat_nvidia_mega.kernels.gemm_plans import MAX_ROWS, num_sms, splitk_workspace_numel
from lowlat_nvidia_mega.kernels.lm_head import CONFIG_ENV as LM_HEAD_CONFIG_ENV
from lowlat_nvidia_mega.kernels.lm_head import default_lm_head_config
from lowlat_nvidia_mega.kernels.moe import CONFIG_ENV as MOE_CONFIG_ENV
from lowlat_nvidia_mega.kernels.moe import MoEWorkspace, default_config
from lowlat_nvidia_mega.kernels.norm_rows import PRENORM_ENV, prenorm_switch
from lowlat_nvidia_mega.kernels.pdl import ENV_SWITCH as PDL_ENV
from lowlat_nvidia_mega.kernels.pdl import pdl_enabled
from lowlat_nvidia_mega.kernels.qkv_rope import qkv_workspace_numel
from lowlat_nvidia_mega.kernels.sampling import LMHeadWorkspace
from lowlat_nvidia_mega.kernels.small_gemm import PREFETCH_ENV, prefetch_act_enabled
from lowlat_nvidia_mega.kernels.tuned_plans import (
    TUNED_ENV,
    attn_plan,
    gemm_plan,
    prenorm_rows,
    qkv_plan,
    tuned_switch,
)
from lowlat_nvidia_mega.tp import FAULT_ENV, TP_REDUCE_ENV, open_tp, tp_reduce_mode

ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


PREFIX = "LOWLAT_MEGA_"
SWITCHES = (PDL_ENV, PREFETCH_ENV, PRENORM_ENV, TUNED_ENV, TP_REDUCE_ENV, MOE_CONFIG_ENV,  # README "Switches"
            LM_HEAD_CONFIG_ENV)
TEST_SWITCHES = ("LOWLAT_MEGA_COMPILE_CHECK", FAULT_ENV)  # read by the test suite only (FAULT_ENV: fault injection)


def check_switches() -> None:
    """Refuse, at build, what the switches read at each launch or step would refuse later, or would ignore: a
    ``LOWLAT_MEGA_*`` variable that names no switch (a misspelled switch would silently run, and measure, the
    default variant) and a value ``LOWLAT_MEGA_PREFETCH_ACT`` / ``LOWLAT_MEGA_PRENORM`` / ``LOWLAT_MEGA_TUNED`` does
    not parse (``LOWLAT_MEGA_PDL``, ``LOWLAT_MEGA_TP_REDUCE``, ``LOWLAT_MEGA_MOE_CONFIG`` and
    ``LOWLAT_MEGA_LM_HEAD_CONFIG`` too).

    Raises:
        PluginBuildError: naming each unknown variable, the closest switch and the known ones, or the bad value.
    """
    unknown = sorted(k for k in os.environ if k.startswith(PREFIX) and k not in SWITCHES + TEST_SWITCHES)
    if unknown:
        by_stem = {s[len(PREFIX):]: s for s in SWITCHES}  # matched after the shared prefix, which makes any name close
        hints = [f"{k}: did you mean {by_stem[close[0]]}?" for k in unknown
                 if (close := difflib.get_close_matches(k[len(PREFIX):], by_stem, n=1))]
        raise PluginBuildError(f"unknown nvidia_mega switch(es) {', '.join(unknown)}. {' '.join(hints)} "
                               f"Known: {', '.join(SWITCHES)}; rename or unset the unknown one(s)")
    for switch in (pdl_enabled, prefetch_act_enabled, prenorm_switch, tuned_switch, tp_reduce_mode, default_config,
                   default_lm_head_config):
        try:
            switch()
        except ValueError as e:
            raise PluginBuildError(str(e)) from None


def build(binding: Any) -> MegaForward:
    """Build the nvidia_mega forward for the model the binding carries.

    Args:
        binding: a ``lowlat.plugin.PluginBinding`` (model_config, engine_config, device, dtype, params,
            tp_size, alloc_workspace, on_kv_pool_ready).
    Returns:
        a MegaForward; it serves steps once the KV pool is attached.
    Raises:
        PluginBuildError: unsupported architecture, dtype, TP size or head_dim, a missing /
            misshapen parameter (the message names it and the fix), a bad ``LOWLAT_MEGA_PREFETCH_ACT`` /
            ``LOWLAT_MEGA_PRENORM`` / ``LOWLAT_MEGA_TUNED`` value, or an unknown ``LOWLAT_MEGA_*`` variable
            (``check_switches``).
    """
    mc, ec = binding.model_config, binding.engine_config
    dev, dt = torch.device(binding.device), binding.dtype
    if mc.architecture not in ARCHITECTURES:
        raise PluginBuildError(f"nvidia_mega builds {', '.join(ARCHITECTURES)}, not {mc.architecture}")
    if dt not in DTYPES:
        raise PluginBuildError(f"nvidia_mega runs bfloat16, float16 or float32 models, not {dt}")
    tp = binding.tp_size
    check_switches()
    d = mc.head_dim
    if d < 32 or d & (d - 1):
        raise PluginBuildError(f"nvidia_mega needs a power-of-two head_dim >= 32, got {d}")
    p = _Params(binding.params, dt, dev)
    sh = _Shard(mc, tp)
    hq, hkv, hid = sh.heads, sh.kv_heads, mc.hidden_size
    layers = [_layer(p, mc, i, sh) for i in range(mc.num_hidden_layers)]
    embed = p.get("model.embed_tokens.weight", (sh.vocab, hid))
    tied = mc.tie_word_embeddings and "lm_head.weight" not in binding.params
    lm_head = embed if tied else p.get("lm_head.weight", (sh.vocab, hid))
    final_norm = p.get("model.norm.weight", (hid,))

    sms = num_sms(dev)
    plans = {"qkv": qkv_plan(hq, hkv, d, hid, dt, dev, qk_norm=mc.has_qk_norm),
             "o_proj": gemm_plan(hid, hq * d, dt, dev)}
    dense_inter = sh.inter
    has_dense = any(not lw.is_moe for lw in layers)
    if has_dense:
        plans["gate_up"] = gemm_plan(dense_inter, hid, dt, dev, gated=True)
        plans["down"] = gemm_plan(hid, dense_inter, dt, dev)

    def alloc(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return binding.alloc_workspace(f"nvidia_mega.{name}", shape, dtype)

    f32 = torch.float32
    gemm_need = max(
        [splitk_workspace_numel(plans["o_proj"], hid, gated=False)]
        + ([splitk_workspace_numel(plans["gate_up"], dense_inter, gated=True),
            splitk_workspace_numel(plans["down"], hid, gated=False)] if has_dense else [])
    )
    tiles = {"qkv": hq + 2 * hkv, "o_proj": plans["o_proj"].n_tiles(hid)}
    if has_dense:
        tiles.update(gate_up=plans["gate_up"].n_tiles(dense_inter), down=plans["down"].n_tiles(hid))
    cnt = alloc("counters", (sum(tiles.values()),), torch.int32)
    cnt.zero_()
    counters, off = {}, 0
    for name, n in tiles.items():
        counters[name] = cnt[off:off + n]
        off += n
    attn_plans = {(b, r): attn_plan(b, r, hq, hkv, d, ec.max_context_len, sms, dt, device=dev)
                  for b in range(1, MAX_ROWS + 1) for r in range(1, MAX_ROWS // b + 1)}
    n_o, n_l = _attention_partials(hq, hkv, d, attn_plans)
    cos, sin = binding.rope_cos_sin()  # plugin API 2: the general path's tables
    cos_ws, sin_ws = alloc("rope_cos", tuple(cos.shape), f32), alloc("rope_sin", tuple(sin.shape), f32)
    cos_ws.copy_(cos)
    sin_ws.copy_(sin)
    head_config = default_lm_head_config()  # one read: the sampler's workspace and the launches share its tiles
    ws = Workspaces(
        x=alloc("x", (MAX_ROWS, hid), dt), q=alloc("q", (MAX_ROWS, hq * d), dt),
        attn=alloc("attn", (MAX_ROWS, hq * d), dt),
        act=alloc("act", (MAX_ROWS, dense_inter), dt) if has_dense else None,
        gemm_ws=alloc("gemm_splitk", (max(1, gemm_need),), f32),
        qkv_ws=alloc("qkv_splitk", (max(1, qkv_workspace_numel(plans["qkv"], hq, hkv, d)),), f32),
        counters=counters, o_partial=alloc("attn_o_partial", (n_o,), f32),
        lse_partial=alloc("attn_lse_partial", (n_l,), f32), cos=cos_ws, sin=sin_ws,
        h=alloc("prenorm_h", (MAX_ROWS, hid), dt),
        moe=_moe_workspace(mc, sh.moe_inter, dt, dev, alloc) if mc.is_moe else None,
        head=_head_workspace(mc, dev, alloc, head_config.block_v) if tp == 1 else None,  # at TP the engine samples
    )
    fwd = MegaForward(config=mc, device=dev, dtype=dt, embed=embed, final_norm=final_norm, lm_head=lm_head,
                      layers=layers, ws=ws, plans=plans, attn_plans=attn_plans,
                      prenorm_max_rows=prenorm_rows("moe" if mc.is_moe else "dense", hid, dt, dev), heads=(hq, hkv),
                      tp=open_tp(binding, hid, MAX_ROWS, dt) if tp > 1 else None, head_config=head_config)
    binding.on_kv_pool_ready(fwd.attach_kv_pool)
    return fwd


class _Params:
    """Looks parameters up by name, checking shape, dtype and device; errors name the parameter."""

    def __init__(self, params: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device) -> None:
        self.params, self.dtype, self.device = params, dtype, device

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = self.params.get(name)
        if t is None:
            raise PluginBuildError(f"nvidia_mega needs parameter {name!r}, which the loaded model lacks")
        if tuple(t.shape) != shape:
            raise PluginBuildError(f"parameter {name!r} is {tuple(t.shape)}, nvidia_mega expects {shape}")
        if t.dtype != self.dtype or t.device.type != self.device.type:
            raise PluginBuildError(f"parameter {name!r} is {t.dtype} on {t.device}; the model runs {self.dtype} on "
                                   f"{self.device}")
        return t if t.is_contiguous() else t.contiguous()


class _Shard:
    """This rank's sizes at ``tp`` ranks (the general model's sharding): query heads, KV heads (split, or one
    replicated head per rank), dense and expert intermediate sizes and vocabulary rows (``ceil(V / tp)``).

    Raises:
        PluginBuildError: a size ``tp`` does not divide (the general model refuses these first).
    """

    def __init__(self, mc: Any, tp: int) -> None:
        hkv, moe_inter = mc.num_key_value_heads, mc.moe_intermediate_size if mc.is_moe else 0
        if mc.num_attention_heads % tp or mc.intermediate_size % tp or (hkv % tp and tp % hkv) or moe_inter % tp:
            raise PluginBuildError(f"tp_size={tp} does not divide num_attention_heads={mc.num_attention_heads}, "
                                   f"intermediate_size={mc.intermediate_size}, moe_intermediate_size={moe_inter} "
                                   f"and num_key_value_heads={hkv}")
        self.heads, self.inter = mc.num_attention_heads // tp, mc.intermediate_size // tp
        self.moe_inter = moe_inter // tp
        self.kv_heads = hkv // tp if hkv % tp == 0 else 1
        self.vocab = -(-mc.vocab_size // tp)


def _layer(p: _Params, mc: Any, i: int, sh: _Shard) -> LayerWeights:
    pre, hid, d = f"model.layers.{i}.", mc.hidden_size, mc.head_dim
    hq, hkv = sh.heads, sh.kv_heads
    kw: dict[str, torch.Tensor | None] = {
        "input_norm": p.get(pre + "input_layernorm.weight", (hid,)),
        "qkv": p.get(pre + "self_attn.qkv_proj.weight", ((hq + 2 * hkv) * d, hid)),
        "o_proj": p.get(pre + "self_attn.o_proj.weight", (hid, hq * d)),
        "post_norm": p.get(pre + "post_attention_layernorm.weight", (hid,)),
    }
    if mc.has_qk_norm:
        kw["q_norm"] = p.get(pre + "self_attn.q_norm.weight", (d,))
        kw["k_norm"] = p.get(pre + "self_attn.k_norm.weight", (d,))
    if mc.is_moe_layer(i):
        e, inter = mc.num_experts, sh.moe_inter
        kw["router"] = p.get(pre + "mlp.gate.weight", (e, hid))
        kw["w13"] = p.get(pre + "mlp.experts.w13_weight", (e, 2 * inter, hid))
        kw["w2"] = p.get(pre + "mlp.experts.w2_weight", (e, hid, inter))
    else:
        kw["gate_up"] = p.get(pre + "mlp.gate_up_proj.weight", (2 * sh.inter, hid))
        kw["down"] = p.get(pre + "mlp.down_proj.weight", (hid, sh.inter))
    return LayerWeights(**kw)  # type: ignore[arg-type]


def _attention_partials(hq: int, hkv: int, d: int, attn_plans: dict[tuple[int, int], AttnPlan]) -> tuple[int, int]:
    """Largest (o_partial, lse_partial) fp32 sizes over the plans of every (batch, rows per request), B * R <= 8,
    for this rank's ``hq`` query and ``hkv`` KV heads of ``d``."""
    n_o = n_l = 1
    for (b, r), plan in attn_plans.items():
        o, lse = partial_numel(b, hq, hkv, d, r, plan)
        n_o, n_l = max(n_o, o), max(n_l, lse)
    return n_o, n_l


def _head_workspace(mc: Any, dev: torch.device, alloc: Any, block_v: int) -> LMHeadWorkspace:
    """The sampled-ids scratch (``specs.SAMPLING``): LM head tiles of ``block_v`` tokens (the engine's
    ``LMHeadConfig``: 128 unless ``LOWLAT_MEGA_LM_HEAD_CONFIG`` says otherwise), C = CANDIDATES.

    Raises:
        PluginBuildError: a ``block_v`` below CANDIDATES (a tile must hold the sampler's candidate list)."""
    from lowlat_nvidia_mega.specs import CANDIDATES

    if block_v < CANDIDATES:
        raise PluginBuildError(f"{LM_HEAD_CONFIG_ENV}: block_v={block_v} is below the sampler's {CANDIDATES} "
                               f"candidates per tile; use block_v >= {CANDIDATES}")

    count = iter(range(1 << 30))

    def head_alloc(shape: tuple[int, ...], *, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        return alloc(f"lm_head_sample.{next(count)}", tuple(shape), dtype)

    return LMHeadWorkspace.allocate(MAX_ROWS, mc.vocab_size, dev, block_v=block_v, candidates=CANDIDATES, fan_in=8,
                                    alloc=head_alloc)


def _moe_workspace(mc: Any, inter: int, dt: torch.dtype, dev: torch.device, alloc: Any) -> MoEWorkspace:
    count = iter(range(1 << 30))

    def moe_alloc(shape: tuple[int, ...], *, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        return alloc(f"moe.{next(count)}", tuple(shape), dtype)

    return MoEWorkspace.allocate(MAX_ROWS, mc.hidden_size, inter, mc.num_experts,
                                 mc.num_experts_per_tok, dt, dev, alloc=moe_alloc)
