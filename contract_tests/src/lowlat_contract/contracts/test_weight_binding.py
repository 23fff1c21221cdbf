"""Weight binding: every parameter the plugin receives is used (perturbing it alone changes the plugin's
output), and checkpoint tensors a spec retains are released after build.

Method: one step (VERIFY when covered, else DECODE) on cached prefixes. For each name in ``binding.params``
the tensor is perturbed in place (``w * (1 + 0.5 u) + 0.1 u``, u ~ N(0, 1), seeded), the plugin is built
again from the perturbed parameters, the step runs, and the output (logits and the K/V it writes) must move by
more than the noise between two unperturbed builds; the tensor is then restored.

``covering`` sweeps (the Triton interpreter, where a step costs 3-10 s and a tiny preset has about 20
parameters): every parameter is perturbed at once, each with its own noise, the plugin is rebuilt, and the
step goes through the isolated oracle against the general path, which reads the same perturbed tensors (the
binding's parameters are the general model's). A plugin that ignores a parameter, reads another layer's, or
keeps a copy from an earlier build computes with an unperturbed tensor where the general path uses the
perturbed one: its output moves by that parameter's whole effect (tens of percent of a row here, against a
bfloat16 bound of 5%). One rebuild and one step instead of one per parameter. The mutants of kind 4 are run
this way too (``test_mutants.py``).
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch

from lowlat_contract.harness import Requests, kv_at, prefix_lens, rebuild_plugin, resolve_shape

PROMISE = ("Perturbing any single parameter the plugin receives changes its output, and retained checkpoint "
           "tensors are released after build.")
pytestmark = pytest.mark.lowlat_contract("weight_binding", PROMISE)


def _step_shape(case: Any) -> Any:
    for name in ("VERIFY-t2", "DECODE-b3", "DECODE-b1"):
        shape = resolve_shape(name, case)
        if not isinstance(shape, str):
            return shape
    pytest.skip("coverage holds no DECODE or VERIFY step")


def _output(forward: Any, batch: Any, pool: Any) -> torch.Tensor:
    with torch.inference_mode():
        logits = forward.forward(batch).float().flatten()
        return torch.cat([logits, kv_at(pool, batch.out_cache_loc).float().flatten()])


def test_every_weight_changes_output(case: Any, runner: Any, dispatcher: Any, request: Any) -> None:
    """Perturbing each parameter alone, then rebuilding the plugin, changes its logits or K/V writes
    (``covering``: all at once, the rebuilt plugin matching the general path on the perturbed model)."""
    from lowlat_contract.pytest_plugin import sweep_mode

    if not case.is_tiny:
        pytest.skip("rebuilds the plugin once per parameter: runs on the tiny presets only")
    params: dict[str, torch.Tensor] = runner.plugin_host.binding.params
    shape = _step_shape(case)
    if sweep_mode(request.config) == "covering":
        _all_at_once(case, runner, dispatcher, params, shape)
        return
    unused = []
    with Requests.with_prefixes(runner, prefix_lens(shape.batch_size), seed=5) as reqs:
        batch = reqs.step(shape.mode, shape.tokens_per_req)
        base = _output(rebuild_plugin(runner)[0], batch, runner.kv_pool)
        noise = float((_output(rebuild_plugin(runner)[0], batch, runner.kv_pool) - base).abs().max())
        gen = torch.Generator(device="cpu").manual_seed(3)
        for name in sorted(params):
            p = params[name]
            saved = p.detach().clone()
            u = torch.randn(p.shape, generator=gen).to(p.device, p.dtype)
            try:
                with torch.inference_mode():
                    p.mul_(1 + 0.5 * u).add_(0.1 * u)
                moved = float((_output(rebuild_plugin(runner)[0], batch, runner.kv_pool) - base).abs().max())
            finally:
                with torch.inference_mode():
                    p.copy_(saved)
            if not moved > max(10 * noise, 0.0):
                unused.append(f"{name} {tuple(p.shape)} (output moved by {moved:.3g}; noise {noise:.3g})")
    assert not unused, ("perturbing these parameters did not change the plugin's output, so the plugin ignores "
                        "them:\n" + "\n".join(unused))


def _all_at_once(case: Any, runner: Any, dispatcher: Any, params: dict[str, torch.Tensor], shape: Any) -> None:
    """The covering form (module docstring): every parameter perturbed, one rebuild, one oracle check."""
    from lowlat_contract.oracle import check_step

    saved = {n: p.detach().clone() for n, p in params.items()}
    gen = torch.Generator(device="cpu").manual_seed(3)
    own = dispatcher.plugin_forward
    try:
        with Requests.with_prefixes(runner, prefix_lens(shape.batch_size), seed=5) as reqs:
            batch = reqs.step(shape.mode, shape.tokens_per_req)
            with torch.inference_mode():
                base = runner.general_forward(batch).float()
                for name in sorted(params):
                    p = params[name]
                    u = torch.randn(p.shape, generator=gen).to(p.device, p.dtype)
                    p.mul_(1 + 0.5 * u).add_(0.1 * u)
            dispatcher.plugin_forward = rebuild_plugin(runner)[0]
            res = check_step(runner, batch, case.tolerance, f"every parameter perturbed: {shape.mode.name} "
                             f"{shape.batch_size}x{shape.tokens_per_req}")
    finally:
        with torch.inference_mode():
            for name, p in params.items():
                p.copy_(saved[name])
        dispatcher.plugin_forward = own
    moved = float((res.want - base).abs().max())
    assert moved > 0.0, "perturbing every parameter left the general path's logits unchanged: the check is void"
    assert not res.problems, ("with every parameter perturbed, the rebuilt plugin no longer matches the general "
                              "path, which reads the perturbed tensors: the plugin ignores a parameter, reads "
                              "another one in its place, or keeps a copy from an earlier build (--lowlat-sweep "
                              "full names the parameter):\n" + "\n".join(res.problems[:4]))


def _tensors_in(obj: Any, depth: int = 0, seen: set[int] | None = None) -> list[torch.Tensor]:
    """Tensors reachable from ``obj`` through attributes, dicts, lists and tuples (bounded depth)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 6:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        items: Any = obj.values()
    elif isinstance(obj, (list, tuple, set)):
        items = obj
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        items = vars(obj).values()
    else:
        return []
    return [t for x in items for t in _tensors_in(x, depth + 1, seen)]


