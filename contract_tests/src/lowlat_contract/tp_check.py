"""Processes that check TP agreement for the fallback contract: all ranks take one path, same logits.

``run_tp_check(case, device, mode, world=N)`` starts N ranks, 2 to 4 (gloo on CPU; NCCL plus gloo on GPUs).

- "tp" (the spec allows ``tp_size`` 2): each rank joins the group exactly as an Engine rank does
  (``lowlat.runtime.tp_launch.init_rank``) and builds ``ModelRunner(config, tp=..., cpu_group=...)`` with
  ``tp_size=2``, so the model, the plugin and the runtime's own Dispatcher are sharded and wired as in serving.
- "replicas" (plugins limited to TP size 1): each rank runs the whole model at TP size 1 and a Dispatcher over
  the two-process group decides the path, which exercises the same agreement with the plugin's real forward.

Each rank runs three DECODE steps: one request; two requests; two requests with rank 1's ``supports()``
wrapped to refuse; then, when coverage has it, a VERIFY step of two requests x 2 tokens. Before each step it
reports its own answer and the agreed path (so a rank that later fails in a mismatched collective still leaves
the evidence); after it, its logits and, when the plugin ran, the general path's logits for the same step. A
plugin step goes through the isolated oracle on every rank (``oracle.check_step``: each rank's K/V shard at and
outside out_cache_loc, its inputs and its parameters), whose problems the rank reports with the step: a
defect of one rank's store that no logit shows (a spill into a free slot) is caught on that rank.
"""

from __future__ import annotations

import datetime
import io
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from typing import Any

import torch

STEPS = ("one request", "two requests", "two requests, rank 1 refuses", "verify, two requests x 2 tokens")
"""The steps each rank runs: DECODE except the last, a VERIFY of 2 tokens per request (when coverage has it)."""
RANK_TIMEOUT_S = 60  # collectives of a rank whose peer went another way fail after this


