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

from typing import Any

import torch

from lowlat_contract.cases import TOLERANCES
from lowlat_contract.harness import Requests, prefix_lens
from lowlat_contract.probe_steps import (
    Evidence,
    _compare,
    _copy,
    _run_paths,
    _step_args,
    build_plugin,
    engine_config,
    held,
    model_path,
)

__all__ = ["Evidence", "build_plugin", "engine_config", "held", "model_path", "probe"]

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
