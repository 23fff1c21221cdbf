"""``lowlat run --compare``: the same prompts, greedy, on the general path and with the plugin.

The two engines run one after the other (the first is closed before the second starts, so a model that
fills the GPU is never loaded twice). Each records the float32 logits of every sampled row; the report
says whether the tokens are identical (how many were compared: greedy, so exactly), the
largest logit difference over the steps where both runs had produced the same tokens so far (after a
divergence the inputs differ and logits are not comparable; reported, not judged), the near-tie tolerance
a differing token is classified by, and the decode speed of each side by side (times only, no ratio, under
TRITON_INTERPRET=1). Its verdict (``CompareReport.exit_status``): identical tokens, or every request's first
differing token a near-tie within the bound (docs/contract.md's rule for greedy tokens), exit 0; any other
difference exits 1, and ``strict`` (``--compare-strict``) exits 1 on any difference. In a bfloat16 / float16 MoE
model one first difference per run that is no logit near-tie is also accepted when the general path's router had
a near-tie for that request at a step the plugin ran, at or before it (the contract's router rule;
``compare_router.py`` records the ties with one more, eager, general run, made only when a divergence needs it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from lowlat.cli.compare_router import RouterTie, RouterTies, moe_blocks, router_ties
from lowlat.config import EngineConfig
from lowlat.platform import triton_interpreter_enabled
from lowlat.plugin.tolerance import MAX_REL, ROUTER_TIE_ULPS

# The contract's per-element bound relative to max(1, max |logits|) (docs/contract.md, "Tolerances"; the values
# are lowlat.plugin.tolerance's, which the contract suite checks with): a greedy divergence is a near-tie when the
# general path's logit of its token exceeds that of the plugin's token by at most this much.
NEAR_TIE_REL = {getattr(torch, name): rel for name, rel in MAX_REL.items()}


def near_tie_rel(dtype: torch.dtype) -> float:
    """``dtype``'s near-tie bound; a dtype the contract has no bound for gets bfloat16's."""
    return NEAR_TIE_REL.get(dtype, NEAR_TIE_REL[torch.bfloat16])


@dataclass
class RunRecord:
    """One side of the comparison."""

    label: str
    plugin: str | None
    token_ids: list[list[int]]
    logits: dict[int, list[torch.Tensor]]  # request index -> one float32 [V] row per sampled token (CPU)
    decode_ms_per_step: float
    decode_tokens_per_s: list[float]
    path_steps: dict[str, dict[str, Any]]
    dtype: torch.dtype = torch.float32
    moe_layers: int = 0  # MoE blocks of the general model (0: dense, or no general model loaded)
    plugin_from: dict[int, int] | None = None  # request index -> first token a plugin-path step made (None: unknown)


@dataclass
class CompareReport:
    general: RunRecord
    plugin: RunRecord
    identical: bool
    first_divergence: list[int | None]  # per request: index of the first differing token, None if identical
    max_abs_logit_diff: float
    interpreted: bool = False  # TRITON_INTERPRET=1: Triton kernels ran in Python, so no speed ratio is printed
    logit_rows: int = 0  # logits rows (one per sampled token) that max_abs_logit_diff is over
    router: RouterTies | None = None  # the general path's router near-ties, recorded when a divergence needs them

    @property
    def tokens_compared(self) -> int:
        """Token positions compared, over all requests: each request's up to and including its first difference
        (where one side ended with the same tokens so far, the positions both sides have)."""
        return sum(len(a) if d is None else min(d + 1, len(a), len(b))
                   for a, b, d in zip(self.general.token_ids, self.plugin.token_ids, self.first_divergence))

    def lines(self) -> list[str]:
        """Human-readable report lines: the verdict with the token counts and the tolerance, divergences, speed."""
        g, p = self.general, self.plugin
        rel = near_tie_rel(g.dtype)
        dtype = str(g.dtype).removeprefix("torch.")
        n = len(g.token_ids)
        out = [f"tokens identical: {'yes' if self.identical else 'NO'} ({self.tokens_compared} tokens compared over "
               f"{n} request{'s' if n != 1 else ''}; general made {sum(map(len, g.token_ids))}, {p.label} "
               f"{sum(map(len, p.token_ids))}; greedy, so tokens are compared exactly: a request's first differing "
               f"token is accepted only at a near-tie, below)",
               f"largest |logit difference| over matching steps: {self.max_abs_logit_diff:.4g} ({self.logit_rows} "
               f"logits rows compared; reported, not judged)",
               f"near-tie tolerance at a differing token: the general path's logit of its token exceeds that of the "
               f"plugin's by <= {rel:.3g} x max(1, max |logit|) ({dtype}: docs/contract.md's per-element bound); "
               f"a first differing token within it is accepted (exit 0), --compare-strict accepts none"]
        for i, d in enumerate(self.first_divergence):
            if d is None:
                continue
            out.append(f"  request {i}: first differing token at position {d}: general "
                       f"{g.token_ids[i][d] if d < len(g.token_ids[i]) else '-'}, plugin "
                       f"{p.token_ids[i][d] if d < len(p.token_ids[i]) else '-'}")
            tie = near_tie(self, i, d)
            out.append(f"    {tie}" if tie else "    nothing to judge a near-tie by (one side ended there, or no "
                       "logits were recorded for it): not a near-tie")
            if self.router is not None and not self.differs_at_near_tie(i):
                out.append(f"    {self._router_line(i, d)}")
        speedup = g.decode_ms_per_step / p.decode_ms_per_step if p.decode_ms_per_step else float("nan")
        ratio = (f"{speedup:.2f}x" if not self.interpreted else "no speed ratio: under TRITON_INTERPRET=1 Triton "
                 "kernels run in Triton's Python interpreter, so these times are not speed figures")
        out.append(f"decode ms/step: general {g.decode_ms_per_step:.3f}, {p.label} {p.decode_ms_per_step:.3f} "
                   f"({ratio})")
        counts = [f"{path} {mode} {v['steps']} ({v['graph_steps']} in CUDA graphs, {v['ms_per_step']:.3f} ms each)"
                  for path, modes in sorted(p.path_steps.items()) for mode, v in sorted(modes.items())]
        out.append(f"steps per path in the plugin run: {'; '.join(counts) or 'none'}")
        return out

    def differs_at_near_tie(self, i: int) -> bool:
        """Whether request ``i``'s first differing token is a near-tie within the bound (False: identical, or not)."""
        d = self.first_divergence[i]
        judged = None if d is None else tie_gap(self, i, d)
        return judged is not None and judged[0] <= judged[1]

    def router_excuse(self, i: int) -> RouterTie | None:
        """The router near-tie that excuses request ``i``'s first difference, or None. Only one request per run
        is excused so: the lowest-numbered one that needs it and has such a tie (as the contract suite's
        ``compare_greedy`` excuses one divergence per run, the first a tie precedes), and only where the eager run
        retraced the general run's tokens up to the difference."""
        if self.router is None:
            return None
        for j in range(len(self.first_divergence)):
            if self._router_may_excuse(j) and self._router_tie(j) is not None:
                return self._router_tie(j) if j == i else None
        return None

    def _router_may_excuse(self, i: int) -> bool:
        """Whether request ``i``'s first difference is one the router rule judges: a differing token (not one side
        ending where the other goes on with the same tokens so far: no flipped expert explains that) that is no
        logit near-tie."""
        d = self.first_divergence[i]
        return (d is not None and d < min(len(self.general.token_ids[i]), len(self.plugin.token_ids[i]))
                and not self.differs_at_near_tie(i))

    def _router_tie(self, i: int) -> RouterTie | None:
        """Request ``i``'s router near-tie at or before its first difference where the eager run retraced the
        general tokens up to it (whether or not another request takes the run's one excuse), else None."""
        d = self.first_divergence[i]
        if self.router is None or d is None:
            return None
        lo = self._plugin_from(i)
        return self.router.before(i, d, lo) if self._retraced(i, d) and lo is not None else None

    def _retraced(self, i: int, d: int) -> bool:
        """Whether the eager router run made request ``i``'s general tokens up to and including ``d``."""
        assert self.router is not None
        return i < len(self.router.token_ids) and self.router.token_ids[i][:d + 1] == self.general.token_ids[i][:d + 1]

    def _plugin_from(self, i: int) -> int | None:
        """The first token of request ``i`` that a plugin-path step made (1 where the plugin run did not record
        it), or None: no step of the plugin made one of its tokens."""
        return 1 if self.plugin.plugin_from is None else self.plugin.plugin_from.get(i)

    def _router_line(self, i: int, d: int) -> str:
        tie = self.router_excuse(i)
        if tie is not None:
            return (f"after a router near-tie: the general path's MoE layer {tie.layer} had a top-k boundary gap of "
                    f"{tie.gap_ulps:.1f} ulps at token {tie.token} (a near-tie: <= {ROUTER_TIE_ULPS} ulps, "
                    f"docs/contract.md), where rounding may pick another expert: accepted as the run's one router "
                    f"excuse")
        assert self.router is not None
        if not self._router_may_excuse(i):
            return ("no router excuse: one side ended there with the same tokens so far, so no token differs for a "
                    "flipped expert to explain")
        if not self._retraced(i, d):
            return "no router excuse: the eager general run did not retrace the general run's tokens up to here"
        lo = self._plugin_from(i)
        if lo is None or lo > d:
            return ("no router excuse: token 0 came from the prefill, which ran on the general path in both "
                    "runs: no step of the plugin precedes it" if d == 0 else "no router excuse: no step of the "
                    "plugin made a token of this request up to here (its steps ran on the general path, as in the "
                    "general run)")
        if self.router.before(i, d, lo) is None:
            where = f"tokens {lo}-{d}" if d > lo else f"token {d}"
            first = f" (the plugin's first step for it made token {lo})" if lo > 1 else ""
            return (f"no router excuse: no MoE router of the general path had a near-tie (<= {ROUTER_TIE_ULPS} ulps) "
                    f"for this request at {where}{first}")
        taken = next(j for j in range(len(self.first_divergence)) if self.router_excuse(j) is not None)
        return f"no router excuse: another request already took the run's one router excuse (request {taken})"

    def excused(self, i: int) -> bool:
        """Whether request ``i``'s first difference is accepted: a logit near-tie, or the run's router excuse."""
        return self.differs_at_near_tie(i) or self.router_excuse(i) is not None

    @property
    def near_ties_only(self) -> bool:
        """Whether tokens differ and every request's first differing token is accepted (``excused``)."""
        return not self.identical and all(d is None or self.excused(i) for i, d in enumerate(self.first_divergence))

    @property
    def needs_router(self) -> bool:
        """Whether some first difference is no logit near-tie in a low-precision MoE model (the router rule could
        accept one): then ``compare`` records the general path's router near-ties."""
        return (self.general.moe_layers > 0 and self.general.dtype in (torch.bfloat16, torch.float16)
                and any(self._router_may_excuse(i) for i in range(len(self.first_divergence))))

    def exit_status(self, strict: bool = False) -> int:
        """0: identical, or (unless ``strict``) differing only at near-ties within the bound; 1: otherwise."""
        return 0 if self.identical or (self.near_ties_only and not strict) else 1

    def verdict(self, strict: bool = False) -> str:
        """The last line: which outcome it was and the exit status it gives."""
        rc = self.exit_status(strict)
        if self.identical:
            return "verdict: tokens identical (exit 0)"
        differ = [i for i, d in enumerate(self.first_divergence) if d is not None]
        where = f"{len(differ)} of {len(self.first_divergence)} request{'s' if len(self.first_divergence) != 1 else ''}"
        if self.near_ties_only:
            routed = [i for i in differ if not self.differs_at_near_tie(i)]
            how = (f"at a near-tie within the documented bound, or (request {routed[0]}) after a router near-tie"
                   if routed else "at a near-tie within the documented bound")
            return (f"verdict: tokens differ in {where}, each first {how} (docs/contract.md): "
                    + ("accepted (exit 0; --compare-strict exits 1 on any difference)"
                       if rc == 0 else "exit 1 (--compare-strict: no difference accepted)"))
        bad = [i for i in differ if not self.excused(i)]
        return (f"verdict: DIVERGED: tokens differ in {where}; the first difference of request"
                f"{'s' if len(bad) != 1 else ''} {', '.join(map(str, bad))} is not a near-tie within the documented "
                f"bound (exit 1)")