class _Refusing:
    """Wraps a PluginForward so that supports() says no; everything else passes through."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def supports(self, batch: Any) -> bool:
        return False

    def forward(self, batch: Any) -> torch.Tensor:
        return self.inner.forward(batch)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_tp_check(case: Any, device: str, mode: str, timeout_s: float = 240.0, world: int = 2) -> list[dict[str, Any]]:
    """Run ``world`` ranks (2 to 4); returns each rank's report, rank 0 first.

    A report is ``{"steps": [{"name", "local", "path", "logits", "general"}...], "error": str | None}``; a
    step that did not finish lacks "logits". Never raises for a rank's failure: it is in "error".
    """
    # fork on CPU (the ranks start at once, torch already imported); spawn where CUDA is in use (it does not
    # survive a fork)
    forkable = device == "cpu" and not torch.cuda.is_initialized() and "fork" in mp.get_all_start_methods()
    method = "fork" if forkable else "spawn"
    ctx = mp.get_context(method)
    results = ctx.Queue()
    init = f"tcp://127.0.0.1:{_free_port()}"
    procs = [ctx.Process(target=_rank_main, args=(r, init, case, device, mode, results, world), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    reports: list[dict[str, Any]] = [{"steps": [], "error": None, "done": False} for _ in procs]
    deadline = time.monotonic() + timeout_s
    try:
        while not all(r["done"] for r in reports) and time.monotonic() < deadline:
            try:
                rank, kind, payload = results.get(timeout=1.0)
            except queue.Empty:
                for i, p in enumerate(procs):
                    if not p.is_alive() and not reports[i]["done"]:
                        reports[i].update(done=True, error=reports[i]["error"] or f"exited with code {p.exitcode}")
                continue
            rep = reports[rank]
            if kind == "step":
                rep["steps"].append(payload)
            elif kind == "result":
                rep["steps"][-1].update(torch.load(io.BytesIO(payload), weights_only=True))
            elif kind == "error":
                rep.update(done=True, error=payload)
            else:
                rep["done"] = True
        for i, rep in enumerate(reports):
            if not rep["done"]:
                rep["error"] = f"rank {i} did not finish within {timeout_s:.0f} s"
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    return reports


def _rank_main(rank: int, init: str, case: Any, device: str, mode: str, results: Any, world: int = 2) -> None:
    import torch.distributed as dist

    os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                       "LOWLAT_TP_TIMEOUT": str(RANK_TIMEOUT_S)})
    try:
        if device == "cpu":
            torch.set_num_threads(1)
        _steps(rank, init, case, device, mode, results, world)
        results.put((rank, "done", None))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _runner(rank: int, init: str, case: Any, device: str, mode: str, world: int = 2) -> tuple[Any, Any]:
    import torch.distributed as dist
    from lowlat.runtime import ModelRunner
    from lowlat.runtime.dispatch import Dispatcher
    from lowlat.runtime.tp_launch import init_rank

    from lowlat_contract.harness import dispatcher_of

    if mode == "tp":
        config = case.engine_config(tp_size=world, device=device)
        ctx = init_rank(config, rank, world, local_rank=rank, init_method=init)
        runner = ModelRunner(config, tp=ctx.tp, device=ctx.device, cpu_group=ctx.cpu_group, show_progress=False)
        return runner, dispatcher_of(runner)
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("cpu:gloo,cuda:nccl" if device == "cuda" else "gloo", init_method=init, rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=RANK_TIMEOUT_S))
    dev = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
    runner = ModelRunner(case.engine_config(device=device), device=dev, show_progress=False)
    base = dispatcher_of(runner)
    return runner, Dispatcher(plugin=base.plugin, coverage=base.coverage, plugin_forward=base.plugin_forward,
                              general_forward=runner.general_forward, vocab_size=base.vocab_size,
                              tp_size=world, tp_group=dist.group.WORLD)


def _steps(rank: int, init: str, case: Any, device: str, mode: str, results: Any, world: int = 2) -> None:
    from lowlat.forward_batch import ForwardMode

    from lowlat_contract.harness import Requests, prefix_lens
    from lowlat_contract.oracle import check_step

    runner, d = _runner(rank, init, case, device, mode, world)
    try:
        with Requests.with_prefixes(runner, prefix_lens(1), seed=21) as one, \
                Requests.with_prefixes(runner, prefix_lens(2), seed=22) as two:
            verify = d.coverage.covers(ForwardMode.VERIFY, 4) and case.max_verify_tokens >= 2
            for name, reqs in zip(STEPS if verify else STEPS[:3], (one, two, two, two)):
                fm = ForwardMode.VERIFY if name.startswith("verify") else ForwardMode.DECODE
                batch = reqs.step(fm, 2 if fm is ForwardMode.VERIFY else 1)
                inner = d.plugin_forward
                if name.endswith("refuses") and rank == 1:
                    d.plugin_forward = _Refusing(inner)
                try:
                    local = d.coverage.covers(batch.forward_mode, batch.num_tokens) and \
                        bool(d.plugin_forward.supports(batch))
                    with torch.inference_mode():
                        path = d.choose(batch)
                    results.put((rank, "step", {"name": name, "local": local, "path": path}))
                    found: list[str] = []
                    if path == "plugin":  # the isolated oracle on this rank: its K/V slots, inputs, parameters
                        res = check_step(runner, batch, case.tolerance, f"{name}, rank {rank}")
                        logits, general, found = res.logits, res.want, res.problems
                    else:
                        with torch.inference_mode():
                            logits, general = d.run(path, batch).clone(), None
                finally:
                    d.plugin_forward = inner
                buf = io.BytesIO()  # bytes, not tensors: torch would pass tensors through this process's memory
                torch.save({"logits": logits.cpu(), "general": None if general is None else general.cpu(),
                            "problems": found}, buf)
                results.put((rank, "result", buf.getvalue()))
    finally:
        runner.close()
