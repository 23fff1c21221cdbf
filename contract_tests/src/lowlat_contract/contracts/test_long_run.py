"""Long runs: over many steps, with requests joining and leaving and the two paths interleaved, every plugin
step's logits and stored K/V match the general path's, and the plugin holds no more memory at the end than
after its first step.

The run (``SCHEDULE``): requests join at different steps with different prompt lengths and leave at different
steps (their rows and pages are reused by later ones); each step is DECODE, or VERIFY of 2 tokens every 7th
step when covered; a seeded coin picks the path of each step (``covering``: a fixed pattern, about 13 plugin
steps). Plugin steps go through the isolated oracle with ``keep="plugin"``: what the plugin stored stays in
the cache, so later steps on either path read it, as in serving. Next tokens are the general path's greedy
picks. Damage that surfaces late (a wrong stored K read many steps later, state kept between calls, a
workspace reused after N calls) shows as a logit or K/V mismatch at that step, not only as a flipped argmax.

Memory: the tensors reachable from the plugin's forward object (count and bytes, CPU and GPU), the process's
live tensors on the device (``memory.live_tensors``: count and storage bytes, so a leak into a module-level
cache or a class attribute counts too; measured at the first plugin step of the run's first two shapes and then
at most every quarter of the run) and, on CUDA, the bytes requested of the allocator (``_allocated``) after each
plugin step, the checked step's outputs released but its logits, must not
exceed what they were after the first plugin step of the same shape (mode, tokens): what a plugin keeps of its
last step may depend on the step's shape. The workspace test checks that building the plugin allocates no
more device memory (CUDA: bytes requested of the allocator; CPU: new live tensor storages) than it obtained through
``binding.alloc_workspace``, plus the RoPE tables and a slack (1 MiB on CUDA, 64 KiB on a CPU).
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from lowlat_contract.harness import rebuild_plugin
from lowlat_contract.oracle import check_step
from lowlat_contract.pytest_plugin import sweep_mode

PROMISE = ("Over a long run with requests joining and leaving and paths interleaved, every plugin step matches the "
           "general path, and the plugin's memory does not grow.")
pytestmark = pytest.mark.lowlat_contract("long_run", PROMISE)

SCHEDULE = ((0, 3, 40), (0, 17, None), (5, 30, 52), (12, 1, None), (41, 9, None), (53, 24, None))
"""(join step, prompt tokens, leave step or None) per request: up to 4 at once, 6 in all, rows reused."""
STEPS = {"full": 128, "covering": 64}
PLUGIN_SHARE = 0.85
"""full: a seeded coin sends this share of the steps to the plugin; covering (a plugin step costs 1.5-10 s under
the interpreter): pairs of consecutive plugin steps every 16 steps and every other VERIFY step, about 13."""
MEMORY_SLACK_BYTES = 1 << 20
CPU_SLACK_BYTES = 64 << 10
LIVE_SHAPES = 2  # shapes whose live tensors are counted (each count is one pass over the interpreter's objects)


def _reachable(obj: Any) -> tuple[int, int]:
    from lowlat_contract.contracts.test_weight_binding import _tensors_in

    seen: dict[int, torch.Tensor] = {}
    for t in _tensors_in(obj):
        seen.setdefault(id(t), t)
    return len(seen), sum(t.numel() * t.element_size() for t in seen.values())


def _allocated(device: torch.device) -> int:
    """CUDA: the bytes the live tensors asked for (``requested_bytes.all.current``). Not ``memory_allocated``:
    it counts whole allocator blocks, and a block of a
    large tensor keeps an unsplit remainder of up to 1 MiB, so the same tensors read up to 1 MiB more after
    one step than after another (seen on the H200: 1.2-1.5 MB between two steps of one shape at qwen3-8b and
    qwen3-30b-a3b, from the checked step's own logits). CPU: 0 (the live-tensor count covers it)."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    return int(torch.cuda.memory_stats(device)["requested_bytes.all.current"])


def test_workspaces_are_accounted(case: Any, runner: Any, dispatcher: Any) -> None:
    """Building the plugin allocates no more device memory than ``binding.alloc_workspace`` handed out, plus the
    RoPE tables (``binding.rope_cos_sin``, not accounted by design) and a slack (CUDA: ``_allocated``,
    1 MiB; CPU: the storages of live tensors that building added, wherever they are held, 64 KiB)."""
    from lowlat_contract.memory import live_tensors, new_bytes

    dev = runner.device
    if dev.type == "cuda":
        before = _allocated(dev)
        forward, binding = rebuild_plugin(runner)
        grown = _allocated(dev) - before
        slack = MEMORY_SLACK_BYTES
    else:
        base = live_tensors(dev)[1]
        forward, binding = rebuild_plugin(runner)
        grown, slack = new_bytes(base, live_tensors(dev)[1]), CPU_SLACK_BYTES
    mc = runner.model_config
    rope = 2 * runner.config.max_context_len * (mc.head_dim // 2) * 4 * 2  # cos and sin, float32, maybe doubled
    allowed = binding.workspace_bytes + rope + slack
    del forward
    assert grown <= allowed, (f"building the plugin allocated {grown} bytes of device memory, but only "
                              f"{binding.workspace_bytes} went through binding.alloc_workspace (allowed {allowed}); "
                              f"allocate workspaces with alloc_workspace so the KV pool sizing counts them")


MANY_CALLS = 300
"""Plugin calls before the checked steps of ``test_many_calls``: past 200 (warm-ups, autotuners) and 256 (an 8-bit
counter wrapping)."""


def test_many_calls(case: Any, runner: Any, dispatcher: Any, request: Any) -> None:
    """After MANY_CALLS calls of the plugin's forward on one instance (one DECODE batch, run again and again: its
    K/V writes are the same each time), DECODE and VERIFY steps still match the general path: state that changes
    after N calls (an autotuner switching configs, a ring of per-call buffers wrapping) surfaces. It runs before
    the long run, which then starts on a plugin past its first MANY_CALLS calls. ``full`` mode only (plain torch
    and GPUs: a call costs milliseconds; under the interpreter seconds)."""
    from lowlat.forward_batch import ForwardMode

    from lowlat_contract.harness import Requests
    from lowlat_contract.oracle import restore, snapshot

    if sweep_mode(request.config) != "full":
        pytest.skip(f"{MANY_CALLS} calls: full sweep mode only (covering runs under the Triton interpreter)")
    cov = case.spec.coverage
    if not cov.covers(ForwardMode.DECODE, 3):
        pytest.skip("DECODE with 3 requests is outside the spec's coverage")
    problems: list[str] = []
    with Requests.with_prefixes(runner, [41, 70, 100], seed=500) as reqs:
        batch = reqs.step(ForwardMode.DECODE, 1)
        snap = snapshot(runner.kv_pool)
        with torch.inference_mode():
            for _ in range(MANY_CALLS):
                dispatcher.run("plugin", batch)
        restore(runner.kv_pool, snap)
        problems += check_step(runner, batch, case.tolerance, f"DECODE 3x1 after {MANY_CALLS} calls").problems
        n = min(4, case.max_verify_tokens)
        if cov.covers(ForwardMode.VERIFY, 3 * n) and n >= 2:
            verify = reqs.step(ForwardMode.VERIFY, n)
            problems += check_step(runner, verify, case.tolerance, f"VERIFY 3x{n} after {MANY_CALLS} calls").problems
    assert not problems, f"after {MANY_CALLS} plugin calls the plugin no longer matches:\n" + "\n".join(problems[:6])


def test_long_run_matches_general(case: Any, runner: Any, dispatcher: Any, request: Any,
                                  contract_notes: list[str]) -> None:
    """The scheduled run (module docstring): every plugin step within tolerance; memory flat."""
    from lowlat.forward_batch import ForwardMode

    cov, mode = case.spec.coverage, sweep_mode(request.config)
    if ForwardMode.DECODE not in cov.modes:
        pytest.skip("DECODE is not in the spec's coverage")
    pool, vocab = runner.kv_pool, runner.model_config.vocab_size
    coin = random.Random(1234)
    gen = torch.Generator().manual_seed(77)
    active: dict[int, dict[str, Any]] = {}  # request id -> {"row", "len", "next"}
    problems: list[str] = []
    plugin_steps = 0
    first_mem: dict[tuple[str, int], tuple[tuple[int, int], int, int]] = {}  # step shape -> (held, device, step)
    grown: list[str] = []
    live: dict[tuple[str, int], tuple[tuple[int, int], int]] = {}  # shape -> (first count, bytes), last step seen
    try:
        for step in range(STEPS[mode]):
            for rid, (join, n, leave) in enumerate(SCHEDULE):
                if leave == step and rid in active:
                    pool.free_req(active.pop(rid)["row"])
                if join == step:
                    active[rid] = _join(runner, n, gen)
            ids = sorted(active)[:cov.max_tokens]
            tpr = 2 if step % 7 == 6 and cov.covers(ForwardMode.VERIFY, 2 * len(ids)) else 1
            fm = ForwardMode.VERIFY if tpr == 2 else ForwardMode.DECODE
            toks = [[active[r]["next"]] + torch.randint(0, vocab, (tpr - 1,), generator=gen).tolist() for r in ids]
            batch = runner.prepare_batch(fm, [active[r]["row"] for r in ids], [active[r]["len"] for r in ids], toks)
            pick = coin.random() < PLUGIN_SHARE if mode == "full" else step % 16 in (0, 1) or step % 14 == 6
            use_plugin = pick and cov.covers(fm, batch.num_tokens) and dispatcher.plugin_forward.supports(batch)
            if use_plugin:
                res = check_step(runner, batch, case.tolerance, f"step {step} ({fm.name} {len(ids)}x{tpr}, contexts "
                                 f"{[active[r]['len'] for r in ids]})", keep="plugin")
                problems += res.problems
                logits = res.want
                del res  # the checked step's other outputs are the harness's, not the plugin's memory
                plugin_steps += 1
                held, dev = _reachable(dispatcher.plugin_forward), _allocated(runner.device)
                key = (fm.name, batch.num_tokens)  # what a plugin keeps of its last step may depend on its shape
                (n0, b0), d0, s0 = first_mem.setdefault(key, (held, dev, step))
                if held[0] > n0 or held[1] > b0 or dev > d0 + MEMORY_SLACK_BYTES:
                    grown.append(f"{key[0]} {key[1]} tokens: after step {s0} the plugin held {n0} tensors ({b0} "
                                 f"bytes; device {d0}), after step {step} {held[0]} ({held[1]} bytes; device {dev})")
                grown += _live_growth(live, key, step, STEPS[mode] // 4, runner.device)
            else:
                with torch.inference_mode():
                    logits = dispatcher.run("general", batch).clone()
            for j, r in enumerate(ids):
                active[r]["len"] += tpr
                active[r]["next"] = int(logits[(j + 1) * tpr - 1].argmax())
                if active[r]["len"] + 3 >= pool.max_context_len:  # full: leave, a short newcomer takes its place
                    pool.free_req(active.pop(r)["row"])
                    active[r] = _join(runner, 5 + step % 11, gen)
            if len(problems) >= 10 or grown:  # growth is a failure already; the rest of the run would add cost only
                break
    finally:
        for r in active.values():
            pool.free_req(r["row"])
    contract_notes.append(f"long_run  {case.id} ({mode}): {STEPS[mode]} steps, {plugin_steps} on the plugin")
    assert not problems, "the long run diverged from the general path:\n" + "\n".join(problems[:10])
    assert not grown, ("the plugin's memory grew over the run (tensors reachable from its forward object; CUDA: "
                       "bytes requested of the allocator), compared after steps of the same shape:\n"
                       + "\n".join(grown[:5]))
    # after the growth check: a run stopped at the first growth has had few plugin steps
    assert plugin_steps >= 8, f"only {plugin_steps} plugin steps ran (supports() refused the others)"


def _live_growth(live: dict[Any, Any], key: Any, step: int, every: int, device: Any) -> list[str]:
    """Count the process's live tensors at the first plugin step of the first LIVE_SHAPES shapes and then at
    most every ``every`` steps per shape; a count or byte total above the shape's first is growth (confirmed
    after a full garbage collection, so that a reference cycle awaiting collection is not taken for a leak)."""
    from lowlat_contract.memory import live_tensors

    if key not in live:
        if len(live) >= LIVE_SHAPES:
            return []
        count, storages = live_tensors(device)
        live[key] = ((count, sum(storages.values())), step)
        return []
    (n0, b0), last = live[key]
    if step - last < every:
        return []
    live[key] = ((n0, b0), step)
    count, storages = live_tensors(device, collect=False)
    if count <= n0 and sum(storages.values()) <= b0:
        return []
    count, storages = live_tensors(device)
    if count <= n0 and sum(storages.values()) <= b0:
        return []
    return [f"{key[0]} {key[1]} tokens: the process held {n0} live {torch.device(device).type} tensors ({b0} bytes "
            f"of storage) after the shape's first plugin step, {count} ({sum(storages.values())} bytes) after step "
            f"{step} (a leak the forward object does not reach: a module-level cache, a class attribute, a closure)"]


def _join(runner: Any, n: int, gen: torch.Generator) -> dict[str, Any]:
    from lowlat.forward_batch import ForwardMode

    row = runner.kv_pool.alloc_req()
    prompt = torch.randint(0, runner.model_config.vocab_size, (n,), generator=gen).tolist()
    batch = runner.prepare_batch(ForwardMode.PREFILL, [row], [0], [prompt])
    with torch.inference_mode():
        logits = runner.general_forward(batch)
    return {"row": row, "len": n, "next": int(logits[-1].argmax())}