def tie_gap(report: CompareReport, i: int, d: int) -> tuple[float, float, float] | None:
    """At request ``i``'s first divergence ``d``: (the general path's logit of its token minus that of the
    plugin's, the bound, the scale); a near-tie when the gap is <= the bound. None where there is nothing to judge
    (one side ended there, or no logits were recorded), which is no near-tie."""
    g, p = report.general, report.plugin
    if d >= min(len(g.token_ids[i]), len(p.token_ids[i])) or d >= min(len(g.logits.get(i, [])),
                                                                        len(p.logits.get(i, []))):
        return None
    lg = g.logits[i][d]
    scale = max(1.0, float(lg.abs().max()))
    gap, bound = float(lg[g.token_ids[i][d]] - lg[p.token_ids[i][d]]), near_tie_rel(g.dtype) * scale
    return gap, bound, scale


def near_tie(report: CompareReport, i: int, d: int) -> str:
    """At request ``i``'s first divergence ``d``: both runs' logits for both tokens, and the top-2 gap."""
    g, p = report.general, report.plugin
    judged = tie_gap(report, i, d)
    if judged is None:
        return ""
    a, b = g.token_ids[i][d], p.token_ids[i][d]
    lg, lp = g.logits[i][d], p.logits[i][d]
    top2 = torch.topk(lg, 2).values
    rel = near_tie_rel(g.dtype)
    gap, bound, scale = judged
    verdict = (f"a near-tie: general logit[{a}] - logit[{b}] = {gap:.4f} <= {rel:.3g} x scale {scale:.4g} = "
               f"{bound:.4f} (docs/contract.md)" if gap <= bound else
               f"NOT a near-tie: general logit[{a}] - logit[{b}] = {gap:.4f} > {rel:.3g} x scale {scale:.4g} = "
               f"{bound:.4f}")
    return (f"general logits: {a}={float(lg[a]):.4f} {b}={float(lg[b]):.4f} (top-2 gap "
            f"{float(top2[0] - top2[1]):.4f}); plugin logits: {a}={float(lp[a]):.4f} {b}={float(lp[b]):.4f}; "
            f"largest |difference| on this row {float((lg - lp).abs().max()):.4f}\n    {verdict}")


