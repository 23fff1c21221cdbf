"""Helpers the contracts share: requests with cached prefixes, step shapes, KV snapshots, rebuilds, greedy runs.

Everything drives a ``ModelRunner`` built with the plugin (``runner.plugin_host.dispatcher`` is the
Dispatcher; ``runner.general_forward`` is the oracle). Prefixes are prefilled through the general path, so
the cache a plugin step reads is the general forward's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from lowlat_contract.cases import PREFIX_LENS, ContractCase, Tolerance
from lowlat_contract.router_ties import RouterTieRecorder


def dispatcher_of(runner: Any) -> Any:
    """The runner's plugin Dispatcher. Raises AssertionError when the runner runs no plugin."""
    host = getattr(runner, "plugin_host", None)
    d = getattr(host, "dispatcher", None)
    if d is None:
        raise AssertionError("the ModelRunner built with plugin=NAME has no runner.plugin_host.dispatcher; "
                             "the plugin was not installed")
    return d


def prefix_lens(n: int) -> list[int]:
    """n odd-ish context lengths: request i gets PREFIX_LENS[i % 3] + i (1, 18, 35, 4, 21, ...)."""
    return [PREFIX_LENS[i % len(PREFIX_LENS)] + i for i in range(n)]


def random_tokens(gen: torch.Generator, vocab: int, n: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=gen).tolist()


class Requests:
    """Requests holding KV rows of ``runner``'s pool, for the duration of a ``with`` block.

    On enter, each prompt is prefilled in one PREFILL step through ``prefill`` (default: the general forward).
    ``step(mode, tokens_per_req)`` allocates the next slots and returns the ForwardBatch (the caller runs it).
    Rows and pages go back to the pool on exit.
    """

    def __init__(self, runner: Any, prompts: list[list[int]], *, seed: int = 0, prefill: Any = None) -> None:
        self.runner, self.prompts = runner, prompts
        self.gen = torch.Generator().manual_seed(seed)
        self.prefill = prefill or runner.general_forward
        self.rows: list[int] = []
        self.lens: list[int] = []
        self.prefill_logits: torch.Tensor | None = None

    @classmethod
    def with_prefixes(cls, runner: Any, lens: list[int], *, seed: int = 0) -> Requests:
        gen = torch.Generator().manual_seed(seed + 1000)
        return cls(runner, [random_tokens(gen, runner.model_config.vocab_size, n) for n in lens], seed=seed)

    def __enter__(self) -> Requests:
        from lowlat.forward_batch import ForwardMode

        pool = self.runner.kv_pool
        try:
            self.rows = [pool.alloc_req() for _ in self.prompts]
            self.lens = [0] * len(self.prompts)
            full = [i for i, p in enumerate(self.prompts) if p]  # an empty prompt: a request at context 0
            if full:
                batch = self.runner.prepare_batch(ForwardMode.PREFILL, [self.rows[i] for i in full],
                                                  [0] * len(full), [self.prompts[i] for i in full])
                with torch.inference_mode():
                    self.prefill_logits = self.prefill(batch).clone()
                self.lens = [len(p) for p in self.prompts]
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for row in self.rows:
            self.runner.kv_pool.free_req(row)
        self.rows = []

    def step(self, mode: Any, tokens_per_req: int, tokens: list[list[int]] | None = None) -> Any:
        """The next step's ForwardBatch (random new tokens unless given); the requests grow by tokens_per_req."""
        vocab = self.runner.model_config.vocab_size
        toks = tokens or [random_tokens(self.gen, vocab, tokens_per_req) for _ in self.rows]
        batch = self.runner.prepare_batch(mode, self.rows, self.lens, toks)
        self.lens = [n + tokens_per_req for n in self.lens]
        return batch

    def live_slots(self) -> torch.Tensor:
        """[N] int64 KV slots holding these requests' cached tokens (before the pending step)."""
        pool = self.runner.kv_pool
        return torch.cat([pool.slots_of(r, n) for r, n in zip(self.rows, self.lens)]) if self.rows else \
            torch.zeros(0, dtype=torch.int64, device=pool.device)


@dataclass(frozen=True)
class StepShape:
    """A step of ``batch_size`` requests with ``tokens_per_req`` new tokens each."""

    mode: Any
    batch_size: int
    tokens_per_req: int

    @property
    def num_tokens(self) -> int:
        return self.batch_size * self.tokens_per_req


FORWARD_SHAPES = ("DECODE-b1", "DECODE-b3", "DECODE-bmax", "VERIFY-t2", "VERIFY-tmax")


