"""``lowlat plugins``: list discovered plugins, their specs and whether each guard passes here."""

from __future__ import annotations

import argparse
import json
from typing import Any

from lowlat.config import EngineConfig, ModelConfig, dtype_name
from lowlat.runtime.plugin_host.discovery import PluginRegistry, discover
from lowlat.runtime.plugin_host.guard import GuardTrace, evaluate
from lowlat.runtime.plugin_host.selection import made_for


def add_parser(sub: Any) -> None:
    p = sub.add_parser("plugins", help="list plugins, their specs and whether each guard passes on this machine")
    p.add_argument("--json", action="store_true", help="print the same information as JSON")
    p.add_argument("--explain", metavar="ARCH", help="print the whole requirement trace for one architecture")
    p.add_argument("--model", help="evaluate model requirements against this checkpoint dir or preset")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--dtype", type=dtype_name, default=None,
                   help="evaluate dtype requirements for this dtype (bf16 etc. accepted; default: auto, as lowlat "
                        "run computes: float32 on a CPU, the model's dtype on a GPU, which needs --model there)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size to evaluate (default 1)")
    p.add_argument("--page-size", type=int, default=16, help="KV page size to evaluate (default 16)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from lowlat.platform import detect_platform

    registry = discover()
    platform = detect_platform(args.device)
    engine = EngineConfig(device=args.device, dtype=args.dtype or "auto", tp_size=args.tp, page_size=args.page_size)
    model = _model(args.model)
    report = collect(registry, platform, engine, model)
    if args.explain:
        return _explain(report, args.explain, args.json)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    _print_table(report)
    return 0


def _model(name: str | None) -> ModelConfig | None:
    if name is None:
        return None
    from lowlat.loader import resolve_model

    return resolve_model(name)


def collect(registry: PluginRegistry, platform: Any, engine: EngineConfig | None,
            model: ModelConfig | None) -> dict[str, Any]:
    """Everything ``lowlat plugins`` shows, as JSON-ready data.

    Each spec is evaluated for a model of its own architecture: against ``model`` when it is one, else with the
    model's requirements skipped. A spec's ``guard`` is "pass" (every requirement checked and met), "fail" (one
    failed) or "not checked" (none failed, ``not_checked`` lists the skipped ones: a pass is not known).
    """
    plugins = []
    for info in registry.plugins.values():
        specs = []
        for spec in info.specs:
            m = model if model is None or model.architecture == spec.architecture else None
            trace = evaluate(info.name, spec, platform, engine, m, architecture=spec.architecture)
            skipped = [r.requirement for r in trace.results if r.status == "skip"]
            specs.append({
                "architecture": spec.architecture,
                "coverage": spec.coverage.describe() + _TP_IDS * (engine.tp_size > 1 and bool(spec.coverage.sampling)),
                "requirements": _requirements(spec),
                "guard": "fail" if not trace.passed else "not checked" if skipped else "pass",
                "not_checked": skipped,
                "reason": trace.summary(),
                "trace": _trace(trace),
            })
        plugins.append({
            "name": info.name, "distribution": info.distribution, "version": info.version,
            "core_range": info.core_range or "(any)", "status": info.status, "error": info.error, "specs": specs,
        })
    return {"core_version": registry.core_version, "platform": platform.describe(), "platform_kind": platform.kind,
            "model": model.architecture if model is not None else None, "plugins": plugins}


_TP_IDS = "; at this TP size the engine samples itself (plugins return ids at tp 1 only)"


def _requirements(spec: Any) -> dict[str, Any]:
    r = spec.requirements
    return {
        "platforms": [p.describe() for p in r.platforms],
        "dtypes": sorted(r.dtypes),
        "tp_sizes": sorted(r.tp_sizes) if r.tp_sizes is not None else "any",
        "page_sizes": sorted(r.page_sizes) if r.page_sizes is not None else "any",
        "features_required": sorted(r.features_required),
        "features_refused": sorted(r.features_refused),
        "libraries": [f"{n}{v}" for n, v in r.libraries],
        "model": {k: list(v) for k, v in r.model},
        "made_for": list(made_for(spec)),
        "environment": spec.check_environment,
    }


def _trace(trace: GuardTrace) -> list[dict[str, str]]:
    return [{"requirement": r.requirement, "status": r.status, "reason": r.reason} for r in trace.results]


def _explain(report: dict[str, Any], arch: str, as_json: bool) -> int:
    rows = [(p, s) for p in report["plugins"] for s in p["specs"] if s["architecture"] == arch]
    broken = [p for p in report["plugins"] if p["status"] != "ok"]
    if as_json:
        print(json.dumps({"architecture": arch, "platform": report["platform"],
                          "specs": [{"plugin": p["name"], **s} for p, s in rows],
                          "unusable_plugins": [{k: p[k] for k in ("name", "status", "error")} for p in broken]},
                         indent=2))
        return 0 if rows else 1
    print(f"Requirement trace for {arch} on {report['platform']} (lowlat {report['core_version']})")
    for p, s in rows:
        verdict = s["guard"].upper() + (f" ({', '.join(s['not_checked'])} skipped; the checked requirements pass)"
                                        if s["guard"] == "not checked" else "")
        print(f"\n{p['name']} ({p['distribution']} {p['version']}): {verdict}  coverage: {s['coverage']}")
        for r in s["trace"]:
            print(f"  [{r['status']:4}] {r['requirement']}: {r['reason']}")
    for p in broken:
        print(f"\n{p['name']} ({p['distribution']} {p['version']}): {p['status'].upper()}: {p['error']}")
    if not rows:
        print(f"\nno usable plugin serves {arch}")
        return 1
    return 0


def _print_table(report: dict[str, Any]) -> None:
    from rich.console import Console

    console = Console(highlight=False, soft_wrap=True)
    console.print(f"lowlat {report['core_version']} on {report['platform']}")
    kind = report["platform_kind"]
    if not report["plugins"]:
        console.print("no plugins installed; pip install 'lowlat[all]'")
        return
    for p in report["plugins"]:
        passing = sum(s["guard"] == "pass" for s in p["specs"])
        unchecked = sum(s["guard"] == "not checked" for s in p["specs"])
        usable = "[green]" if passing else "[yellow]"
        more = f", not fully checked for {unchecked} (see below)" if unchecked else ""
        status = (f"loaded, {usable}guards pass here for {passing} of {len(p['specs'])} architectures{more}[/]"
                  if p["status"] == "ok" else f"[red]{p['status']}[/]: {p['error']}")
        console.print(f"\n[bold]{p['name']}[/]  {p['distribution']} {p['version']}  core range {p['core_range']}  "
                      f"{status}")
        shared = _shared_failures(p["specs"])
        shown = None
        for i, s in enumerate(p["specs"]):
            if s["requirements"] != shown:
                shown = s["requirements"]
                console.print(f"  requirements: {_describe_requirements(shown)}")
            if i == 0 and shared:  # once, above the architectures, instead of once on each
                console.print(f"  [yellow]guards fail[/] here for all {len(p['specs'])} architectures: "
                              f"{_failures_text(shared)}")
            if s["guard"] == "fail" and shared:  # only what this architecture adds to the shared reason
                own = [r for r in s["trace"] if r["status"] == "fail" and r not in shared]
                guard = "[yellow]fail[/] (as above" + (f"; also {_failures_text(own)}" if own else "") + ")"
            elif s["guard"] == "pass" and kind not in s["requirements"]["made_for"]:
                guard = (f"[green]pass[/] (auto leaves it out: made for {'/'.join(s['requirements']['made_for'])}, "
                         f"not {kind}; --plugin {p['name']} runs it)")
            else:
                guard = {"pass": "[green]pass[/]", "fail": f"[yellow]fail[/] ({s['reason']})"}.get(s["guard"]) or (
                    f"[yellow]not checked[/]: {_unchecked(s['not_checked'], report.get('model'))}; "
                    "the checked requirements pass")
            console.print(f"  {s['architecture']:<22} {s['coverage']:<40} guard here: {guard}")


def _shared_failures(specs: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The failed requirements, with their reasons, common to every one of a plugin's specs (its trace entries):
    empty unless it has two or more specs and every guard fails. ``lowlat plugins`` prints them once, above the
    architectures."""
    if len(specs) < 2 or any(s["guard"] != "fail" for s in specs):
        return []
    failed = [[r for r in s["trace"] if r["status"] == "fail"] for s in specs]
    return [r for r in failed[0] if all(r in f for f in failed[1:])]


def _failures_text(results: list[dict[str, str]]) -> str:
    """Failed trace entries as ``GuardTrace.summary`` joins them: "requirement: reason; ..."."""
    return "; ".join(f"{r['requirement']}: {r['reason']}" for r in results)


def _unchecked(names: list[str], model_arch: str | None) -> str:
    """The skipped requirements and what would check them, e.g. "dtype (give --dtype or --model), model.head_dim
    (give --model)"; ``model_arch``: the architecture of ``--model`` when one was given."""
    how: dict[str, list[str]] = {}
    for name in names:
        if name == "dtype":
            hint = "--dtype auto depends on the model: give --dtype or --model"
        elif model_arch is not None and name.startswith("model."):
            hint = f"--model is a {model_arch}, not this architecture"
        elif name.startswith("model."):
            hint = "no --model given"
        else:
            hint = "no engine configuration"
        how.setdefault(hint, []).append(name)
    return ", ".join(f"{', '.join(n)} ({hint})" for hint, n in how.items())


def _describe_requirements(req: dict[str, Any]) -> str:
    parts = [" or ".join(req["platforms"]), "dtype " + "/".join(req["dtypes"]), f"tp {req['tp_sizes']}",
             f"page size {req['page_sizes']}"]
    parts += req["libraries"]
    parts += [f"needs {f}" for f in req["features_required"]] + [f"refuses {f}" for f in req["features_refused"]]
    parts += [f"{k} in {v}" for k, v in req["model"].items()]
    if req.get("environment"):
        parts.append(f"environment checked by {req['environment']}")
    parts.append(f"made for {'/'.join(req['made_for'])} (--plugin auto takes it there only)")
    return "; ".join(parts)
