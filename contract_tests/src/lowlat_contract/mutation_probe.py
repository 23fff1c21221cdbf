"""Prove a mutant real: run it at its trigger next to the reference plugin and the general path.

``probe(name)`` builds a general-only ModelRunner for the trigger's model, dtype, page size and context, then
builds the mutant and the reference plugin on that runner's parameters and KV pool (a ``PluginBinding`` as
core makes one; no guard, so the shape need not be in any suite). Each step runs the mutant, the reference
and the general forward from the same KV state (the pool is restored between them and left as the general
path wrote it), and ``Evidence`` records how far each plugin is from the general path. A mutant is real when
the evidence for its trigger's ``check`` shows a defect in the mutant and none in the reference.

``python -m lowlat_contract.mutation_probe [NAME ...]`` prints, per mutant, its trigger and whether the mutant
and the reference show the defect there (with the tolerance message where logits or K/V are compared).
"""

from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lowlat_contract.cases import TOLERANCES
from lowlat_contract.harness import Requests, kv_at, kv_restore, kv_state, prefix_lens

_CHECKPOINTS: dict[str, str] = {}


@dataclass
class Evidence:
    """What one probe saw. ``errors[path]``: the tolerance check's message at the compared step (None = within);
    ``outside[path]``: slots written outside out_cache_loc; ``inputs[path]``: batch fields the call changed;
    ``held[path]``: (tensors, bytes) held by the plugin after the first and the last step; ``unaccounted``:
    plugin-held bytes that are neither parameters, the KV pool nor accounted workspaces; ``raised[path]``:
    the BaseException type names its forward raised."""

    errors: dict[str, str | None] = field(default_factory=dict)
    outside: dict[str, int] = field(default_factory=dict)
    inputs: dict[str, list[str]] = field(default_factory=dict)
    held: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    unaccounted: dict[str, int] = field(default_factory=dict)
    raised: dict[str, list[str]] = field(default_factory=dict)
    ids: dict[str, str | None] = field(default_factory=dict)

    def defect(self, check: str, path: str) -> bool:
        """Whether ``path`` ("mutant" or "reference") shows the defect ``check`` looks for."""
        if check in ("outputs", "replay", "recycle", "tp", "second_engine"):
            return self.errors.get(path) is not None
        if check == "outside":
            return self.outside.get(path, 0) > 0
        if check == "inputs":
            return bool(self.inputs.get(path))
        if check == "growth":
            first, last = self.held[path][0], self.held[path][-1]
            return last[0] > first[0] or last[1] > first[1]
        if check == "unaccounted":  # against the reference's own (its RoPE tables are unaccounted too)
            return path == "mutant" and self.unaccounted[path] - self.unaccounted["reference"] > 64 * 1024
        if check == "raises":
            return bool(self.raised.get(path))
        if check == "ids":
            return self.ids.get(path) is not None
        raise ValueError(f"unknown check {check!r}")


def model_path(model: str) -> str:
    """A preset name as is; a ``lowlat.models.variants`` name, or ``PRESET+FIELD=INT`` (one ModelConfig field
    replaced), as a checkpoint directory of seeded random weights (written once per process)."""
    from lowlat.loader.presets import PRESETS, get_preset

    if model in PRESETS:
        return model
    if model not in _CHECKPOINTS:
        from lowlat.loader.synthetic import write_checkpoint
        from lowlat.models.variants import variant

        if "+" in model:
            preset, _, assign = model.partition("+")
            key, _, value = assign.partition("=")
            config = dataclasses.replace(get_preset(preset), **{key: int(value)})
        else:
            config = variant(model).config()
        out = Path(tempfile.mkdtemp(prefix="lowlat-variant-"))
        write_checkpoint(config, out, seed=0, dtype="float32")
        _CHECKPOINTS[model] = str(out)
    return _CHECKPOINTS[model]


def engine_config(trigger: Any, **overrides: Any) -> Any:
    from lowlat.config import EngineConfig

    kw: dict[str, Any] = dict(model=model_path(trigger.model), device="cpu", dtype=trigger.dtype, plugin="none",
                              page_size=trigger.page_size, max_batch_size=max(4, trigger.batch + 2),
                              max_context_len=trigger.context, max_verify_tokens=16, cuda_graph=False, seed=0)
    kw.update(overrides)
    return EngineConfig(**kw)


def build_plugin(runner: Any, name: str, cls: type, *, tp_rank: int = 0, tp_size: int = 1, tp_group: Any = None
                 ) -> tuple[Any, Any]:
    """(forward, binding): ``cls`` built as core builds a plugin, on ``runner``'s parameters and KV pool."""
    from lowlat.plugin.binding import PluginBinding

    binding = PluginBinding(plugin=name, model_config=runner.model_config, engine_config=runner.config,
                            device=runner.device, dtype=runner.dtype,
                            params=dict(runner.model.named_parameters(remove_duplicate=False)),
                            tp_rank=tp_rank, tp_size=tp_size, tp_group=tp_group)
    forward = cls(binding)
    binding.attach_kv_pool(runner.kv_pool)
    return forward, binding


