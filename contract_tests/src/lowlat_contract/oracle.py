"""The isolated oracle: one plugin step checked against the general forward run from the same snapshot.

``check_step(runner, batch, tol, what)`` does, for one DECODE/VERIFY ForwardBatch:

1. snapshot the KV pool (every layer's K and V, ``req_to_token``) and the batch's tensors;
2. run the plugin's forward (``dispatcher.run("plugin", batch)``);
3. check that the batch's tensors are unchanged (a plugin must not edit its inputs in place), that
   ``req_to_token`` is unchanged, and that every K/V slot outside ``out_cache_loc`` is bit-identical to the
   snapshot in every layer (no spill into a free slot, the dummy slot 0, or a slot another request reads),
   and that no parameter or buffer of the general model changed (``ParamWatch``: the plugin's weights are
   those tensors, shared with the general path, so an in-place edit would move both paths alike and no
   comparison between them could see it);
4. record the plugin's logits and the K/V rows it stored at ``out_cache_loc``, restore the snapshot, and run
   the general forward on it with a pristine copy of the batch (so neither what the plugin wrote nor an
   in-place edit of the inputs reaches the oracle);
5. compare logits and stored K/V rows within the dtype's per-row tolerance (``cases.Tolerance``), excusing
   only MoE rows whose routing differs between the two paths (``router_ties.routing_excuses``).

The pool is left as one of the two paths wrote it: ``keep="general"`` (default: later steps start from the
oracle's cache) or ``keep="plugin"`` (the plugin's stored rows are put back, so later steps on either path
read what the plugin wrote, as in serving). Every check counts in ``STATS`` (the false-green guard and the
report read it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from lowlat_contract.router_ties import routing_excuses

BATCH_TENSORS = ("input_ids", "positions", "seq_lens", "req_pool_indices", "out_cache_loc", "extend_lens",
                 "extend_start_loc")


@dataclass
class OracleStats:
    """Plugin steps compared with the general path in this process (per plugin forward object id)."""

    steps: int = 0
    per_forward: dict[int, int] = field(default_factory=dict)


STATS = OracleStats()


@dataclass
class StepResult:
    """What one checked step found: ``problems`` (empty when it passed) and both paths' outputs.

    logits / want: float32 [R, vocab]; kv / want_kv: [2 * layers, T, Hkv, D] in the pool dtype (K then V of
    each layer at out_cache_loc).
    """

    problems: list[str]
    logits: torch.Tensor
    want: torch.Tensor
    kv: torch.Tensor
    want_kv: torch.Tensor


def _buffers(pool: Any) -> list[torch.Tensor]:
    return [b for kv in zip(pool.k_buffers, pool.v_buffers) for b in kv]


def snapshot(pool: Any) -> list[torch.Tensor]:
    """Copies of [k0, v0, k1, v1, ..., req_to_token] (all of the pool a step could touch)."""
    return [b.clone() for b in _buffers(pool)] + [pool.req_to_token.clone()]


def restore(pool: Any, snap: list[torch.Tensor]) -> None:
    for buf, saved in zip([*_buffers(pool), pool.req_to_token], snap):
        buf.copy_(saved)


def kv_rows(pool: Any, loc: torch.Tensor) -> torch.Tensor:
    """[2 * layers, T, Hkv, D]: K then V of each layer at slots ``loc``."""
    return torch.stack([b[loc] for b in _buffers(pool)])


def copy_batch(batch: Any) -> Any:
    """A ForwardBatch with cloned tensors and copied host lists."""
    kw = {n: getattr(batch, n).clone() for n in BATCH_TENSORS}
    for n in ("seq_lens_cpu", "extend_lens_cpu"):
        if getattr(batch, n) is not None:
            kw[n] = list(getattr(batch, n))
    return dataclasses.replace(batch, **kw)


def input_edits(batch: Any, pristine: Any) -> list[str]:
    """Fields of ``batch`` that differ from ``pristine`` (the plugin edited its inputs in place)."""
    out = [n for n in BATCH_TENSORS if not torch.equal(getattr(batch, n), getattr(pristine, n))]
    out += [n for n in ("seq_lens_cpu", "extend_lens_cpu") if getattr(batch, n) != getattr(pristine, n)]
    return out


def stray_writes(pool: Any, snap: list[torch.Tensor], loc: torch.Tensor, owner: Any = None) -> list[str]:
    """Problems where a K/V buffer changed outside ``loc`` or ``req_to_token`` changed (bitwise).

    ``owner(slot) -> str`` names a slot's role for the message (e.g. "a cached token of request 2").
    """
    problems = []
    outside = torch.ones(pool.num_slots, dtype=torch.bool, device=pool.device)
    outside[loc] = False
    for i, (now, old) in enumerate(zip(_buffers(pool), snap)):
        # bitwise: compare the raw bytes, so a NaN written over a NaN or -0.0 over 0.0 still counts as a write
        changed = (now.view(now.shape[0], -1).view(torch.uint8) != old.view(old.shape[0], -1).view(torch.uint8))
        slots = (changed.any(dim=1) & outside).nonzero().flatten().tolist()
        if slots:
            who = ", ".join(f"{s} ({owner(s) if owner else 'not in out_cache_loc'})" for s in slots[:4])
            problems.append(f"layer {i // 2} {'KV'[i % 2]}: the plugin wrote {len(slots)} slot(s) outside "
                            f"out_cache_loc, e.g. {who}")
    if not torch.equal(pool.req_to_token, snap[-1]):
        problems.append("the plugin changed req_to_token (the request-to-slot map is the runtime's)")
    return problems


class ParamWatch:
    """Whether a model's parameters and buffers change (bitwise) between ``reset()`` and ``changed()``.

    Up to EXACT_BYTES in all (every tiny preset) it keeps copies and compares them bit for bit; above, float64
    sums of CHUNK-element pieces of each tensor (a real model on a GPU: one read of the weights per check, no
    second copy), which any scaled or shifted write moves.
    """

    EXACT_BYTES = 256 << 20

    def __init__(self, model: Any) -> None:
        seen: set[int] = set()
        self.tensors: dict[str, torch.Tensor] = {}
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if t.numel() and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                self.tensors[name] = t
        self.exact = sum(t.numel() * t.element_size() for t in self.tensors.values()) <= self.EXACT_BYTES
        self.reset()

    CHUNK = 1 << 24  # elements per float64 partial sum: a 128 MiB temporary at most, whatever the tensor's size

    def _sig(self, t: torch.Tensor) -> torch.Tensor:
        if self.exact:
            return t.detach().clone()
        flat, n = t.detach().reshape(-1), self.CHUNK
        return torch.stack([flat[i:i + n].sum(dtype=torch.float64) for i in range(0, flat.numel(), n)])

    def reset(self) -> None:
        self.base = {n: self._sig(t) for n, t in self.tensors.items()}

    def changed(self) -> list[str]:
        """Names of the tensors that differ from the last ``reset()``."""
        return [n for n, t in self.tensors.items() if not torch.equal(self._sig(t), self.base[n])]


def check_step(runner: Any, batch: Any, tol: Any, what: str, *, keep: str = "general",
               owner: Any = None) -> StepResult:
    """Run ``batch`` on the plugin and on the general path from the same state and compare (module docstring).

    Never raises for a plugin defect: problems are returned (a plugin exception propagates, naming the step).
    """
    from lowlat_contract.harness import dispatcher_of

    d = dispatcher_of(runner)
    pool = runner.kv_pool
    pristine = copy_batch(batch)
    snap = snapshot(pool)
    loc = pristine.out_cache_loc
    problems: list[str] = []
    watch = ParamWatch(runner.model)
    with torch.inference_mode():
        try:
            got = d.run("plugin", batch).clone()
        except Exception as e:  # PluginStepError: name the step, keep the cache usable for the next check
            restore(pool, snap)
            raise AssertionError(f"{what}: the plugin step raised {type(e).__name__}: {e}") from e
        routing = plugin_routing(d.plugin_forward)
        edited = input_edits(batch, pristine)
        if edited:
            problems.append(f"{what}: the plugin changed its inputs in place: {', '.join(edited)}")
        problems += [f"{what}: {p}" for p in stray_writes(pool, snap, loc, owner)]
        touched = watch.changed()
        if touched:
            problems.append(f"{what}: the plugin changed {len(touched)} parameter(s)/buffer(s) of the model in place, "
                            f"e.g. {', '.join(touched[:3])}; they are the general model's tensors, shared and "
                            f"read-only (copy what you transform at build, e.g. into alloc_workspace buffers)")
        got_kv = kv_rows(pool, loc).clone()
        restore(pool, snap)
        want, excused = routing_excuses(runner.model, lambda: runner.general_forward(copy_batch(pristine)),
                                        pristine.num_tokens, routing)
        want = want.clone()
        want_kv = kv_rows(pool, loc).clone()
        if keep == "plugin":
            for i, buf in enumerate(_buffers(pool)):
                buf[loc] = got_kv[i]
    STATS.steps += 1
    key = id(d.plugin_forward)
    STATS.per_forward[key] = STATS.per_forward.get(key, 0) + 1
    rows = excused if want.shape[0] == pristine.num_tokens else frozenset()
    for bad in (tol.check(got, want, f"{what}: logits", rows),
                tol.check(got_kv.transpose(0, 1).reshape(loc.numel(), -1),
                          want_kv.transpose(0, 1).reshape(loc.numel(), -1), f"{what}: K/V stored at out_cache_loc",
                          rows)):
        if bad:
            problems.append(bad)
    return StepResult(problems, got, want, got_kv, want_kv)


def plugin_routing(forward: Any) -> list[torch.Tensor] | None:
    """The plugin's top-k expert ids per MoE layer for its latest step, if it exposes them (``last_routing()``,
    optional: list of int [T, k], layer order), else None."""
    fn = getattr(forward, "last_routing", None)
    if fn is None:
        return None
    out = fn()
    return None if out is None else [t.detach().to("cpu", torch.int64) for t in out]
