"""The TP half of ``mutation_probe``: a mutant's trigger at tp_size 2, on two gloo ranks on the CPU.

Each rank builds a general-only ModelRunner at tp_size 2 (sharded as an engine rank) and the mutant and the
reference plugin on its shards with the TP group (``dist.group.WORLD``); both ranks run the same steps, so
the collectives match; rank 0 reports its Evidence.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import traceback
from typing import Any

from lowlat_contract.tp_check import _free_port

TIMEOUT_S = 120.0


def probe_tp(name: str, all_ranks: bool = False) -> Any:
    """Evidence of rank 0 (``all_ranks``: a list, rank 0 first) for mutant ``name`` at its trigger with tp_size 2.
    Raises RuntimeError if a rank fails."""
    import torch

    method = "fork" if not torch.cuda.is_initialized() and "fork" in mp.get_all_start_methods() else "spawn"
    ctx = mp.get_context(method)
    results = ctx.Queue()
    init = f"tcp://127.0.0.1:{_free_port()}"
    procs = [ctx.Process(target=_rank, args=(r, init, name, results), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = {}
        while len(got) < 2:
            try:
                rank, payload = results.get(timeout=TIMEOUT_S)
            except queue.Empty:
                raise RuntimeError(f"mutant {name}: a TP rank did not report within {TIMEOUT_S:.0f} s") from None
            got[rank] = payload
        for rank, payload in sorted(got.items()):
            if isinstance(payload, str):
                raise RuntimeError(f"mutant {name}: TP rank {rank} failed:\n{payload}")
        return [got[r] for r in sorted(got)] if all_ranks else got[0]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()


def _rank(rank: int, init: str, name: str, results: Any) -> None:
    try:
        results.put((rank, _steps(rank, init, name)))
    except BaseException:
        results.put((rank, traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _steps(rank: int, init: str, name: str) -> Any:
    import torch
    import torch.distributed as dist
    from lowlat.runtime import ModelRunner
    from lowlat.runtime.tp_launch import init_rank

    from lowlat_contract.cases import TOLERANCES
    from lowlat_contract.harness import Requests, prefix_lens
    from lowlat_contract.plugins.mutants import MUTANTS
    from lowlat_contract.plugins.reference import ReferenceForward
    from lowlat_contract.probe_steps import Evidence, _compare, _run_paths, _step_args, build_plugin, engine_config

    torch.set_num_threads(1)
    m = MUTANTS[name]
    trig = m.trigger
    config = engine_config(trig, tp_size=2)
    tp = init_rank(config, rank, 2, local_rank=rank, init_method=init)
    runner = ModelRunner(config, tp=tp.tp, device=tp.device, cpu_group=tp.cpu_group, show_progress=False)
    try:
        group = dist.group.WORLD
        plugins = {"mutant": build_plugin(runner, name, m.cls, tp_rank=rank, tp_size=2, tp_group=group)[0],
                   "reference": build_plugin(runner, "reference", ReferenceForward, tp_rank=rank, tp_size=2,
                                             tp_group=group)[0]}
        ev = Evidence()
        mode, tpr = _step_args(trig)
        lens = list(trig.prefix) if trig.prefix else prefix_lens(trig.batch)
        with Requests.with_prefixes(runner, lens, seed=7) as reqs:
            for _ in range(trig.steps):
                out = _run_paths(runner, plugins, reqs.step(mode, tpr), ev)
        _compare(ev, out, TOLERANCES[trig.dtype], f"{name} at tp_size 2, {trig.describe()}")
        return ev
    finally:
        runner.close()