def _fields(batch: Any) -> dict[str, torch.Tensor]:
    return {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)
            if isinstance(getattr(batch, f.name), torch.Tensor)}


def _copy(batch: Any, replay: bool = False) -> Any:
    extra = {"seq_lens_cpu": None, "extend_lens_cpu": None} if replay else {}
    return dataclasses.replace(batch, **{k: t.clone() for k, t in _fields(batch).items()}, **extra)


def held(obj: Any, exclude: set[int]) -> tuple[int, int]:
    """(tensors, bytes of distinct storages) reachable from ``obj``'s attributes, lists and dicts, leaving out
    storages whose data pointer is in ``exclude``."""
    seen: set[int] = set()
    ptrs: dict[int, int] = {}
    count = 0
    stack = [obj]
    while stack:
        x = stack.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            s = x.untyped_storage()
            if s.data_ptr() not in exclude:
                count += 1
                ptrs[s.data_ptr()] = s.nbytes()
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple, set)):
            stack.extend(x)
        elif hasattr(x, "__dict__") and not isinstance(x, type) and not callable(x):
            stack.extend(vars(x).values())
    return count, sum(ptrs.values())


def _outside(before: list[torch.Tensor], pool: Any, loc: torch.Tensor) -> int:
    bufs = [b for kv in zip(pool.k_buffers, pool.v_buffers) for b in kv]
    own = torch.zeros(pool.num_slots, dtype=torch.bool)
    own[loc] = True
    return sum(int(((now != old).reshape(now.shape[0], -1).any(dim=1) & ~own).sum()) for now, old in zip(bufs, before))