def run_once(config: EngineConfig, params: Any, prompts: list[str], label: str) -> RunRecord:
    """Generate with ``config`` and record tokens, sampled-row logits and decode timing."""
    from lowlat.forward_batch import ForwardMode
    from lowlat.runtime.dispatch import PLUGIN
    from lowlat.runtime.engine import Engine

    logits: dict[int, list[torch.Tensor]] = {}
    with Engine(config) as engine:
        order: dict[int, int] = {}
        starts: dict[int, int] = {}  # request id -> its first token of the step in flight
        plugin_from: dict[int, int] = {}  # request id -> the first token a plugin-path step made for it

        def observe(step: Any, out: torch.Tensor) -> None:
            rows = out[step.sample_rows].float().cpu() if step.sample_rows else None
            for j, req in enumerate(step.sample_reqs):
                idx = order.setdefault(req.rid, len(order))
                logits.setdefault(idx, []).append(rows[j])
            starts.update((r.rid, len(r.output_ids)) for r in step.requests)  # before the step's tokens go in

        def on_step(step: Any) -> None:  # after the step's stats (overlapped or not): their last path is its path
            if engine.stats.last_path == PLUGIN and step.mode is not ForwardMode.PREFILL:
                for r in step.requests:
                    plugin_from.setdefault(r.rid, starts.get(r.rid, len(r.output_ids) - 1))

        engine.logits_observer, engine.step_observer = observe, on_step
        completions = engine.generate(prompts, params)

        decode = engine.stats.by_mode[ForwardMode.DECODE]
        name = engine.runner.plugin_host.name
        return RunRecord(label, name, [list(c.token_ids) for c in completions], logits, decode.ms_per_step,
                         [c.decode_tokens_per_s for c in completions], engine.stats.paths_as_dict(),
                         engine.runner.dtype, len(moe_blocks(engine.runner.model)),
                         {i: plugin_from[c.request_id] for i, c in enumerate(completions)
                          if c.request_id in plugin_from})


