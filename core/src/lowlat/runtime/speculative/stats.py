"""Statistics of speculative decoding: acceptance length, VERIFY steps per path, fallback DECODE steps."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lowlat.forward_batch import ForwardMode
from lowlat.runtime.stats import StepStats


@dataclass
class SpecStats:
    """Totals since the engine started (or ``reset``).

    Attributes:
        method / simulated / k: the drafter, whether its acceptance is simulated (benchmark only), k drafts.
        verify_steps: speculative VERIFY steps; request_steps: requests summed over them.
        decode_steps: plain DECODE steps the speculative loop took (off-switch, probes, no drafts, the last
            tokens of a request); no_draft_steps: of those, steps where no request had a draft.
        drafted: real draft tokens proposed (padding excluded); accepted: drafts the verifier kept;
            emitted: tokens VERIFY steps appended (kept drafts plus the token after them, before EOS/length cuts).
        accept_hist: ``accept_hist[n]`` request-steps that kept n drafts (0..k).
        draft_s / verify_s / decode_s: host seconds drafting, in VERIFY steps, in the loop's DECODE steps.
    """

    method: str = ""
    simulated: bool = False
    k: int = 0
    verify_steps: int = 0
    request_steps: int = 0
    decode_steps: int = 0
    no_draft_steps: int = 0
    decode_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    accept_hist: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0
    decode_s: float = 0.0

    @property
    def acceptance_length(self) -> float:
        """Mean tokens appended per request per VERIFY step, the bonus token included (0.0 before any)."""
        return self.emitted / self.request_steps if self.request_steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Kept drafts over real drafts proposed (0.0 before any)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    def add_verify(self, kept: list[int], drafted: int, k: int, draft_s: float, verify_s: float) -> None:
        """One VERIFY step: ``kept[i]`` drafts of request i kept, ``drafted`` real drafts, k per request."""
        if len(self.accept_hist) < k + 1:
            self.accept_hist += [0] * (k + 1 - len(self.accept_hist))
        for n in kept:
            self.accept_hist[n] += 1
        self.verify_steps += 1
        self.request_steps += len(kept)
        self.accepted += sum(kept)
        self.emitted += sum(kept) + len(kept)
        self.drafted += drafted
        self.draft_s += draft_s
        self.verify_s += verify_s

    def reset(self) -> None:
        keep = (self.method, self.simulated, self.k)
        self.__init__()  # type: ignore[misc]
        self.method, self.simulated, self.k = keep

    def as_dict(self, steps: StepStats | None = None, controller: Any = None) -> dict[str, Any]:
        """JSON-ready totals; with the engine's StepStats, VERIFY steps per path; with the Controller, its state."""
        d: dict[str, Any] = {
            "method": self.method, "simulated": self.simulated, "k": self.k, "verify_steps": self.verify_steps,
            "request_steps": self.request_steps,
            "decode_steps": self.decode_steps, "no_draft_steps": self.no_draft_steps,
            "decode_tokens": self.decode_tokens, "drafted": self.drafted,
            "accepted": self.accepted, "emitted": self.emitted, "acceptance_length": self.acceptance_length,
            "acceptance_rate": self.acceptance_rate, "accept_hist": list(self.accept_hist),
            "draft_s": self.draft_s, "verify_s": self.verify_s, "decode_s": self.decode_s,
        }
        if self.simulated:
            from lowlat.runtime.speculative.simulated import LABEL

            d["label"] = LABEL
        if steps is not None:
            verify = [(p, r.steps) for (p, m), r in steps.by_path.items() if m is ForwardMode.VERIFY]
            d["verify_steps_by_path"] = dict(sorted(verify))
        if controller is not None:
            d["controller"] = {"adaptive": controller.adaptive, "on": controller.on, "switches": controller.switches,
                               "probes": controller.probes, "reason": controller.reason}
        return d

    def lines(self, steps: StepStats | None = None, controller: Any = None) -> list[str]:
        """A human summary (``lowlat run`` prints it)."""
        d = self.as_dict(steps, controller)
        out = []
        if self.simulated:
            out.append(f"speculative: {d['label']}")
        secs = self.draft_s + self.verify_s + self.decode_s
        out.append(f"speculative {self.method}, k={self.k}: {self.verify_steps} VERIFY steps "
                   f"({', '.join(f'{p} {n}' for p, n in d.get('verify_steps_by_path', {}).items()) or 'none'}), "
                   f"mean acceptance length {self.acceptance_length:.2f} tokens per request per VERIFY step (kept "
                   f"drafts + 1) over the run, acceptance rate {100 * self.acceptance_rate:.1f}% of {self.drafted} "
                   f"drafts, {self.decode_steps} DECODE steps")
        steps_n = self.verify_steps + self.decode_steps
        tokens = self.emitted + self.decode_tokens
        if secs > 0 and steps_n and tokens:
            per_req = tokens / ((self.request_steps + self.decode_tokens) / steps_n)  # tokens of a mean request
            out.append(f"  loop time: drafting {1e3 * self.draft_s:.1f} ms, VERIFY {1e3 * self.verify_s:.1f} ms, "
                       f"DECODE {1e3 * self.decode_s:.1f} ms; whole batch {tokens / secs:.1f} tok/s (tokens all "
                       f"requests gained: kept drafts, the token after them and DECODE tokens; rejected drafts not "
                       f"counted), per request {1e3 * secs / per_req:.3f} ms per token")
        if controller is not None and controller.adaptive:
            c = d["controller"]
            state = ("not triggered: speculating at the end" if c["on"] else
                     "triggered: plain DECODE steps at the end, speculation off")
            why = c["reason"].removeprefix("on: ").removeprefix("off: ")
            out.append(f"  adaptive off-switch (plain DECODE while it measures faster): {state}; {why} "
                       f"({c['switches']} switches, {c['probes']} probes)")
        return out
