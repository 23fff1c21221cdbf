"""The weights the kernels read: looked up by the general model's names and checked, and the per-layer pointer
table of the one-launch step (``kernels.step``)."""

from __future__ import annotations

from typing import Any

import torch

from lowlat_amd_mono.kernels import plan as P
from lowlat_amd_mono.kernels import step as S


def bind_weights(params: dict[str, torch.Tensor], dm: P.Dims, dtype: torch.dtype) -> dict[str, Any]:
    """Look up and check every parameter the kernels read (names and layouts of the general model).

    Returns ``{"embed", "lm_head", "norm": tensor, "layers": [per-layer dict]}``. Raises ValueError naming a
    missing parameter or one of the wrong shape, dtype or layout."""

    def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in params:
            raise ValueError(f"amd_mono needs parameter {name!r} {list(shape)}; it is missing from the loaded model")
        t = params[name]
        if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"parameter {name!r} is {list(t.shape)} {t.dtype} (contiguous={t.is_contiguous()}); "
                             f"amd_mono needs a contiguous {list(shape)} {dtype}")
        return t

    h, d = dm.hidden, dm.head_dim
    embed = get("model.embed_tokens.weight", (params["model.embed_tokens.weight"].shape[0], h)
                if "model.embed_tokens.weight" in params else (dm.vocab, h))
    lm_name = "lm_head.weight" if "lm_head.weight" in params else "model.embed_tokens.weight"
    lm = get(lm_name, (params[lm_name].shape[0], h) if lm_name in params else (dm.vocab, h))
    if lm.shape[0] < dm.vocab:
        raise ValueError(f"{lm_name} has {lm.shape[0]} rows, fewer than this rank's vocabulary rows ({dm.vocab})")
    layers = []
    for i in range(dm.layers):
        p = f"model.layers.{i}."
        lw = {"ln1": get(p + "input_layernorm.weight", (h,)),
              "qkv": get(p + "self_attn.qkv_proj.weight", (dm.qkv_rows, h)),
              "o": get(p + "self_attn.o_proj.weight", (h, dm.heads * d)),
              "ln2": get(p + "post_attention_layernorm.weight", (h,))}
        if dm.qk_norm:
            lw["q_norm"] = get(p + "self_attn.q_norm.weight", (d,))
            lw["k_norm"] = get(p + "self_attn.k_norm.weight", (d,))
        else:
            lw["q_norm"] = lw["k_norm"] = lw["ln1"]  # unread when QK_NORM is off
        if dm.moe_layers[i]:
            lw["router"] = get(p + "mlp.gate.weight", (dm.experts, h))
            lw["w13"] = get(p + "mlp.experts.w13_weight", (dm.experts, 2 * dm.moe_inter, h))
            lw["w2"] = get(p + "mlp.experts.w2_weight", (dm.experts, h, dm.moe_inter))
        else:
            lw["gate_up"] = get(p + "mlp.gate_up_proj.weight", (2 * dm.inter, h))
            lw["down"] = get(p + "mlp.down_proj.weight", (h, dm.inter))
        layers.append(lw)
    return {"embed": embed, "lm_head": lm, "norm": get("model.norm.weight", (h,)), "layers": layers}


def layer_pointers(weights: dict[str, Any], k_buffers: list[torch.Tensor], v_buffers: list[torch.Tensor],
                   moe: bool) -> tuple[torch.Tensor, str | None]:
    """The one-launch step's pointer table: int64 ``[layers, step.WTAB_COLS]`` on the CPU holding each layer's
    data pointers in the ``step.COL_*`` columns (dense: gate_up, down in ``COL_MLP_A/B``; MoE: router, w13, w2 in
    ``COL_MLP_A/B/C``), and None, or None and the reason the table cannot be used (a tensor not 16-byte
    aligned: the kernel tells Triton every table pointer is)."""
    rows = []
    for i, lw in enumerate(weights["layers"]):
        mlp = (lw["router"], lw["w13"], lw["w2"]) if moe else (lw["gate_up"], lw["down"], lw["down"])
        cols = {S.COL_LN1: lw["ln1"], S.COL_QKV: lw["qkv"], S.COL_QNORM: lw["q_norm"], S.COL_KNORM: lw["k_norm"],
                S.COL_O: lw["o"], S.COL_LN2: lw["ln2"], S.COL_MLP_A: mlp[0], S.COL_MLP_B: mlp[1], S.COL_MLP_C: mlp[2],
                S.COL_KC: k_buffers[i], S.COL_VC: v_buffers[i]}
        row = [0] * S.WTAB_COLS
        for c, t in cols.items():
            if t.data_ptr() % 16:
                return None, f"layer {i}'s tensor for pointer-table column {c} is not 16-byte aligned"
            row[c] = t.data_ptr()
        rows.append(row)
    return torch.tensor(rows, dtype=torch.int64), None