def compare(config: EngineConfig, params: Any, prompts: list[str]) -> CompareReport:
    """Run general then plugin with greedy sampling and compare.

    Raises:
        ValueError: ``config.plugin`` is "none" (nothing to compare) or no plugin was selected by "auto".
    """
    if config.plugin == "none":
        raise ValueError("--compare needs a plugin: pass --plugin auto or --plugin NAME")
    params = replace(params, temperature=0.0)
    # With --speculative both runs must take the same steps, so their logits rows (every VERIFY row) line up:
    # no timing-driven off-switch.
    config = replace(config, speculative_adaptive=False)
    general = run_once(replace(config, plugin="none"), params, prompts, "general")
    plugin = run_once(config, params, prompts, f"plugin {config.plugin}")
    if plugin.plugin is None:
        raise ValueError(f"--plugin {config.plugin} selected no plugin for this model here; see lowlat plugins")
    plugin.label = f"plugin {plugin.plugin}"
    div: list[int | None] = []
    worst, rows = 0.0, 0
    for i, (a, b) in enumerate(zip(general.token_ids, plugin.token_ids)):
        d = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if d is None and len(a) != len(b):
            d = min(len(a), len(b))
        div.append(d)
        n = len(a) if d is None else d + 1  # the step that produced the first differing token is comparable
        for la, lb in zip(general.logits.get(i, [])[:n], plugin.logits.get(i, [])[:n]):
            worst = max(worst, float((la - lb).abs().max()))
            rows += 1
    report = CompareReport(general, plugin, all(d is None for d in div), div, worst, triton_interpreter_enabled(),
                           logit_rows=rows)
    if report.needs_router:
        report.router = router_ties(config, params, prompts)
    return report
