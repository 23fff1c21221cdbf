"""``select_agreed``: every TP rank selects a plugin on its own (``PluginHost.select``), then all take one decision.

Apart from ``agreement.py`` (the collectives ``PluginHost`` itself uses at build), so that module never imports
the host. The rules are ``agreement``'s module docstring.
"""

from __future__ import annotations

import logging
from typing import Any

from lowlat.errors import LowlatPluginError, RankDisagreement
from lowlat.runtime.plugin_host.agreement import _per_rank as per_rank
from lowlat.runtime.plugin_host.agreement import gather_reports
from lowlat.runtime.plugin_host.host import PluginHost

log = logging.getLogger("lowlat.plugin")


def select_agreed(engine: Any, model: Any, *, tp_size: int, group: Any = None) -> Any:
    """``PluginHost.select`` on every rank, then one decision for all (see the module docstring).

    Raises:
        The rank's own selection error at tp_size 1; RankDisagreement (on every rank) when an explicit request
        failed on any rank, or when ranks' selection errors differ.
    """
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
                               f"({per_rank(reports, 'error')}); every rank stops before loading weights. Make "
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
