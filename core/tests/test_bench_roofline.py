"""Roofline byte counts against hand computations, the MoE union from real routing, and the timing summaries."""

from __future__ import annotations

import pytest
import torch
from lowlat.bench.roofline import (
    layer_bytes,
    mean_union,
    measure_routing,
    record_routing,
    roofline_ms,
    step_bytes,
)
from lowlat.bench.timing import copy_bandwidth, percentile, summarize, time_steps
from lowlat.distributed import SINGLE
from lowlat.layers.moe import SparseMoeBlock
from lowlat.loader.presets import get_preset


def test_dense_step_bytes_by_hand():
    cfg = get_preset("tiny-llama")  # V=512 H=64 I=128 L=2 Hq=4 Hkv=2 D=32, untied, no q/k norm
    per_layer = 2 * 64 + (4 + 2 + 2) * 32 * 64 + 64 * 4 * 32 + 3 * 128 * 64  # norms, qkv, o, mlp = 49280
    sb = step_bytes(cfg, dtype_bytes=2, batch_size=2, tokens_per_req=1, context=64)
    assert sb.weights == 2 * (2 * per_layer + 64) == 197248
    assert sb.experts == 0
    assert sb.kv == 2 * (2 * 64 * 2 * 2 * 2 * 32) == 65536  # B * context * layers * 2 * kv_heads * head_dim
    assert sb.embed == 2 * (2 * 64) and sb.lm_head == 2 * 512 * 64
    assert sb.total == 197248 + 65536 + 256 + 65536
    verify = step_bytes(cfg, dtype_bytes=2, batch_size=1, tokens_per_req=6, context=64)
    assert verify.embed == 2 * 6 * 64 and verify.kv == sb.kv / 2
    assert layer_bytes(cfg, dtype_bytes=2, batch_size=2, context=64) == 2 * (per_layer + 2 * 64 * 2 * 2 * 32)
    assert roofline_ms(4.19e12, 4190.0) == pytest.approx(1000.0)


def test_moe_step_bytes_by_hand():
    cfg = get_preset("tiny-qwen3-moe")  # H=64 Hq=4 Hkv=2 D=32, q/k norm, E=8 top-2, I_moe=32, L=2, V=512
    non_expert = 2 * 64 + 8 * 32 * 64 + 64 * 128 + 2 * 32 + 8 * 64  # norms, qkv, o, q/k norm, router = 25280
    sb = step_bytes(cfg, dtype_bytes=2, batch_size=1, tokens_per_req=3, context=10, experts_touched=[3, 5])
    assert sb.weights == 2 * (2 * non_expert + 64) == 101248
    assert sb.experts == 2 * (3 + 5) * (3 * 32 * 64)  # union per layer x (gate + up + down) of one expert
    assert sb.kv == 2 * (10 * 2 * 2 * 2 * 32) and sb.embed == 2 * 3 * 64 and sb.lm_head == 2 * 512 * 64
    with pytest.raises(ValueError, match="experts_touched"):
        step_bytes(cfg, dtype_bytes=2, batch_size=1, tokens_per_req=1, context=10)
    with pytest.raises(ValueError, match="2 MoE layers"):
        step_bytes(cfg, dtype_bytes=2, batch_size=1, tokens_per_req=1, context=10, experts_touched=[1])


def _block(picks: list[tuple[int, int]], hidden: int = 4, experts: int = 8) -> SparseMoeBlock:
    """A top-2 MoE block whose router sends token basis vector j to the experts picks[j]."""
    b = SparseMoeBlock(hidden, experts, 2, 4, True, tp=SINGLE, dtype=torch.float32, device=torch.device("cpu"))
    with torch.no_grad():
        b.experts.w13_weight.zero_()
        b.experts.w2_weight.zero_()
        w = torch.zeros(experts, hidden)
        for j, (e1, e2) in enumerate(picks):
            w[e1, j], w[e2, j] = 5.0, 4.0
        b.gate.weight.copy_(w)
    return b


def test_union_of_selected_experts_from_the_routers():
    layers = torch.nn.ModuleList([_block([(0, 1), (1, 2), (6, 7), (0, 2)]), _block([(3, 4), (3, 4), (3, 4), (4, 3)])])
    tokens = torch.eye(4)

    def forward(rows: list[int]) -> None:
        for layer in layers:
            layer(tokens[rows])

    with record_routing(layers, top_k=2) as seen:
        forward([0, 1])  # layer 0: {0, 1, 2}; layer 1: {3, 4}
        forward([0, 1, 2, 3])  # layer 0: {0, 1, 2, 6, 7}; layer 1: {3, 4}
    assert seen == [[3, 2], [5, 2]]
    assert mean_union(seen) == [4.0, 2.0]
    assert not any(layer.gate._forward_hooks for layer in layers)  # hooks removed
    assert measure_routing(layers, 2, [lambda: forward([2])]) == [2.0, 2.0]


def test_summaries_and_percentiles():
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 10) == pytest.approx(1.4)
    s = summarize([5.0, 1.0, 4.0, 2.0, 3.0])
    assert (s.median, s.min, s.max, s.n, s.q1, s.q3, s.mean) == (3.0, 1.0, 5.0, 5, 2.0, 4.0, 3.0)
    with pytest.raises(ValueError, match="no timing samples"):
        summarize([])


def test_cpu_step_timing_and_copy_bandwidth():
    calls: list[tuple[str, int]] = []
    times = time_steps(lambda i: calls.append(("run", i)), 3, torch.device("cpu"),
                       before=lambda i: calls.append(("before", i)))
    assert len(times) == 3 and all(t >= 0 for t in times)
    assert calls == [("before", 0), ("run", 0), ("before", 1), ("run", 1), ("before", 2), ("run", 2)]
    bw = copy_bandwidth(torch.device("cpu"), 1 << 20, reps=3)
    assert bw.gb_per_s > 0 and bw.ms.n == 3 and bw.as_dict()["bytes_moved_per_copy"] == 2 << 20
