"""Performance (CUDA only): the plugin's step time against the general path's, measured side by side in one
run (both captured as CUDA graphs on the same runner, interleaved rounds of replays, medians, warm-up excluded).

The times are reported in the "lowlat contract" summary. The test fails only when the spec declares
``min_speedup`` and the plugin is slower than general time / min_speedup at some measured batch size.
"""

from __future__ import annotations

from typing import Any

import pytest

from lowlat_contract.harness import Requests, StepShape, prefix_lens

PROMISE = ("Plugin step time is measured against the general step side by side (CUDA graph replays, median); it "
           "meets the spec's min_speedup when one is declared.")
pytestmark = pytest.mark.lowlat_contract("performance", PROMISE)


def test_step_time_against_general(case: Any, cuda_only: None, runner: Any, dispatcher: Any,
                                   contract_notes: list[str], request: Any) -> None:
    """DECODE steps of 1 request and of the most requests coverage allows (up to 8), plugin vs general."""
    from lowlat.forward_batch import ForwardMode

    from lowlat_contract.graphs import PathGraphs, side_by_side_ms

    cov = case.spec.coverage
    sizes = sorted({b for b in (1, min(8, cov.max_tokens, case.max_batch_size)) if cov.covers(ForwardMode.DECODE, b)})
    if not sizes:
        pytest.skip("no DECODE step of 1 to 8 requests is in coverage")
    shapes = [StepShape(ForwardMode.DECODE, b, 1) for b in sizes]
    plugin, general = PathGraphs(runner, "plugin", shapes), PathGraphs(runner, "general", shapes)
    slow = []
    try:
        for shape in shapes:
            with Requests.with_prefixes(runner, prefix_lens(shape.batch_size), seed=50) as reqs:
                batch = reqs.step(shape.mode, 1)
                p_ms, g_ms = side_by_side_ms(plugin, general, batch)
            speedup = g_ms / p_ms
            line = (f"performance  {case.id} DECODE b{shape.batch_size}: plugin {p_ms:.4f} ms, general {g_ms:.4f} ms "
                    f"per step (median of CUDA-graph replays), speedup {speedup:.2f}x")
            contract_notes.append(line)
            request.node.user_properties.append((f"speedup_b{shape.batch_size}", round(speedup, 3)))
            if case.spec.min_speedup and speedup < case.spec.min_speedup:
                slow.append(line)
    finally:
        plugin.close()
        general.close()
    assert not slow, f"below the spec's min_speedup {case.spec.min_speedup}:\n" + "\n".join(slow)
