"""The parameter binder: ``bind_params(binding)`` gives a plugin its weights per decoder layer, by role.

``binding.params`` holds the general model's parameters by name (docs/writing-a-plugin.md lists them).
``bind_params`` reads them once, checks each shape against the model configuration and this rank's TP share,
and returns a ``ModelParams`` whose ``layers[i]`` is a ``LayerParams`` naming every tensor layer ``i`` uses.
The tensors are the loaded parameters themselves (no copy), in the general model's layout (``[out, in]``,
what ``F.linear`` takes), so a plugin that perturbs nothing and copies nothing sees every weight change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, overload

import torch

from lowlat.errors import PluginBuildError


@dataclass
class LayerParams:
    """One decoder layer's parameters, general layout (per TP rank). None: the model has no such tensor.

    Attributes:
        input_norm, post_norm: [H] RMSNorm weights before attention and before the MLP.
        qkv: [(Hq + 2 Hkv) D, H], q heads then k heads then v heads; qkv_bias: [(Hq + 2 Hkv) D] or None.
        q_norm, k_norm: [D] (Qwen3) or None.
        o_proj: [H, Hq D]; o_bias: [H] or None (added once, after the TP all-reduce).
        gate_up: [2 I, H] gate rows then up rows, down: [H, I] (dense layers; None in MoE layers);
        gate_up_bias: [2 I], down_bias: [H] (Llama's ``mlp_bias``; down's is added after the all-reduce) or None.
        router: [E, H], w13: [E, 2 I, H], w2: [E, H, I] (MoE layers; None in dense layers).
    """

    input_norm: torch.Tensor
    qkv: torch.Tensor
    o_proj: torch.Tensor
    post_norm: torch.Tensor
    qkv_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    gate_up: torch.Tensor | None = None
    down: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    router: torch.Tensor | None = None
    w13: torch.Tensor | None = None
    w2: torch.Tensor | None = None

    @property
    def is_moe(self) -> bool:
        """Whether this layer is a sparse MoE block (router and experts) rather than a dense MLP."""
        return self.router is not None


@dataclass
class ModelParams:
    """The whole model's parameters by role: embedding, final norm, LM head and the layers.

    Attributes:
        embed: [V_local, H] (vocab-parallel); vocab_start: the first token id of this rank's rows.
        final_norm: [H]; lm_head: [V_local, H] (the embedding tensor itself when the model ties them).
        layers: one LayerParams per decoder layer.
    """

    embed: torch.Tensor
    vocab_start: int
    final_norm: torch.Tensor
    lm_head: torch.Tensor
    layers: list[LayerParams]


def bind_params(binding: Any) -> ModelParams:
    """Read ``binding.params`` into a ModelParams, checking every shape.

    Raises:
        PluginBuildError: a parameter the architecture needs is missing, or has a shape that does not fit the
            model configuration (the message names the parameter, both shapes and the plugin).
    """
    c, p = binding.model_config, binding.params
    plugin = getattr(binding, "plugin", "?")

    @overload
    def get(name: str, shape: tuple[int | None, ...] | None = None, *, optional: Literal[False] = False
            ) -> torch.Tensor: ...
    @overload
    def get(name: str, shape: tuple[int | None, ...] | None = None, *, optional: bool) -> torch.Tensor | None: ...
    def get(name: str, shape: tuple[int | None, ...] | None = None, *, optional: bool = False) -> torch.Tensor | None:
        t = p.get(name)
        if t is None:
            if optional:
                return None
            raise PluginBuildError(f"plugin {plugin!r}: binding.params lacks {name!r}, which "
                                   f"{c.architecture} needs (docs/writing-a-plugin.md lists the names)")
        t = t.detach()
        if shape is not None and (t.dim() != len(shape) or any(w is not None and w != g
                                                               for w, g in zip(shape, t.shape))):
            raise PluginBuildError(f"plugin {plugin!r}: {name} has shape {tuple(t.shape)}, expected "
                                   f"{tuple('*' if w is None else w for w in shape)}")
        return t

    h, d = c.hidden_size, c.head_dim
    embed = get("model.embed_tokens.weight", (None, h))
    lm_head = get("lm_head.weight", (None, h), optional=True)
    layers = []
    for i in range(c.num_hidden_layers):
        pre = f"model.layers.{i}."
        qkv = get(pre + "self_attn.qkv_proj.weight", (None, h))
        lp = LayerParams(
            input_norm=get(pre + "input_layernorm.weight", (h,)), qkv=qkv,
            o_proj=get(pre + "self_attn.o_proj.weight", (h, None)),
            post_norm=get(pre + "post_attention_layernorm.weight", (h,)),
            qkv_bias=get(pre + "self_attn.qkv_proj.bias", (qkv.shape[0],), optional=True),
            q_norm=get(pre + "self_attn.q_norm.weight", (d,), optional=True),
            k_norm=get(pre + "self_attn.k_norm.weight", (d,), optional=True),
            o_bias=get(pre + "self_attn.o_proj.bias", (h,), optional=True))
        if pre + "mlp.experts.w13_weight" in p:
            lp.router = get(pre + "mlp.gate.weight", (None, h))
            lp.w13 = get(pre + "mlp.experts.w13_weight", (lp.router.shape[0], None, h))
            lp.w2 = get(pre + "mlp.experts.w2_weight", (lp.router.shape[0], h, None))
        else:
            lp.gate_up = get(pre + "mlp.gate_up_proj.weight", (None, h))
            lp.down = get(pre + "mlp.down_proj.weight", (h, None))
            lp.gate_up_bias = get(pre + "mlp.gate_up_proj.bias", (lp.gate_up.shape[0],), optional=True)
            lp.down_bias = get(pre + "mlp.down_proj.bias", (h,), optional=True)
        layers.append(lp)
    return ModelParams(embed=embed, vocab_start=binding.tp_rank * embed.shape[0],
                       final_norm=get("model.norm.weight", (h,)), lm_head=lm_head if lm_head is not None else embed,
                       layers=layers)
