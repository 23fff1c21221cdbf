"""Per-step statistics of an engine, by forward mode.

``StepStats.by_mode[mode]`` is a ``ModeStats`` row: steps, wall seconds (host time from the start of the
forward to the sampled tokens on the host), new tokens, and how many of the steps replayed a CUDA graph.
Rows are plain dataclasses so columns (for example a count per forward path) can be added without
changing callers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lowlat.forward_batch import ForwardMode


@dataclass
class ModeStats:
    """Totals of one forward mode. ``seconds`` is wall time (s); ``tokens`` counts new tokens."""

    steps: int = 0
    seconds: float = 0.0
    tokens: int = 0
    graph_steps: int = 0

    @property
    def ms_per_step(self) -> float:
        """Mean wall milliseconds per step (0.0 before any step)."""
        return 1e3 * self.seconds / self.steps if self.steps else 0.0


@dataclass
class StepStats:
    """Engine-level step counters, one ``ModeStats`` per ForwardMode."""

    by_mode: dict[ForwardMode, ModeStats] = field(default_factory=lambda: {m: ModeStats() for m in ForwardMode})
    by_path: dict[tuple[str, ForwardMode], ModeStats] = field(default_factory=dict)
    last_path: str | None = None  # the path of the step recorded last (a step_observer reads its step's path)

    def record(self, mode: ForwardMode, seconds: float, tokens: int, *, graphed: bool = False,
               path: str = "general") -> None:
        """Add one step of ``mode`` on ``path`` ("general" or "plugin") that took ``seconds`` for ``tokens``."""
        self.last_path = path
        by_path = self.by_path.get((path, mode))
        if by_path is None:
            by_path = self.by_path[(path, mode)] = ModeStats()
        for row in (self.by_mode[mode], by_path):
            row.steps += 1
            row.seconds += seconds
            row.tokens += tokens
            if graphed:
                row.graph_steps += 1

    @property
    def total_steps(self) -> int:
        return sum(r.steps for r in self.by_mode.values())

    def reset(self) -> None:
        self.by_mode = {m: ModeStats() for m in ForwardMode}
        self.by_path = {}
        self.last_path = None

    def as_dict(self) -> dict[str, dict[str, float]]:
        """JSON-ready ``{mode name: {steps, seconds, tokens, graph_steps, ms_per_step}}``."""
        return {m.name: _row(r) for m, r in self.by_mode.items()}

    def paths_as_dict(self) -> dict[str, dict[str, dict[str, float]]]:
        """JSON-ready ``{path: {mode name: row}}`` for the steps each path served."""
        out: dict[str, dict[str, dict[str, float]]] = {}
        for (path, mode), r in sorted(self.by_path.items(), key=lambda kv: (kv[0][0], kv[0][1].name)):
            out.setdefault(path, {})[mode.name] = _row(r)
        return out


def _row(r: ModeStats) -> dict[str, float]:
    return {"steps": r.steps, "seconds": r.seconds, "tokens": r.tokens, "graph_steps": r.graph_steps,
            "ms_per_step": r.ms_per_step}
