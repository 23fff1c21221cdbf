"""Tensor-parallel ranks agree on the plugin they run, before weights load and after build.

Each rank discovers and guards plugins on its own, so ranks can differ (a plugin whose import fails on one
rank only, a build that fails on one GPU). A disagreement left alone becomes mismatched collectives (one rank
runs the plugin's all-reduce, another the general path's) and a C++ abort. So every rank reports its
outcome over the host-side group (``all_gather_strings``, gloo) and all ranks take the same decision:

* selection (``agreed_selection.select_agreed``): an explicit request that failed on any rank raises
  RankDisagreement on every rank, listing each rank's reason; ``auto`` keeps only the candidates usable on every
  rank (a plugin dropped that way is recorded in ``rejections`` with the ranks' reasons);
* build (``agree_build``, used by ``PluginHost.build``): a build that failed on any rank counts as failed on
  all; explicit requests raise on every rank, ``auto`` moves on to its next candidate together.

Collectives here are bounded by the process group's timeout (LOWLAT_TP_TIMEOUT seconds).
"""

from __future__ import annotations

import json
from typing import Any

import torch


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
