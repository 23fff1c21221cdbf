"""The probe checks of the audit mutants (``plugins/mutants/audit.py``) that ``mutation_probe`` has no evidence for.

``probe_audit(name)`` runs mutant ``name`` at its trigger beside the reference and the general path, like
``mutation_probe.probe``, for the checks in AUDIT_CHECKS:

- "params": a parameter of the general model (shared with the plugins) differs bitwise after a plugin call;
- "built": live device memory (process-wide tensor storages, ``memory.live_tensors``) that building the
  plugin added beyond ``binding.workspace_bytes``, against the reference's (its RoPE tables);
- "live": live tensors in the process (``memory.live_tensors``) grow with the steps of one plugin;
- "scaled": outputs with attention scores scaled up (``stress.scale_attention_scores``, FACTOR);
- "high_rows": outputs with the step's requests in rows 32 and above (32 fillers hold the low ones);
- "tp_outside": K/V slots written outside out_cache_loc on any TP rank (2 gloo ranks at tp_size 2).

Returns an ``AuditEvidence`` (an ``Evidence`` with those fields) whose ``defect(check, path)`` answers them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lowlat_contract.probe_steps import Evidence

AUDIT_CHECKS = frozenset({"params", "built", "live", "scaled", "high_rows", "tp_outside"})


@dataclass
class AuditEvidence(Evidence):
    """Evidence plus ``params[path]`` (parameters changed by its calls), ``built[path]`` (bytes built beyond
    the accounted workspaces) and ``live[path]`` (live tensors after each step)."""

    params: dict[str, list[str]] = field(default_factory=dict)
    built: dict[str, int] = field(default_factory=dict)
    live: dict[str, list[int]] = field(default_factory=dict)

    ALIASES = {"scaled": "outputs", "high_rows": "outputs", "tp_outside": "outside"}  # read as the base reads those

    def defect(self, check: str, path: str) -> bool:
        if check == "params":
            return bool(self.params.get(path))
        if check == "built":
            return path == "mutant" and self.built[path] - self.built["reference"] > 64 * 1024
        if check == "live":
            return self.live[path][-1] > self.live[path][0]
        return super().defect(self.ALIASES.get(check, check), path)


def probe_audit(name: str) -> AuditEvidence:
    """The evidence for mutant ``name`` at its trigger (module docstring). Raises KeyError for an unknown one."""
    from lowlat.runtime import ModelRunner

    from lowlat_contract.cases import TOLERANCES
    from lowlat_contract.harness import Requests, prefix_lens
    from lowlat_contract.memory import live_tensors
    from lowlat_contract.oracle import ParamWatch
    from lowlat_contract.plugins.mutants import MUTANTS
    from lowlat_contract.plugins.reference import ReferenceForward
    from lowlat_contract.probe_steps import _compare, _run_paths, _step_args, build_plugin, engine_config
    from lowlat_contract.stress import FACTOR, scale_attention_scores

    m = MUTANTS[name]
    trig = m.trigger
    ev = AuditEvidence()
    if trig.check == "tp_outside":
        from lowlat_contract.mutation_tp import probe_tp

        ranks = probe_tp(name, all_ranks=True)
        ev.outside = {p: sum(r.outside.get(p, 0) for r in ranks) for p in ("mutant", "reference")}
        return ev
    fillers = 32 if trig.check == "high_rows" else 0
    runner = ModelRunner(engine_config(trig, max_batch_size=max(4, trig.batch + 2) + fillers), show_progress=False)
    try:
        if trig.check == "scaled":
            scale_attention_scores(runner.model, runner.model_config, FACTOR)
        plugins, classes = {}, {"mutant": m.cls, "reference": ReferenceForward}
        for path, cls in classes.items():
            before = live_tensors(runner.device)[1]
            fwd, binding = build_plugin(runner, name if path == "mutant" else "reference", cls)
            after = live_tensors(runner.device)[1]
            ev.built[path] = sum(n for p, n in after.items() if p not in before) - binding.workspace_bytes
            plugins[path] = fwd
        if trig.check == "built":
            return ev
        mode, tpr = _step_args(trig)
        held = [runner.kv_pool.alloc_req() for _ in range(fillers)]
        lens = list(trig.prefix) if trig.prefix else prefix_lens(trig.batch)
        watch = ParamWatch(runner.model)
        try:
            # one path at a time: a changed parameter or a live tensor more is that plugin's
            outs = {}
            for path, fwd in plugins.items():
                with Requests.with_prefixes(runner, lens, seed=7) as reqs:
                    for _ in range(trig.steps):
                        watch.reset()
                        outs[path] = _run_paths(runner, {path: fwd}, reqs.step(mode, tpr), ev)
                        ev.params[path] = sorted(set(ev.params.get(path, [])) | set(watch.changed()))
                        ev.live.setdefault(path, []).append(live_tensors(runner.device)[0])
            out = {**outs["mutant"], "reference": outs["reference"]["reference"]}
            _compare(ev, out, TOLERANCES[trig.dtype], f"{name} at {trig.describe()}")
        finally:
            for row in held:
                runner.kv_pool.free_req(row)
    finally:
        runner.close()
    return ev
