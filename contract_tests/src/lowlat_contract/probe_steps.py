"""The steps a mutant probe runs (``mutation_probe``, ``mutation_tp``, ``mutation_probe_audit`` share them).

A probe builds a general-only ModelRunner for a trigger's model, dtype, page size and context, builds plugins on
its parameters and KV pool, runs each from the same KV state (restored between them) beside the general forward,
and records in ``Evidence`` how far each plugin is from the general path.
"""

from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lowlat_contract.harness import kv_at, kv_restore, kv_state

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