def resolve_shape(name: str, case: ContractCase) -> StepShape | str:
    """A symbolic shape of FORWARD_SHAPES for this case's coverage, or the reason it does not apply.

    DECODE with 1, 3 and the most requests coverage allows; VERIFY with 2 and with the most tokens per
    request coverage allows, with as many requests as keep T <= max_tokens.
    """
    from lowlat.forward_batch import ForwardMode

    cov = case.spec.coverage
    mode_name, _, arg = name.partition("-")
    mode = ForwardMode[mode_name]
    if mode not in cov.modes:
        return f"{mode_name} is not in the spec's coverage ({cov.describe()})"
    if mode is ForwardMode.DECODE:
        b = min(cov.max_tokens, case.max_batch_size) if arg == "bmax" else int(arg[1:])
        shape = StepShape(mode, b, 1)
    else:
        tpr = min(cov.max_tokens, case.max_verify_tokens) if arg == "tmax" else int(arg[1:])
        if tpr < 2:
            return f"VERIFY needs 2 tokens per request; coverage allows {cov.max_tokens} tokens per step"
        shape = StepShape(mode, max(1, min(cov.max_tokens // tpr, case.max_batch_size)), tpr)
    if not cov.covers(mode, shape.num_tokens) or shape.batch_size > case.max_batch_size:
        return f"{shape.num_tokens} tokens is outside the spec's coverage ({cov.describe()})"
    return shape


def kv_state(pool: Any) -> list[torch.Tensor]:
    """Copies of every layer's K and V buffers: [k0, v0, k1, v1, ...]."""
    out = []
    for k, v in zip(pool.k_buffers, pool.v_buffers):
        out += [k.clone(), v.clone()]
    return out


def kv_restore(pool: Any, state: list[torch.Tensor]) -> None:
    for i, (k, v) in enumerate(zip(pool.k_buffers, pool.v_buffers)):
        k.copy_(state[2 * i])
        v.copy_(state[2 * i + 1])


def kv_at(pool: Any, loc: torch.Tensor) -> torch.Tensor:
    """[2 * layers, T, Hkv, D]: K then V of each layer at slots ``loc``."""
    return torch.stack([b[loc] for kv in zip(pool.k_buffers, pool.v_buffers) for b in kv])


def rebuild_plugin(runner: Any, checkpoint_tensors: dict[str, torch.Tensor] | None = None) -> tuple[Any, Any]:
    """Build the runner's plugin again from its current parameters; returns (PluginForward, PluginBinding).

    The new binding sees the runner's parameters (perturbed ones included) and its KV pool (ready callbacks run).
    """
    from lowlat.plugin.binding import PluginBinding
    from lowlat.runtime.plugin_host.discovery import load_callable

    host = runner.plugin_host
    old, spec = host.binding, host.selection.spec
    binding = PluginBinding(plugin=old.plugin, model_config=old.model_config, engine_config=old.engine_config,
                            device=old.device, dtype=old.dtype, params=old.params, tp_rank=old.tp_rank,
                            tp_size=old.tp_size, tp_group=old.tp_group, checkpoint_tensors=checkpoint_tensors)
    forward = load_callable(spec.build, old.plugin)(binding)
    binding.release_checkpoint()
    binding.attach_kv_pool(runner.kv_pool)
    return forward, binding


@dataclass
class GreedyRun:
    """tokens[i][s]: request i's s-th generated token; logits[s]: [B, V] float32 that picked tokens[:][s]."""

    tokens: list[list[int]]
    logits: list[torch.Tensor]
    paths: list[str]
    router_ties: dict[int, list[int]] = field(default_factory=dict)  # request -> steps with a router near-tie


def greedy_run(runner: Any, prompts: list[list[int]], new_tokens: int, force_path: Any) -> GreedyRun:
    """Greedy decoding through ``runner.forward`` (the installed dispatcher) with ``force_path`` set.

    The prompts are prefilled in one PREFILL step, then ``new_tokens - 1`` DECODE steps follow.
    """
    from lowlat.forward_batch import ForwardMode

    d = dispatcher_of(runner)
    d.force_path = force_path
    ties = RouterTieRecorder(getattr(runner, "model", None))
    try:
        with ties:
            ties.begin_step(0, [len(p) for p in prompts])
            with Requests(runner, prompts, prefill=runner.forward) as reqs:
                logits = [reqs.prefill_logits]
                paths = [d.last_path]
                for step in range(1, new_tokens):
                    last = logits[-1].argmax(dim=-1).tolist()
                    batch = reqs.step(ForwardMode.DECODE, 1, [[t] for t in last])
                    ties.begin_step(step, [1] * len(last))
                    with torch.inference_mode():
                        logits.append(runner.forward(batch).clone())
                    paths.append(d.last_path)
    finally:
        d.force_path = None
    picks = torch.stack([lg.argmax(dim=-1) for lg in logits], dim=1)  # [B, steps]
    return GreedyRun(picks.tolist(), logits, paths, ties.ties)


def compare_greedy(got: GreedyRun, want: GreedyRun, tol: Tolerance) -> list[str]:
    """Problems where ``got`` picked another token than ``want`` (the general run) other than at a near-tie.

    At a request's first differing token both runs have the same context, so the general logits there say
    whether the two picks were within the tolerance of each other (a near-tie); after it the sequences differ.
    In a low-precision MoE model, one divergence per run is also excused when the general run had a router
    near-tie for that request at or before that token (``router_ties.py``): a flipped expert moves the logits by
    far more than the logit tolerance.
    """
    problems = []
    excused = 0
    first_plugin = next((s for s, p in enumerate(got.paths) if p == "plugin"), len(got.paths))
    for i, (a, b) in enumerate(zip(got.tokens, want.tokens)):
        for s, (ta, tb) in enumerate(zip(a, b)):
            if ta == tb:
                continue
            row = want.logits[s][i]
            margin, bound = float(row[tb] - row[ta]), tol.atol(row)
            tie = any(first_plugin <= t <= s for t in want.router_ties.get(i, []))
            if margin > bound and tol.allow_outlier_rows and tie and not excused:
                excused += 1
            elif margin > bound:
                if not tol.allow_outlier_rows:
                    why = ""
                elif not tie:
                    why = ", and no MoE router near-tie of this request precedes it"
                else:
                    why = "; a router near-tie precedes it, but one such divergence per run was already excused"
                problems.append(f"request {i}, token {s}: picked {ta} where the general path picks {tb}; the general "
                                f"logits differ by {margin:.4g} > {bound:.4g} ({tol.dtype}), so this is no near-tie"
                                f"{why}")
            break
    return problems
