"""Tolerances widened by a step's measured conditioning, for stress steps that low precision cannot resolve.

The dtype bounds of ``cases.Tolerance`` assume a well-conditioned step: each rounding moves the output by about
its unit roundoff. Attention scores in the hundreds (``stress.scale_attention_scores``) break that in
bfloat16: rounding q and k to 8 bits moves a score s by about |s| * 2^-8 (0.4-1.2 at s = 100-300), the softmax
over such scores is nearly one-hot, and which key dominates can change; the next layer amplifies it. Two correct
bfloat16 implementations then differ by far more than the dtype bound (seen on the H200 at q/k x 12 on
tiny-qwen3: 3.5 in a logit of scale 8, the same for nvidia_mega and amd_mono against the general path), and
neither is the exact answer.

So the bound is measured, not assumed: a float32 twin of the engine (the same weights, upcast; the same prompts)
runs the same step on the general path; the general path's own distance to it, per row, is what rounding to the
dtype costs at this step. A plugin of the same precision may be that far from the exact answer in its own
direction, so it may be up to ``FACTOR`` times that far from the general path (2 for the two errors adding up,
times 2 for a plugin that rounds in other places), and never less than the dtype bound. A defect that this
stress targets (a softmax without its running maximum: exp overflows past 88, inf / inf = NaN) still fails: the
NaN check comes first, and gross errors stay far outside the widened bound.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from lowlat_contract.cases import Tolerance

FACTOR = 4.0


@dataclass
class Conditioned:
    """``base`` widened per row by ``FACTOR`` x |general - float32 twin| (module docstring).

    ``refs`` maps "logits" ([R, vocab] float32) and "kv" ([T, 2 * layers * Hkv * D], the layout ``check_step``
    compares) to the twin's outputs for the step; ``check`` picks the one its ``what`` names ("K/V" -> kv).
    Duck-types ``Tolerance`` where ``oracle.check_step`` uses it.
    """

    base: Tolerance
    refs: dict[str, torch.Tensor] = field(default_factory=dict)

    def check(self, got: torch.Tensor, want: torch.Tensor, what: str,
              tie_rows: frozenset[int] = frozenset()) -> str | None:
        ref = self.refs.get("kv" if "K/V" in what else "logits")
        if ref is None or ref.shape != want.shape:
            return self.base.check(got, want, what, tie_rows)
        spread = (want.float() - ref.float()).abs().reshape(want.shape[0], -1)
        return self.base.check(got, want, what, tie_rows,
                               floor=(FACTOR * spread.amax(dim=1), FACTOR * spread.mean(dim=1)))


def float32_twin(runner: Any, make_runner: Any) -> Any:
    """A float32 ModelRunner (``make_runner("float32")``) holding ``runner``'s weights upcast, parameter by
    parameter. Raises ValueError when the two models' parameter names differ."""
    twin = make_runner("float32")
    mine, theirs = dict(runner.model.named_parameters()), dict(twin.model.named_parameters())
    if mine.keys() != theirs.keys():
        twin.close()
        raise ValueError(f"float32 twin: parameters differ: {sorted(mine.keys() ^ theirs.keys())[:4]}")
    with torch.no_grad():
        for name, p in theirs.items():
            p.copy_(mine[name].float())
    return twin


def twin_outputs(twin: Any, batch: Any) -> dict[str, torch.Tensor]:
    """The twin's general-path logits and the K/V rows it stores at the step's slots, in ``check_step``'s
    layout (``Conditioned.refs``); the twin's cache is left as the step wrote it."""
    from lowlat_contract.oracle import kv_rows

    with torch.inference_mode():
        logits = twin.general_forward(batch).float().clone()
    kv = kv_rows(twin.kv_pool, batch.out_cache_loc)
    return {"logits": logits, "kv": kv.transpose(0, 1).reshape(batch.out_cache_loc.numel(), -1).clone()}
