"""Guards of one engine step: non-finite logits on every path, and what to say when a step misses its deadline.

``picks_if_finite`` folds the finiteness check into the device-to-host copy sampling already does: the
"all finite" flag is computed on the device and read back in the same ``tolist()`` as the picked ids, so the
check adds one reduction over the sampled rows and no host sync. When a sampling plugin returned the step's ids
(plugin API 3), its logits never reach the host or the runtime: the plugin flags a row whose logits were not all
finite with id -1 (a contract the suite checks), and ``packed_ids`` turns "id in [0, vocab)" into the same flag,
so the guard holds on that path too, in the same read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class NonFiniteLogits(RuntimeError):
    """A step's logits held NaN or inf (bad weights, a nonsense config value, an overflow); nothing was served."""


def picks_if_finite(rows: torch.Tensor, picked: torch.Tensor | None, describe: Callable[[], str],
                    cause: Callable[[], None] | None = None) -> list[int]:
    """The picked ids as a list, after checking ``rows`` (the sampled logits) are all finite.

    Args:
        rows: float logits [R, V] the picks came from; picked: int64 [R] on the same device, or None for greedy
            (argmax, computed with the check).
        describe: says what the step was (mode, tokens, requests, path); called only for the error.
        cause: called before NonFiniteLogits is raised, to raise a more precise error of its own (e.g.
            ``ModelRunner.check_peer``: a peer all-reduce that gave up leaves NaN).
    Raises:
        NonFiniteLogits: naming the step, how many rows were bad and the usual causes.
    """
    return checked_picks(packed_picks(rows, picked).tolist(), describe, cause)


def packed_picks(rows: torch.Tensor, picked: torch.Tensor | None = None) -> torch.Tensor:
    """[2R] int64 on the device: the R picked ids, then R "row is all finite" flags (1/0); one read gets both.

    ``picked`` None means greedy: the ids are ``torch.argmax(rows, dim=-1)`` (the first index of each row's
    maximum). On CUDA both are two Triton launches (``lowlat.kernels.pick``) instead of torch's five kernels;
    elsewhere plain torch.
    """
    if rows.is_cuda and rows.dim() == 2 and rows.shape[-1] > 0 and rows.stride(-1) == 1:
        from lowlat.kernels.pick import pick_packed

        return pick_packed(rows, None if picked is None else picked.view(-1))
    if picked is None:
        picked = torch.argmax(rows, dim=-1)
    flag = torch.isfinite(rows).all(dim=-1)
    return torch.cat([picked.view(-1).to(torch.int64), flag.to(torch.int64)])


def packed_ids(ids: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed, fed)`` for ids a sampling plugin returned: packed [2R] int64 like ``packed_picks`` (flag 1 when the
    id lies in [0, vocab); the plugin writes -1 for a row whose logits were not all finite), and fed [R] int64,
    what the next step's inputs take: the id where flagged 1, else 0 (never an id the embedding cannot index: the
    overlapped loop launches the next step before it reads the flags). On CUDA one Triton launch
    (``lowlat.kernels.pick.pack_ids``) instead of torch's six kernels."""
    if ids.is_cuda:
        from lowlat.kernels.pick import pack_ids

        return pack_ids(ids, vocab)
    ids = ids.reshape(-1).to(torch.int64)
    ok = (ids >= 0) & (ids < vocab)
    return torch.cat([ids, ok.to(torch.int64)]), torch.where(ok, ids, torch.zeros_like(ids))


def is_ids(out: torch.Tensor) -> bool:
    """Whether a forward's output is sampled ids (int64 [R]) rather than logits (float32 [R, V])."""
    return out.dim() == 1


def checked_picks(out: list[int], describe: Callable[[], str], cause: Callable[[], None] | None = None) -> list[int]:
    """The ids of a ``packed_picks`` read back as a list. Raises as ``picks_if_finite``."""
    n = len(out) // 2
    bad = [i for i, ok in enumerate(out[n:]) if not ok]
    if bad:
        if cause is not None:
            cause()
        raise NonFiniteLogits(
            f"the {describe()} produced non-finite logits (NaN or inf; from a sampling plugin: an id of -1 or "
            f"outside the vocabulary) in {len(bad)} of {n} sampled rows (first: row {bad[0]}); the engine stopped "
            "rather than serve garbage tokens. Check the checkpoint for "
            "NaN/inf weights and config.json for nonsense values (e.g. a negative rms_norm_eps), or try "
            "--dtype float32 if float16 overflows")
    return out[:n]


def describe_step(step: Any, runner: Any, step_no: int) -> str:
    """One line naming a step: number, mode, tokens, requests, and the plugin that may serve it."""
    b = step.batch
    rids = ",".join(str(r.rid) for r in step.requests[:8]) + ("..." if len(step.requests) > 8 else "")
    host = getattr(runner, "plugin_host", None)
    d = getattr(host, "dispatcher", None)
    where = (f"plugin {d.plugin!r} selected, path {d.last_path or 'undecided'}" if d is not None
             else "general path")
    rank = f"rank {runner.tp.rank} of {runner.tp.size}: " if runner.tp.size > 1 else ""
    return (f"{rank}step {step_no} ({step.mode.name}, {b.num_tokens} tokens over {b.batch_size} requests "
            f"[{rids}], {where})")


def laggards(progress: Any, rank: int) -> str:
    """Which ranks finished the step this rank is on (shared per-rank step counters), for a deadline error."""
    if progress is None:
        return ""
    counts = list(progress)
    mine = counts[rank]
    done = [r for r, c in enumerate(counts) if r != rank and c > mine]
    stuck = [r for r, c in enumerate(counts) if r != rank and c <= mine]
    parts = []
    if done:
        parts.append(f"rank(s) {', '.join(map(str, done))} finished it")
    if stuck:
        parts.append(f"rank(s) {', '.join(map(str, stuck))} did not (stuck, stopped or waiting on a peer)")
    return "; " + " and ".join(parts) if parts else ""


def check_text(prompt: str, i: int) -> str:
    """``prompt`` itself when it is valid text (encodable as UTF-8).

    Raises:
        ValueError: it holds a lone surrogate (e.g. from bytes decoded with errors="surrogateescape"), naming
            the prompt, the position and the fix.
    """
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"prompt {i} is not valid text: character {e.start} is the lone surrogate "
                         f"U+{ord(prompt[e.start]):04X}, which has no UTF-8 form; decode the input as UTF-8 "
                         "(errors='replace') or pass token ids") from None
    return prompt
