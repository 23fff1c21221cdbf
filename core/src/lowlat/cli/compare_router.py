"""The MoE router near-tie excuse of ``lowlat run --compare`` (docs/contract.md, "Tolerances").

In a bfloat16 or float16 MoE model a router whose k-th and (k+1)-th logits are within a few ulps can pick another
expert on the plugin's path than on the general path: their hidden states differ by an ulp or two (a plugin may
keep float32 where the general path rounds). One flipped expert moves the token's logits by 6-30% of their scale,
far beyond the logit near-tie bound, so greedy decoding may then diverge although both paths are correct. The
contract suite excuses one such divergence per run when the general path's router had a near-tie
(``lowlat.plugin.tolerance.router_near_tie_rows``) for that request at a step the plugin ran, at or before the
divergence; ``--compare`` applies the same rule.

The general run of ``--compare`` replays its steps in CUDA graphs, where module hooks do not fire. So when a
divergence needs the excuse, :func:`router_ties` runs the general path once more, eagerly (``cuda_graph`` off,
the same kernels and so the same tokens), with a forward hook on every MoE router (``SparseMoeBlock.gate``), and
attributes each DECODE or VERIFY step's near-tie rows to the requests of that step. Its tokens are returned too:
the excuse holds only where they equal the general run's up to the divergence.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from lowlat.config import EngineConfig
from lowlat.plugin.tolerance import router_gap_ulps, router_near_tie_rows


@dataclass(frozen=True)
class RouterTie:
    """A general-path router near-tie: the first token (index into the request's output) of the step that had it,
    the MoE layer (0-based, among the MoE layers) and the top-k boundary gap in ulps."""

    token: int
    layer: int
    gap_ulps: float


@dataclass
class RouterTies:
    """What :func:`router_ties` recorded: per request index, its near-ties in step order, and the eager run's
    tokens (to check it retraced the general run)."""

    ties: dict[int, list[RouterTie]] = field(default_factory=dict)
    token_ids: list[list[int]] = field(default_factory=list)

    def before(self, i: int, d: int, lo: int = 1) -> RouterTie | None:
        """Request ``i``'s first near-tie at a step the plugin ran and at or before its token ``d``, or None: at a
        token >= ``lo``, the first the plugin's steps made for it (1 where unknown: token 0 comes from the
        prefill, which runs on the general path in both runs; before ``lo`` both runs took the same general steps
        from the same inputs)."""
        return next((t for t in self.ties.get(i, []) if max(1, lo) <= t.token <= d), None)


def moe_blocks(model: Any) -> list[Any]:
    """The general model's MoE blocks (``lowlat.layers.moe.SparseMoeBlock``), in layer order; [] for a dense
    model or a plugin-only runner."""
    from lowlat.layers.moe import SparseMoeBlock

    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)] if model is not None else []


def record_router_ties(engine: Any, prompts: list[str], params: Any) -> RouterTies:
    """Generate ``prompts`` on ``engine`` (open, eager: no CUDA graphs, so module hooks fire) with router hooks,
    and return the near-ties each request's DECODE / VERIFY steps had (PREFILL steps are skipped: they run on the
    general path in both runs of ``--compare``). A VERIFY step's tie in a request's row m is attributed to the token
    that row made (the step's first token + m: attention is causal, so no earlier row sees it); a row past the
    step's last kept token (after the first rejected draft, or past a stop) made none, and counts for none."""
    blocks = moe_blocks(engine.runner.model)
    out = RouterTies()
    pending: list[tuple[int, list[int], torch.Tensor]] = []  # (layer, near-tie rows, their gaps) of this forward
    by_rid: dict[int, list[RouterTie]] = {}  # request id -> its ties; filed by prompt index once the run is done
    step_ties: list[tuple[Any, RouterTie]] = []  # (request, tie) of the step in flight, kept once its tokens are in

    def hook_for(layer: int, block: Any) -> Any:
        def hook(_mod: Any, _inp: Any, logits: torch.Tensor) -> None:
            rows = router_near_tie_rows(logits.detach(), block.top_k)
            if rows:
                pending.append((layer, rows, router_gap_ulps(logits.detach()[rows], block.top_k).cpu()))
        return hook

    def observe(step: Any, _logits: torch.Tensor) -> None:
        from lowlat.forward_batch import ForwardMode

        found, pending[:] = list(pending), []
        if step.mode is ForwardMode.PREFILL or not step.requests:
            return
        per_req = int(step.batch.input_ids.shape[0]) // len(step.requests)  # uniform rows per request
        for j, req in enumerate(step.requests):
            first = len(req.output_ids)  # the observer runs before the step's tokens are appended (Engine._run)
            for layer, rows, gaps in found:
                for r, g in zip(rows, gaps.tolist()):
                    if r // per_req == j:
                        step_ties.append((req, RouterTie(first + r % per_req, layer, g)))

    def appended(_step: Any) -> None:  # the step's tokens are at the end of output_ids now
        for req, tie in step_ties:
            if tie.token < len(req.output_ids):
                by_rid.setdefault(req.rid, []).append(tie)
        step_ties.clear()

    handles = [b.gate.register_forward_hook(hook_for(i, b)) for i, b in enumerate(blocks)]
    try:
        engine.logits_observer, engine.step_observer = observe, appended
        done = engine.generate(prompts, params)
        out.token_ids = [list(c.token_ids) for c in done]
        # by prompt index, not by first DECODE step: a request whose first token ended it never takes one
        out.ties = {i: by_rid[c.request_id] for i, c in enumerate(done) if c.request_id in by_rid}
    finally:
        engine.logits_observer = engine.step_observer = None
        for h in handles:
            h.remove()
    return out


def router_ties(config: EngineConfig, params: Any, prompts: list[str]) -> RouterTies:
    """The general path's router near-ties over ``prompts``: one more general run, eager (``cuda_graph`` off,
    overlap off), greedy, as ``--compare``'s general run took it."""
    from lowlat.runtime.engine import Engine

    cfg = replace(config, plugin="none", cuda_graph=False, overlap=False)
    with Engine(cfg) as engine:
        return record_router_ties(engine, prompts, params)
