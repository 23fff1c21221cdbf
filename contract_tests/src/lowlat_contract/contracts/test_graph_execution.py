"""Graph execution (CUDA only): replaying a captured CUDA graph of the plugin's step equals running the step
eagerly, over several replays with fresh inputs (new tokens, positions, slots and lengths each time).

The plugin path is captured for DECODE with 1 and 3 requests and VERIFY with 2 tokens per request (those in
coverage) through core's CudaGraphRunner, with the plugin's prepare_for_capture / prepare_for_replay hooks. Each
replay is compared with an eager run of the same step from the same KV state: logits and the K/V written.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lowlat_contract.harness import Requests, kv_at, kv_restore, kv_state, prefix_lens, resolve_shape

PROMISE = "Replaying a captured CUDA graph of the plugin step equals eager execution, over replays with fresh inputs."
pytestmark = pytest.mark.lowlat_contract("graph_execution", PROMISE)

SHAPES = ("DECODE-b1", "DECODE-b3", "VERIFY-t2")
REPLAYS = 6  # a value frozen on the host at capture shows once the inputs move on


def test_replay_equals_eager(case: Any, cuda_only: None, runner: Any, dispatcher: Any) -> None:
    """Each of several replays per captured shape gives the eager step's logits and K/V writes."""
    from lowlat_contract.graphs import PathGraphs

    shapes = [s for s in (resolve_shape(n, case) for n in SHAPES) if not isinstance(s, str)]
    if not shapes:
        pytest.skip("no DECODE or VERIFY step of 1 to 3 requests is in coverage")
    graphs = PathGraphs(runner, "plugin", shapes)
    problems = []
    try:
        for i, shape in enumerate(shapes):
            with Requests.with_prefixes(runner, prefix_lens(shape.batch_size), seed=40 + i) as reqs:
                for r in range(REPLAYS):
                    batch = reqs.step(shape.mode, shape.tokens_per_req)
                    with torch.inference_mode():
                        before = kv_state(runner.kv_pool)
                        eager = dispatcher.run("plugin", batch).clone()
                        eager_kv = kv_at(runner.kv_pool, batch.out_cache_loc)
                        kv_restore(runner.kv_pool, before)
                        replayed = graphs.replay(batch)
                        replayed_kv = kv_at(runner.kv_pool, batch.out_cache_loc)
                    what = f"{shape.mode.name} {shape.batch_size}x{shape.tokens_per_req}, replay {r + 1}"
                    for bad in (case.tolerance.check(replayed, eager, f"{what}: logits"),
                                case.tolerance.check(replayed_kv.transpose(0, 1).reshape(batch.num_tokens, -1),
                                                     eager_kv.transpose(0, 1).reshape(batch.num_tokens, -1),
                                                     f"{what}: K/V written")):
                        if bad:
                            problems.append(bad)
    finally:
        graphs.close()
    assert not problems, "CUDA-graph replays differ from eager steps:\n" + "\n".join(problems)
