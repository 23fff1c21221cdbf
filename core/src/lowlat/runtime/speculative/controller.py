"""The adaptive off-switch: speculate only while it beats plain decoding.

Cost model. A VERIFY step of B requests and k + 1 rows each appends ``tau`` tokens per request on average (the
mean acceptance length, bonus token included) and costs ``t_spec`` seconds (drafting plus the VERIFY step, host
time); a plain DECODE step of B requests appends 1 token per request in ``t_decode``. Speculation is faster
exactly when ``tau > t_spec / t_decode``. ``tau`` is an exponential moving average over VERIFY steps; the two
times are moving averages per batch size (and k + 1), measured at run time.

Hysteresis and probes. Speculation turns off when ``tau < ratio * (1 - hysteresis)`` and back on when
``tau > ratio * (1 + hysteresis)``. While it is on, a probe step (and the first step at a new batch size) is a
plain DECODE step, so ``t_decode`` stays measured; while it is off, a probe is a VERIFY step, so ``tau`` and
``t_spec`` follow the text. Probes come every ``probe_every`` steps; each probe that finds the state unchanged
doubles the interval (up to ``max_probe_every``), a switch resets it, so a stable run pays for few probes (a
DECODE probe at tau 3.5 costs 2.5 tokens of one step).

Warm-up. The first measured step at each shape is dropped: in a short run it is the step right after the
prompt's prefill (or after a batch change), and on an H200 such a DECODE step took 5.8 ms against a 3.1 ms mean
(llama-3.2-1b, 2026-12-02), so as the first sample of a moving average it made plain decoding look half as fast and
kept speculation on. A new batch size therefore costs two plain DECODE steps before the first decision; while
speculation is off, a VERIFY probe that was a shape's warm-up is followed by another at once (as ``retry``).

Tensor parallelism. Ranks must take the same decision every step, but their clocks differ. Decisions therefore
read only the acceptance (identical on every rank: the same tokens) and an *agreed* copy of the times, which
``agree`` (an all-reduce mean over the ranks' CPU group) refreshes every ``agree_every`` measurements; which
shapes were measured, and when, is deterministic.

The switch is per batch: every request of a VERIFY step rides in it with the same k (one captured shape), so a
request with poor drafts cannot leave alone; its acceptance still counts in ``tau``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

Key = tuple[int, int]  # (batch size, tokens per request): (B, 1) is DECODE


@dataclass
class Controller:
    """Decides each step between VERIFY and DECODE (see the module docstring).

    Args:
        adaptive: False: always speculate (no probes).
        probe_every / max_probe_every: steps between probes, first and at most (see above).
        hysteresis: relative band around the break-even ratio.
        ewma: weight of a new measurement in the moving averages.
        agree_every: measurements between agreements of the times over TP ranks.
        agree: ``fn(values) -> values`` averaging a list of floats over the ranks; None on one rank.

    Attributes:
        on: speculation is on; ``switches``: times it flipped; ``reason``: why it is in its state (for stats).
        tau: the moving mean acceptance length, tokens per request per VERIFY step, kept drafts + 1 (None before
            any VERIFY step); ``ratio``: the moving (drafting + VERIFY) / DECODE step-time ratio, its break-even.
        probes: DECODE steps taken while on plus VERIFY steps taken while off, to keep the model measured.
    """

    adaptive: bool = True
    probe_every: int = 32
    max_probe_every: int = 512
    hysteresis: float = 0.1
    ewma: float = 0.25
    agree_every: int = 8
    agree: Callable[[list[float]], list[float]] | None = None
    on: bool = True
    switches: int = 0
    probes: int = 0
    reason: str = "on: nothing measured yet"
    tau: float | None = None
    _local: dict[Key, float] = field(default_factory=dict)
    _warm: set[Key] = field(default_factory=set)  # shapes whose first (warm-up) step was seen and dropped
    _agreed: dict[Key, float] = field(default_factory=dict)
    _since_probe: int = 0
    _since_agree: int = 0
    _interval: int = 0
    _switches_seen: int = 0

    def speculate(self, batch_size: int, tokens_per_req: int) -> bool:
        """Whether the next step of ``batch_size`` requests runs VERIFY with ``tokens_per_req`` rows each."""
        if not self.adaptive:
            return True
        self._since_probe += 1
        if (batch_size, 1) not in self._local:  # a new batch size: measure plain decoding first
            self.probes += 1
            return False
        self._decide(batch_size, tokens_per_req)
        if self.switches != self._switches_seen or not self._interval:
            self._switches_seen = self.switches
            self._interval = self.probe_every
        if self._since_probe >= self._interval:
            self._since_probe = 0
            self.probes += 1
            self._interval = min(2 * self._interval, max(self.max_probe_every, self.probe_every))
            return not self.on
        return self.on

    def record(self, batch_size: int, tokens_per_req: int, seconds: float, tau: float | None = None) -> None:
        """Add one measured step: DECODE (``tokens_per_req`` 1) or VERIFY with its mean acceptance length ``tau``.
        The first step at a shape is a warm-up: its acceptance counts, its time does not (module docstring)."""
        if not self.adaptive:
            return
        key = (batch_size, tokens_per_req)
        if tau is not None:
            self.tau = tau if self.tau is None else self.tau + self.ewma * (tau - self.tau)
        if key not in self._warm:
            self._warm.add(key)
            if tokens_per_req > 1:  # a VERIFY step whose time does not count: while off, probe again (as retry)
                self.retry()
            return
        old = self._local.get(key)
        self._local[key] = seconds if old is None else old + self.ewma * (seconds - old)
        self._since_agree += 1
        if self.agree is None:
            self._agreed = dict(self._local)
        elif self._since_agree >= self.agree_every or not self._agreed:
            keys = sorted(self._local)
            self._agreed = dict(zip(keys, self.agree([self._local[k] for k in keys])))
        else:
            return
        self._since_agree = 0

    def retry(self, tau: float | None = None) -> None:
        """A VERIFY step whose time does not count (the drafter caught up): fold in its acceptance ``tau``, and
        if speculation is off, probe again on the next step (same decision on every rank: no clock involved)."""
        if not self.adaptive:
            return
        if tau is not None:
            self.tau = tau if self.tau is None else self.tau + self.ewma * (tau - self.tau)
        if not self.on:
            self._since_probe = max(self._since_probe, self._interval)
            self._interval = max(self._interval // 2, self.probe_every)

    def ratio(self, batch_size: int, tokens_per_req: int) -> float | None:
        """Agreed ``t_spec / t_decode`` at this shape, or None until both are measured and agreed."""
        d = self._agreed.get((batch_size, 1))
        v = self._agreed.get((batch_size, tokens_per_req))
        return v / d if d and v is not None else None

    def _decide(self, batch_size: int, tokens_per_req: int) -> None:
        ratio = self.ratio(batch_size, tokens_per_req)
        if ratio is None or self.tau is None:
            return
        # Two moving averages of different things, printed beside the run's mean acceptance length and the steps
        # table's ms/step: each says what it measures and in what unit.
        now = (f"recent acceptance length {self.tau:.2f} tokens per request per VERIFY step (kept drafts + 1; moving "
               f"average, the last {self.recent_steps} VERIFY steps weigh 90%) {{}} step-time ratio {ratio:.2f} at "
               f"batch {batch_size} ((drafting + VERIFY) / plain DECODE step host time, moving averages of the "
               f"loop's own steps: the break-even acceptance length; the steps table's ms/step are whole-run means, "
               f"drafting excluded)")
        band = f"{100 * self.hysteresis:g}% hysteresis"  # the thresholds: the ratio widened by the band
        off_below = f"off below {ratio * (1 - self.hysteresis):.2f}, the ratio less the {band}"
        on_above = f"back on above {ratio * (1 + self.hysteresis):.2f}, the ratio plus the {band}"
        if self.on and self.tau < ratio * (1 - self.hysteresis):
            self.on = False
            self.switches += 1
            self.reason = "off: " + now.format("<") + f"; plain DECODE is faster; {on_above}"
        elif not self.on and self.tau > ratio * (1 + self.hysteresis):
            self.on = True
            self.switches += 1
            self.reason = "on: " + now.format(">") + f"; {off_below}"
        elif self.on:
            self.reason = "on: " + now.format("vs") + f"; speculation pays while the length is above the ratio; " \
                                                       f"{off_below}"

    @property
    def recent_steps(self) -> int:
        """How many of the latest measurements carry 90% of a moving average's weight (8 at ``ewma`` 0.25)."""
        return max(1, round(math.log(0.1) / math.log(1 - self.ewma))) if 0 < self.ewma < 1 else 1
