"""The batched sampler: greedy, temperature, top-k, top-p, per-request generators."""

from __future__ import annotations

import pytest
import torch
from lowlat.runtime.sampling import SamplingParams, make_generator, sample


def _logits(rows=4, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 3


def _gens(n, seed=0):
    return [make_generator(seed + i, "cpu") for i in range(n)]


def test_greedy_is_argmax():
    x = _logits()
    out = sample(x, [SamplingParams()] * 4, [None] * 4)
    assert out.dtype == torch.int64 and out.tolist() == x.argmax(-1).tolist()


def test_top_k_1_and_tiny_top_p_are_greedy():
    x = _logits()
    for p in (SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=2.0, top_p=1e-6)):
        assert sample(x, [p] * 4, _gens(4)).tolist() == x.argmax(-1).tolist()


def test_samples_stay_inside_top_k_and_top_p():
    x = _logits(rows=1, vocab=40)
    top5 = set(x[0].topk(5).indices.tolist())
    probs = torch.softmax(x[0], -1)
    order = probs.argsort(descending=True)
    nucleus = set(order[: int((probs[order].cumsum(0) < 0.6).sum()) + 1].tolist())
    g = make_generator(1, "cpu")
    for _ in range(200):
        assert sample(x, [SamplingParams(temperature=1.5, top_k=5)], [g]).item() in top5
        assert sample(x, [SamplingParams(temperature=1.0, top_p=0.6)], [g]).item() in nucleus


def test_same_seed_same_tokens_whatever_the_batch():
    x = _logits(rows=3)
    params = [SamplingParams(temperature=1.0)] * 3
    a = sample(x, params, _gens(3)).tolist()
    assert sample(x, params, _gens(3)).tolist() == a
    assert sample(x[1:2], params[:1], [make_generator(1, "cpu")]).tolist() == a[1:2]
    mixed = sample(x, [SamplingParams(), params[1], SamplingParams()], [None, make_generator(1, "cpu"), None])
    assert mixed[1].item() == a[1]


def test_sampling_follows_the_distribution():
    x = torch.tensor([[0.0, 1.0, 2.0]])
    g = make_generator(0, "cpu")
    counts = torch.zeros(3)
    for _ in range(3000):
        counts[sample(x, [SamplingParams(temperature=1.0)], [g]).item()] += 1
    torch.testing.assert_close(counts / counts.sum(), torch.softmax(x[0], -1), atol=0.03, rtol=0)


@pytest.mark.parametrize("kw, field", [({"max_new_tokens": 0}, "max_new_tokens"), ({"temperature": -1}, "temperature"),
                                       ({"top_p": 0.0}, "top_p"), ({"top_k": -2}, "top_k")])
def test_bad_params_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_mismatched_rows_and_missing_generator_raise():
    x = _logits(rows=2)
    with pytest.raises(ValueError, match="one SamplingParams"):
        sample(x, [SamplingParams()], [None])
    with pytest.raises(ValueError, match="no generator"):
        sample(x, [SamplingParams(temperature=1.0)] * 2, [None, None])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the sync check is torch.cuda's")
def test_sampling_on_cuda_queues_no_host_sync():
    """Greedy and top-k/top-p rows: no synchronising call until the caller reads the tokens back."""
    x = _logits(rows=4, vocab=1000).cuda()
    params = [SamplingParams(), SamplingParams(temperature=0.7, top_k=50), SamplingParams(temperature=1.0, top_p=0.9),
              SamplingParams(temperature=1.3, top_k=20, top_p=0.8)]
    gens = [None] + [make_generator(i, "cuda") for i in range(3)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sample(x, params, gens)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    again = sample(x, params, [None] + [make_generator(i, "cuda") for i in range(3)])
    assert out.tolist() == again.tolist()  # the same seeds, the same tokens