def test_retained_checkpoint_released(case: Any, runner: Any, dispatcher: Any) -> None:
    """After build the binding holds no checkpoint tensor; when the spec retains them, none stays alive or
    reachable from the plugin."""
    from lowlat.loader import open_weights

    binding = runner.plugin_host.binding
    assert not binding.checkpoint_tensors, (f"the binding still holds {len(binding.checkpoint_tensors)} checkpoint "
                                            f"tensors after build")
    if not case.spec.retain_checkpoint or not case.is_tiny:
        return  # nothing was retained (or a second copy of a large checkpoint would not fit): checked above
    _, weights = open_weights(case.model, runner.model_config, seed=case.engine_config().seed, dtype=runner.dtype,
                              device=runner.device)
    ckpt = dict(weights)
    refs = {name: weakref.ref(t) for name, t in ckpt.items()}
    ptrs = {t.untyped_storage().data_ptr(): name for name, t in ckpt.items()}
    forward, new_binding = rebuild_plugin(runner, checkpoint_tensors=ckpt)
    del ckpt, weights
    gc.collect()
    assert not new_binding.checkpoint_tensors
    held = sorted({ptrs[t.untyped_storage().data_ptr()] for t in _tensors_in(forward)
                   if t.untyped_storage().data_ptr() in ptrs})
    alive = sorted(name for name, ref in refs.items() if ref() is not None)
    assert not held, f"the plugin keeps the storage of retained checkpoint tensors after build: {held[:5]}"
    assert not alive, f"retained checkpoint tensors are still alive after build: {alive[:5]}"
