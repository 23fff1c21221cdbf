"""The sampled-ids path (plugin API 3) under CUDA graphs, end to end through the Engine (GPU only).

For a sampling plugin (the contract suite's reference plugin, float32; nvidia_mega's fused LM head + sampling
kernel, bfloat16) on tiny-llama with CUDA graphs:

- greedy ids (every DECODE step an ids-graph replay, variant "greedy") equal the tokens of the same plugin's logits
  path (a ``logits_observer`` makes every step ask for logits; the engine's argmax picks) over 64 tokens, at batch
  1 and 4, plain and overlapped. The same plugin on both sides, so its logits are the same values: no near-tie
  excuse.
- seeded sampling (variants "sample": temperature only, and "filter": top-k 20 + top-p 0.9) is reproducible: a
  second generate with the same seeds gives the same tokens, and they differ from the greedy ones.

Run by ``python3 bench/gpu_jobs.py gpu-tests`` (every ``gpu`` test) and ``ids-path`` (this file alone).
"""

from __future__ import annotations

import pytest
import torch
from lowlat.config import EngineConfig
from lowlat.runtime import Engine, ForwardMode, SamplingParams
from plugin_dists import activate

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = [list(range(1, 12)), [300, 5, 17], list(range(40, 70)), [9, 8, 7, 6]]
TOKENS = 64


@pytest.fixture(params=["reference", "nvidia_mega"])
def plugin(request, tmp_path, monkeypatch) -> tuple[str, str]:
    """(plugin name, dtype): the reference plugin installed from the contract suite, or nvidia_mega (bf16 only)."""
    if request.param == "reference":
        from lowlat_contract.fixtures import install_fixture_plugins

        site = tmp_path / "site"
        install_fixture_plugins(site, ["reference"])
        activate(site, monkeypatch)
        monkeypatch.setenv("LOWLAT_PLUGINS", "reference")
        return "reference", "float32"
    pytest.importorskip("lowlat_nvidia_mega", reason="nvidia_mega is not installed: pip install -e vendors/nvidia_mega")
    return "nvidia_mega", "bfloat16"


def _engine(plugin: str, dtype: str, overlap: bool) -> Engine:
    return Engine(EngineConfig(model="tiny-llama", device="cuda", dtype=dtype, plugin=plugin, cuda_graph=True,
                               overlap=overlap, max_context_len=256, max_batch_size=4, max_verify_tokens=2,
                               page_size=16))


def _generate(e: Engine, batch: int, params: list[SamplingParams], *, logits: bool) -> tuple[list, list[str]]:
    """Tokens of one generate and the ids-graph variant of each DECODE step ("" = a logits step)."""
    variants: list[str] = []
    runner = e.runner
    original = runner._ids_variant

    def spy(b):  # type: ignore[no-untyped-def]
        v = original(b)
        if b.forward_mode is ForwardMode.DECODE:
            variants.append(v)
        return v

    runner._ids_variant = spy  # type: ignore[method-assign]
    e.logits_observer = (lambda step, out: None) if logits else None
    before = e.stats.by_mode[ForwardMode.DECODE].graph_steps
    try:
        got = [c.token_ids for c in e.generate(PROMPTS[:batch], params)]
    finally:
        runner._ids_variant = original  # type: ignore[method-assign]
        e.logits_observer = None
    assert e.runner.last_path == "plugin", "the DECODE steps did not take the plugin path"
    assert e.stats.by_mode[ForwardMode.DECODE].graph_steps - before == len(variants) > 0, "a DECODE step ran eagerly"
    return got, variants


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_greedy_ids_equal_the_logits_path(plugin: tuple[str, str], overlap: bool) -> None:
    name, dtype = plugin
    greedy = SamplingParams(max_new_tokens=TOKENS, stop_at_eos=False)
    with _engine(name, dtype, overlap) as e:
        assert e.runner.dispatcher.samples, f"{name} declares no coverage.sampling"
        for batch in (1, 4):
            ids, v_ids = _generate(e, batch, [greedy] * batch, logits=False)
            want, v_logits = _generate(e, batch, [greedy] * batch, logits=True)
            assert set(v_ids) == {"greedy"}, f"{name} batch {batch}: DECODE steps took {set(v_ids)}, not ids graphs"
            assert set(v_logits) == {""}, f"{name} batch {batch}: the forced-logits run got ids ({set(v_logits)})"
            assert all(len(t) == TOKENS for t in ids)
            for r, (a, b) in enumerate(zip(ids, want)):
                first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                assert first is None, (f"{name} {dtype} batch {batch} request {r}: the ids path gave token {a[first]} "
                                       f"at position {first}, the logits path {b[first]}")


def test_seeded_sampling_is_reproducible(plugin: tuple[str, str]) -> None:
    name, dtype = plugin
    with _engine(name, dtype, overlap=True) as e:
        greedy, _ = _generate(e, 4, [SamplingParams(max_new_tokens=TOKENS, stop_at_eos=False)] * 4, logits=False)
        for variant, kw in (("sample", {"temperature": 0.8}), ("filter", {"temperature": 0.8, "top_k": 20,
                                                                           "top_p": 0.9})):
            params = [SamplingParams(max_new_tokens=TOKENS, stop_at_eos=False, seed=100 + i, **kw) for i in range(4)]
            first, v1 = _generate(e, 4, params, logits=False)
            again, v2 = _generate(e, 4, params, logits=False)
            assert set(v1) == set(v2) == {variant}, f"{name}: {variant} steps replayed {set(v1) | set(v2)}"
            assert first == again, f"{name} {variant}: the same seeds gave different tokens run to run"
            assert first != greedy, f"{name} {variant}: sampling at temperature 0.8 gave exactly the greedy tokens"
