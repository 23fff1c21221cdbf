"""Tensor-parallel ranks agree on the plugin they run, before weights load and after build.

Each rank discovers and guards plugins on its own, so ranks can differ (a plugin whose import fails on one
rank only, a build that fails on one GPU). A disagreement left alone becomes mismatched collectives (one rank
runs the plugin's all-reduce, another the general path's) and a C++ abort. So every rank reports its
outcome over the host-side group (``all_gather_strings``, gloo) and all ranks take the same decision:

* selection (``select_agreed``): an explicit request that failed on any rank raises RankDisagreement on
  every rank, listing each rank's reason; ``auto`` keeps only the candidates usable on every rank (a plugin
  dropped that way is recorded in ``rejections`` with the ranks' reasons);
* build (``agree_build``, used by ``PluginHost.build``): a build that failed on any rank counts as failed on
  all; explicit requests raise on every rank, ``auto`` moves on to its next candidate together.

Collectives here are bounded by the process group's timeout (LOWLAT_TP_TIMEOUT seconds).
"""

from __future__ import annotations

import json
import logging
from typing import Any

import torch

from lowlat.plugin.errors import LowlatPluginError, RankDisagreement

log = logging.getLogger("lowlat.plugin")


def all_gather_strings(value: str, group: Any = None) -> list[str]:
    """Every rank's ``value``, in rank order (host tensors over ``group``; None is the default group)."""
    import torch.distributed as dist

    data = torch.tensor(list(value.encode()), dtype=torch.uint8)
    world = dist.get_world_size(group)
    n = torch.tensor([data.numel()], dtype=torch.int64)
    lens = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(lens, n, group=group)
    size = max(int(x.item()) for x in lens)
    buf = torch.zeros(max(size, 1), dtype=torch.uint8)
    buf[: data.numel()] = data
    bufs = [torch.zeros_like(buf) for _ in range(world)]
    dist.all_gather(bufs, buf, group=group)
    return [bytes(b[: int(k.item())].tolist()).decode() for b, k in zip(bufs, lens)]


class AgreementTimeout(RuntimeError):
    """A rank did not report its plugin outcome in time (it is stuck, stopped or dead)."""


def gather_reports(mine: dict[str, Any], group: Any, what: str = "plugin outcome") -> list[dict[str, Any]]:
    """All ranks' JSON-able reports, in rank order.

    Raises:
        AgreementTimeout: the collective failed or timed out (names the setting; a dead worker's own error is
            reported by the engine in its place).
    """
    import os

    try:
        return [json.loads(s) for s in all_gather_strings(json.dumps(mine), group)]
    except RuntimeError as e:
        limit = os.environ.get("LOWLAT_TP_TIMEOUT", "300")
        raise AgreementTimeout(f"not every tensor-parallel rank reported its {what} within the start-up deadline "
                               f"(LOWLAT_TP_TIMEOUT={limit} s) or a rank died: {str(e).splitlines()[0]}") from e


def _per_rank(reports: list[dict[str, Any]], key: str) -> str:
    return "; ".join(f"rank {r}: {rep[key] or 'ok'}" for r, rep in enumerate(reports))


def select_agreed(engine: Any, model: Any, *, tp_size: int, group: Any = None) -> Any:
    """``PluginHost.select`` on every rank, then one decision for all (see the module docstring).

    Raises:
        The rank's own selection error at tp_size 1; RankDisagreement (on every rank) when an explicit request
        failed on any rank, or when ranks' selection errors differ.
    """
    from lowlat.plugin.host import PluginHost

    try:
        host, err = PluginHost.select(engine, model), None
    except LowlatPluginError as e:
        host, err = None, e
    if tp_size == 1:
        if err is not None:
            raise err
        return host
    mine = {"error": f"{type(err).__name__}: {err}" if err is not None else None,
            "candidates": [c.plugin.name for c in host.candidates] if host is not None else [],
            "rejections": list(host.rejections) if host is not None else []}
    reports = gather_reports(mine, group, "plugin selection")
    if any(rep["error"] for rep in reports):
        if err is not None and all(rep["error"] == mine["error"] for rep in reports):
            raise err  # every rank failed the same way: the plain error says it best
        raise RankDisagreement(f"plugin {engine.plugin!r}: the tensor-parallel ranks did not select the same plugin "
                               f"({_per_rank(reports, 'error')}); every rank stops before loading weights. Make "
                               "the plugin importable and its guard pass on every rank, or use --plugin none")
    assert host is not None
    if engine.plugin != "auto" or len({tuple(r["candidates"]) for r in reports}) == 1:
        return host
    common = [n for n in reports[0]["candidates"] if all(n in rep["candidates"] for rep in reports)]
    for name in dict.fromkeys(n for rep in reports for n in rep["candidates"]):
        if name in common:
            continue
        missing = [r for r, rep in enumerate(reports) if name not in rep["candidates"]]
        why = [f"rank {r}: {line}" for r in missing for line in reports[r]["rejections"] if line.startswith(name + ":")]
        line = (f"{name}: not usable on every rank (not on rank(s) {', '.join(map(str, missing))}"
                f"{': ' + '; '.join(why) if why else ''}); all ranks skip it together")
        host.rejections.append(line)
        log.warning("auto: %s", line)
    host.candidates = [c for c in host.candidates if c.plugin.name in common]
    host.selection = host.candidates[0] if host.candidates else None
    return host


def agree_build(name: str, err: BaseException | None, fatal: bool, *, tp_size: int, group: Any
                ) -> list[dict[str, Any]] | None:
    """Share this rank's build outcome; None when every rank built ``name``, else every rank's report.

    Each report is {"error": str or None, "fatal": bool}. At tp_size 1 no collective runs.
    """
    mine = {"error": f"{type(err).__name__}: {err}" if err is not None else None, "fatal": fatal}
    reports = [mine] if tp_size == 1 else gather_reports(mine, group, f"build outcome of plugin {name!r}")
    return None if not any(rep["error"] for rep in reports) else reports


def build_failure_text(name: str, reports: list[dict[str, Any]]) -> str:
    """The tail of "build failed...": ": <error>" on one rank, " on N of M ranks: rank 0: ...; ..." under TP."""
    if len(reports) == 1:
        return f": {reports[0]['error']}"
    return f" on {sum(bool(r['error']) for r in reports)} of {len(reports)} ranks: {_per_rank(reports, 'error')}"