def _run_paths(runner: Any, plugins: dict[str, Any], batch: Any, ev: Evidence, *, replay: bool = False
               ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """One step on every path from the same KV state: (logits, K/V at out_cache_loc [T, -1]) per path; the
    general path runs last and its K/V stay (the cache remains the oracle's)."""
    pool = runner.kv_pool
    before = kv_state(pool)
    out = {}
    for path, fwd in plugins.items():
        b = _copy(batch, replay)
        saved = {k: t.clone() for k, t in _fields(b).items()}
        try:
            with torch.inference_mode():
                logits = fwd.forward(b)
        except Exception:
            raise
        except BaseException as e:  # noqa: B036 - a skip/exit raised from a forward: the defect "raises"
            ev.raised.setdefault(path, []).append(type(e).__name__)
            kv_restore(pool, before)
            continue
        out[path] = (logits.float(), _kv_rows(pool, batch))
        ev.outside[path] = ev.outside.get(path, 0) + _outside(before, pool, batch.out_cache_loc)
        changed = [k for k, t in _fields(b).items() if not torch.equal(t, saved[k])]
        ev.inputs[path] = sorted(set(ev.inputs.get(path, [])) | set(changed))
        kv_restore(pool, before)
    with torch.inference_mode():
        logits = runner.general_forward(_copy(batch))
    out["general"] = (logits.float(), _kv_rows(pool, batch))
    return out


def _kv_rows(pool: Any, batch: Any) -> torch.Tensor:
    return kv_at(pool, batch.out_cache_loc).float().transpose(0, 1).reshape(batch.num_tokens, -1)


def _compare(ev: Evidence, out: dict[str, tuple[torch.Tensor, torch.Tensor]], tol: Any, what: str) -> None:
    for path in ("mutant", "reference"):
        if path not in out:
            continue
        (lg, kv), (wlg, wkv) = out[path], out["general"]
        ev.errors[path] = tol.check(lg, wlg, f"{what}: logits") or tol.check(kv, wkv, f"{what}: K/V written")


def _step_args(trigger: Any) -> tuple[Any, int]:
    from lowlat.forward_batch import ForwardMode

    return ForwardMode[trigger.mode], trigger.tokens


def probe(name: str) -> Evidence:
    """Run mutant ``name`` at its trigger (``MUTANTS[name].trigger``) beside the reference and the general path.

    Raises:
        KeyError: an unknown mutant.
    """
    from lowlat.runtime import ModelRunner

    from lowlat_contract.plugins.mutants import MUTANTS
    from lowlat_contract.plugins.reference import ReferenceForward

    m = MUTANTS[name]
    trig = m.trigger
    from lowlat_contract.mutation_probe_audit import AUDIT_CHECKS, probe_audit

    if trig.check in AUDIT_CHECKS:
        return probe_audit(name)
    if trig.check == "tp":
        from lowlat_contract.mutation_tp import probe_tp

        return probe_tp(name)
    seed = 0
    if trig.check == "second_engine":  # a first engine with other weights builds the mutant first; the
        seed = 2  # compared engine has weights no earlier build in this process can have had
        first = ModelRunner(engine_config(trig, seed=1), show_progress=False)
        try:
            build_plugin(first, name, m.cls)
        finally:
            first.close()
    runner = ModelRunner(engine_config(trig, seed=seed), show_progress=False)
    ev = Evidence()
    try:
        built = {"mutant": build_plugin(runner, name, m.cls), "reference": build_plugin(runner, "reference",
                                                                                         ReferenceForward)}
        plugins = {path: fb[0] for path, fb in built.items()}
        exclude = {t.untyped_storage().data_ptr() for t in built["mutant"][1].params.values()}
        exclude |= {b.untyped_storage().data_ptr() for b in [*runner.kv_pool.k_buffers, *runner.kv_pool.v_buffers,
                                                             runner.kv_pool.req_to_token]}
        for path, (fwd, binding) in built.items():
            ev.unaccounted[path] = held(fwd, exclude)[1] - binding.workspace_bytes
        if trig.check == "unaccounted":
            return ev
        if trig.check == "ids":
            from lowlat_contract.ids_probe import probe_ids

            for path, fwd in plugins.items():
                ev.ids[path] = probe_ids(fwd, runner.device)
            return ev
        mode, tpr = _step_args(trig)
        tol = TOLERANCES[trig.dtype]
        replay = trig.check == "replay"
        if trig.warmup:  # one plugin step on other requests first (what the plugin remembers from it); for
            with Requests.with_prefixes(runner, list(trig.warmup), seed=99) as w:  # "replay": the captured step
                batch = w.step(mode, tpr)
                if replay:
                    for fwd in plugins.values():
                        if hasattr(fwd, "prepare_for_capture"):
                            fwd.prepare_for_capture(_copy(batch, replay=True))
                _run_paths(runner, plugins, batch, ev, replay=replay)
        if trig.check == "recycle":
            _recycle(runner, plugins, trig, ev, tol)
            return ev
        lens = list(trig.prefix) if trig.prefix else prefix_lens(trig.batch)
        with Requests.with_prefixes(runner, lens, seed=7) as reqs:
            for _ in range(trig.steps):
                out = _run_paths(runner, plugins, reqs.step(mode, tpr), ev, replay=replay)
                for path, fwd in plugins.items():
                    ev.held.setdefault(path, []).append(held(fwd, exclude))
            _compare(ev, out, tol, f"{name} at {trig.describe()}")
    finally:
        runner.close()
    return ev


def _recycle(runner: Any, plugins: dict[str, Any], trig: Any, ev: Evidence, tol: Any) -> None:
    """Request A steps in row r and is freed; row r goes to request B, whose pages differ (a filler request
    took A's pages first) while their number is the same; B's step is compared."""
    from lowlat.forward_batch import ForwardMode

    pool, n = runner.kv_pool, (trig.prefix or (20,))[0]
    gen = torch.Generator().manual_seed(3)

    def prefill(row: int) -> None:
        toks = torch.randint(0, runner.model_config.vocab_size, (n,), generator=gen).tolist()
        with torch.inference_mode():
            runner.general_forward(runner.prepare_batch(ForwardMode.PREFILL, [row], [0], [toks]))

    def step(row: int) -> Any:
        return runner.prepare_batch(ForwardMode.DECODE, [row], [n], [[int(torch.randint(0, 100, (1,), generator=gen))]])

    row = pool.alloc_req()
    prefill(row)
    _run_paths(runner, plugins, step(row), ev)
    pool.free_req(row)
    row_b = pool.alloc_req()
    filler = pool.alloc_req()
    pool.alloc_slots(filler, n + 1)  # takes A's pages
    prefill(row_b)
    out = _run_paths(runner, plugins, step(row_b), ev)
    _compare(ev, out, tol, f"row {row_b} recycled (was row {row}), prefix {n}")
    pool.free_req(row_b)
    pool.free_req(filler)


def main(argv: list[str] | None = None) -> int:
    """Probe mutants (default all) and print the evidence; returns 1 when one is not real."""
    import sys

    from lowlat_contract.plugins.mutants import MUTANTS

    torch.set_num_threads(1)
    bad = 0
    for name in (argv if argv is not None else sys.argv[1:]) or [n for n in MUTANTS if n != "control"]:
        m = MUTANTS[name]
        ev = probe(name)
        check = m.trigger.check
        real = ev.defect(check, "mutant") and not ev.defect(check, "reference")
        bad += not real
        detail = ev.errors.get("mutant") if check in ("outputs", "replay", "recycle", "tp", "second_engine") else {
            "outside": ev.outside, "inputs": ev.inputs, "growth": ev.held, "unaccounted": ev.unaccounted,
            "raises": ev.raised}.get(check, ev)
        print(f"{name}: {'REAL' if real else 'NOT REAL'} ({check} at {m.trigger.describe()})\n    {detail}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
