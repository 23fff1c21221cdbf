"""Router near-ties of the general path's MoE layers, recorded during a greedy run (docs/contract.md, "Tolerances").

In a low-precision MoE model a router whose k-th and (k+1)-th logits are within a few rounding steps of each other
can pick another expert on the plugin's path than on the general path (the plugin sums experts in float32, the
general path rounds each one, so the hidden states, and the router logits computed from them, differ by an ulp or
two). That one flip moves the token's logits by 6-30% of their scale, so greedy decoding may then diverge with a
margin far beyond the logit tolerance. On an H200, nvidia_mega on tiny-qwen3-moe (bf16; 8 prompt seeds, greedy
runs all-plugin and alternating, bench/results/2026-11-30-h200-router-flips) jumped from 0.06-0.1 to 1-9 logits
at five steps, each at a router gap of 0 or 2 ulps in that step; CPU runs flipped at gaps of 0 and 1 ulp.

``RouterTieRecorder`` hooks the general model's ``SparseMoeBlock.gate`` modules (the general forward is eager in
the contract harness, so forward hooks fire) and records, per request, the steps at which any layer's top-k
boundary gap was at most ``TIE_ULPS`` ulps of the router logits' dtype: twice the largest flipping gap seen.
``compare_greedy`` excuses one divergence per run, for a request with such a step at or before the divergence
and not before the first step the plugin ran (earlier steps ran on the general path in both runs, so their
routing cannot have flipped).
"""

from __future__ import annotations

from typing import Any

import torch
from lowlat.plugin.tolerance import ROUTER_TIE_ULPS, router_gap_ulps, router_near_tie_rows  # noqa: F401

TIE_ULPS = ROUTER_TIE_ULPS  # the rule lives in core (lowlat.plugin.tolerance), which lowlat run --compare shares
near_tie_rows = router_near_tie_rows


class _GateHooks:
    """A forward hook on every general-path MoE router (``SparseMoeBlock.gate``) while the context is active;
    subclasses give ``_hook(block)``."""

    def __init__(self, model: Any) -> None:
        from lowlat.layers.moe import SparseMoeBlock

        self.blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)] if model is not None else []
        self._handles: list[Any] = []

    def _hook(self, block: Any) -> Any:
        raise NotImplementedError

    def __enter__(self) -> Any:
        self._handles = [b.gate.register_forward_hook(self._hook(b)) for b in self.blocks]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


class RouterTieRecorder(_GateHooks):
    """Context manager: while active, ``ties[request]`` = the steps with a router near-tie for that request.

    ``begin_step(step, rows_per_request)`` must be called before each forward: ``rows_per_request[i]`` = router
    rows (tokens) request i contributes to that step, in batch order. Models without MoE layers record nothing.
    """

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        self.ties: dict[int, list[int]] = {}
        self._step = 0
        self._owner: list[int] = []

    def begin_step(self, step: int, rows_per_request: list[int]) -> None:
        self._step = step
        self._owner = [i for i, n in enumerate(rows_per_request) for _ in range(n)]

    def _hook(self, block: Any) -> Any:
        def hook(_mod: Any, _inp: Any, out: torch.Tensor) -> None:
            if out.shape[0] != len(self._owner):
                return  # a forward the recorder was not told about (rows unknown): record nothing
            for r in near_tie_rows(out.detach(), block.top_k):
                steps = self.ties.setdefault(self._owner[r], [])
                if self._step not in steps:
                    steps.append(self._step)
        return hook



def tie_rows(model: Any, forward: Any, num_tokens: int) -> tuple[Any, frozenset[int]]:
    """Run ``forward()`` (one step of ``num_tokens`` tokens through the general model) and return its result and
    the tokens (batch order) whose router had a near-tie in any MoE layer (empty for dense or float32 models)."""
    rec = RouterTieRecorder(model)
    rec.begin_step(0, [1] * num_tokens)
    with rec:
        out = forward()
    return out, frozenset(rec.ties)


class RoutingRecorder(_GateHooks):
    """Context manager: records each general-path MoE layer's top-k expert ids ``topk[layer]`` (int64 [T, k],
    CPU) and the rows at a near-tie (``near_ties``) of the one forward run inside it."""

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        self.topk: list[torch.Tensor] = []
        self.near_ties: set[int] = set()

    def _hook(self, block: Any) -> Any:
        def hook(_mod: Any, _inp: Any, out: torch.Tensor) -> None:
            lg = out.detach()
            self.topk.append(lg.float().topk(block.top_k, dim=-1).indices.cpu())
            self.near_ties.update(near_tie_rows(lg, block.top_k))
        return hook



def routing_diff_rows(general: list[torch.Tensor], plugin: list[torch.Tensor]) -> set[int]:
    """Rows (tokens) whose set of selected experts differs in any layer between the two paths' top-k ids
    (lists of int [T, k] in layer order; ``general`` and ``plugin`` must have the same layers and rows)."""
    rows: set[int] = set()
    for g, p in zip(general, plugin):
        gs, ps = g.sort(dim=-1).values, p.sort(dim=-1).values
        rows.update((gs != ps).any(dim=-1).nonzero().flatten().tolist())
    return rows


def routing_excuses(model: Any, forward: Any, num_tokens: int,
                    plugin_routing: list[torch.Tensor] | None) -> tuple[Any, frozenset[int]]:
    """Run ``forward()`` (one general-path step of ``num_tokens`` tokens) and return its result and the rows whose
    MoE routing may differ between the two paths by rounding: the general path's near-tie rows (``near_tie_rows``
    in any MoE layer: where a flip is possible) and, when the plugin exposes its routing (``plugin_routing``, same
    layers and rows as the general model's MoE layers), only those of them where the two paths' top-k really
    differ. A row whose routing differs away from any near-tie is not excused: its selection was not flipped by
    rounding but by a defect (wrong router, expert ids off by one, or an earlier layer's error large enough to
    move the router's input; the second audit's mutants, ``plugins/mutants/audit2.py``). Dense models: always
    empty."""
    rec = RoutingRecorder(model)
    with rec:
        out = forward()
    if not rec.blocks:
        return out, frozenset()
    usable = plugin_routing is not None and len(plugin_routing) == len(rec.topk) and all(
        p.shape == g.shape for p, g in zip(plugin_routing, rec.topk))
    if usable:
        return out, frozenset(r for r in routing_diff_rows(rec.topk, plugin_routing)
                              if r < num_tokens and r in rec.near_ties)
    return out, frozenset(r for r in rec.near_ties if r < num_tokens)
