"""KV writes: a plugin step writes K and V at exactly the slots in ``out_cache_loc``, in every layer, with the
values the general forward writes, and changes nothing else in the pool (DESIGN.md §5, the KV-write contract).

Method: every slot that holds no cached token (free slots, the dummy slot 0, the step's own slots) is set to
a sentinel; the whole pool is copied; one plugin step runs; the slots that changed in each layer's K and V
must be exactly ``out_cache_loc``. Then the copy is restored, the general forward runs the same step from the
same poisoned state, and the values at ``out_cache_loc`` are compared within the dtype's tolerance.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lowlat_contract.harness import Requests, kv_at, kv_restore, kv_state, prefix_lens, resolve_shape
from lowlat_contract.oracle import copy_batch, plugin_routing
from lowlat_contract.router_ties import routing_excuses

PROMISE = ("A plugin step writes K/V at exactly the slots in out_cache_loc, in every layer, with the general "
           "forward's values, and changes nothing else in the KV pool.")
pytestmark = pytest.mark.lowlat_contract("kv_writes", PROMISE)

SENTINEL = 512.0  # exact in every float dtype, far from any K/V value a model produces
STEPS = {"DECODE": ("DECODE-b3", "DECODE-b1"), "VERIFY": ("VERIFY-t2",)}


def _changed_slots(pool: Any, before: list[torch.Tensor]) -> list[set[int]]:
    """Per buffer (k0, v0, k1, ...): the slots whose contents differ from ``before``."""
    bufs = [b for kv in zip(pool.k_buffers, pool.v_buffers) for b in kv]
    return [set((now != old).reshape(now.shape[0], -1).any(dim=1).nonzero().flatten().tolist())
            for now, old in zip(bufs, before)]


def _owner(slot: int, live: dict[int, str]) -> str:
    return "the dummy slot 0" if slot == 0 else live.get(slot, "a free slot")


def _describe(changes: list[set[int]], loc: set[int], live: dict[int, str], who: str) -> list[str]:
    problems = []
    for i, changed in enumerate(changes):
        buf = f"layer {i // 2} {'KV'[i % 2]}"
        missing, extra = sorted(loc - changed), sorted(changed - loc)
        if missing:
            problems.append(f"{who}: {buf}: {len(missing)} slot(s) of out_cache_loc not written, e.g. {missing[:5]}")
        if extra:
            shown = ", ".join(f"{s} ({_owner(s, live)})" for s in extra[:5])
            problems.append(f"{who}: {buf}: wrote {len(extra)} slot(s) outside out_cache_loc: {shown}")
    return problems


@pytest.mark.parametrize("mode", sorted(STEPS))
def test_kv_writes_exact(case: Any, runner: Any, dispatcher: Any, mode: str) -> None:
    """Exactly out_cache_loc changes in every layer's K and V, with the general forward's values."""
    shapes = [resolve_shape(n, case) for n in STEPS[mode]]
    shape = next((s for s in shapes if not isinstance(s, str)), None)
    if shape is None:
        pytest.skip(str(shapes[0]))
    pool = runner.kv_pool
    with Requests.with_prefixes(runner, prefix_lens(shape.batch_size), seed=11) as reqs:
        live = {s: f"a cached token of request {i}" for i, (r, n) in enumerate(zip(reqs.rows, reqs.lens))
                for s in pool.slots_of(r, n).tolist()}
        live_slots = reqs.live_slots()
        batch = reqs.step(shape.mode, shape.tokens_per_req)
        if not dispatcher.plugin_forward.supports(batch):
            pytest.skip(f"supports() refused this {mode} step")
        loc = batch.out_cache_loc
        with torch.inference_mode():
            keep = torch.zeros(pool.num_slots, dtype=torch.bool, device=pool.device)
            keep[live_slots] = True
            for buf in [*pool.k_buffers, *pool.v_buffers]:
                buf[~keep] = SENTINEL
            poisoned = kv_state(pool)
            pristine = copy_batch(batch)
            dispatcher.run("plugin", batch)
            plugin_changes = _changed_slots(pool, poisoned)
            got = kv_at(pool, loc)
            routing = plugin_routing(dispatcher.plugin_forward)
            kv_restore(pool, poisoned)
            _, ties = routing_excuses(runner.model, lambda: runner.general_forward(pristine), batch.num_tokens,
                                      routing)
            general_changes = _changed_slots(pool, poisoned)
            want = kv_at(pool, loc)
    loc_set = set(loc.tolist())
    assert not _describe(general_changes, loc_set, live, "general"), "suite bug: the general path breaks the contract"
    problems = _describe(plugin_changes, loc_set, live, "plugin")
    assert not problems, "the plugin step broke the KV-write contract:\n" + "\n".join(problems)
    problem = case.tolerance.check(got.transpose(0, 1).reshape(loc.numel(), -1),
                                   want.transpose(0, 1).reshape(loc.numel(), -1),
                                   f"K/V written at out_cache_loc ({mode}, {shape.num_tokens} tokens, all layers)",
                                   ties)
    assert problem is None, problem
