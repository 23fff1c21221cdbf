"""general_impl "fused" and "compiled" against "reference" (the oracle) on the tiny presets, through ModelRunner.

One script per runner: a ragged PREFILL of two requests, a chunked PREFILL, a DECODE and a VERIFY step (DECODE
and VERIFY without host lengths, as graphs run them). The KV pools start from the same random sentinel, so
comparing whole buffers checks both the slots written and that nothing else changed. On a machine with CUDA the
same tests run there with CUDA graphs (DECODE and VERIFY replay captured graphs; "compiled" uses inductor).
"""

from __future__ import annotations

import pytest
import torch
from lowlat.config import ConfigError, EngineConfig
from lowlat.forward_batch import ForwardMode
from lowlat.models import general_impl
from lowlat.models.general_impl import TORCH_OPS, LayeredForward
from lowlat.runtime.model_runner import ModelRunner

pytestmark = pytest.mark.gpu  # also run on a GPU: python bench/gpu_jobs.py gpu-tests (or general-tests)

P, D, V = ForwardMode.PREFILL, ForwardMode.DECODE, ForwardMode.VERIFY
PRESETS = ("tiny-llama", "tiny-qwen3", "tiny-qwen3-moe")
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: Triton under the interpreter (conftest.py)
SCRIPT = [  # (mode, tokens per request a, b)
    (P, [[1, 5, 9, 13, 17], [2, 4, 6]]),
    (P, [None, [8, 10, 12, 14]]),
    (D, [[21], [16]]),
    (V, [[3, 7, 11], [18, 20, 22]]),
]


def runner(model: str, impl: str, dtype: str = "float32") -> ModelRunner:
    cfg = EngineConfig(model=model, device=DEV, dtype=dtype, max_batch_size=2, max_context_len=64,
                       max_verify_tokens=3, cuda_graph=DEV == "cuda", plugin="none", general_impl=impl)
    r = ModelRunner(cfg, show_progress=False)
    gen = torch.Generator().manual_seed(7)
    for buf in [*r.kv_pool.k_buffers, *r.kv_pool.v_buffers]:
        buf.copy_(torch.randn(buf.shape, generator=gen).to(buf.device, buf.dtype))
    return r


def run_script(r: ModelRunner) -> tuple[dict[ForwardMode, list[torch.Tensor]], list[torch.Tensor]]:
    rows = [r.kv_pool.alloc_req(), r.kv_pool.alloc_req()]
    lens = [0, 0]
    out: dict[ForwardMode, list[torch.Tensor]] = {P: [], D: [], V: []}
    for mode, toks in SCRIPT:
        idx = [i for i, t in enumerate(toks) if t is not None]
        batch = r.prepare_batch(mode, [rows[i] for i in idx], [lens[i] for i in idx], [toks[i] for i in idx])
        if mode is not P:
            batch.seq_lens_cpu = batch.extend_lens_cpu = None
        out[mode].append(r.forward(batch).cpu())
        assert r.last_graphed == (DEV == "cuda" and mode is not P)
        for i in idx:
            lens[i] += len(toks[i])
    return out, [b.cpu() for b in [*r.kv_pool.k_buffers, *r.kv_pool.v_buffers]]


@pytest.fixture(scope="module", params=PRESETS)
def reference(request):
    r = runner(request.param, "reference")
    yield request.param, run_script(r)
    r.close()


def _compare(got, want, **tol) -> None:
    (logits, kv), (ref_logits, ref_kv) = got, want
    for mode in (P, D, V):
        for g, w in zip(logits[mode], ref_logits[mode]):
            torch.testing.assert_close(g, w, **tol, msg=lambda m, mode=mode: f"{mode.name} logits: {m}")
    for i, (g, w) in enumerate(zip(kv, ref_kv)):
        torch.testing.assert_close(g, w, **tol, msg=lambda m, i=i: f"KV buffer {i}: {m}")


def test_the_skeleton_with_torch_pieces_is_the_reference_bit_for_bit(reference, monkeypatch):
    model, want = reference
    # installed before the runner captures its CUDA graphs (on CUDA), so the replays run the skeleton too
    monkeypatch.setattr(general_impl, "make_general_step", lambda m, impl: LayeredForward(m, TORCH_OPS))
    r = runner(model, "reference")
    assert isinstance(r.general_step, LayeredForward) and r.general_step.ops is TORCH_OPS
    _compare(run_script(r), want, rtol=0, atol=0)


def test_fused_equals_reference_in_float32(reference):
    model, want = reference
    r = runner(model, "fused")
    assert isinstance(r.general_step, LayeredForward) and r.general_step.ops.name == "triton"
    _compare(run_script(r), want, rtol=1e-5, atol=1e-5)


def test_compiled_equals_reference_in_float32(reference, monkeypatch):
    """On CPU torch.compile with the aot_eager backend (dynamo + functionalisation of the KV writes, no C++
    compiler and no compile time); on CUDA inductor itself."""
    model, want = reference
    backend = "inductor"
    if DEV == "cpu":
        make, backend = general_impl.compiled_ops, "aot_eager"
        monkeypatch.setattr(general_impl, "compiled_ops", lambda backend="inductor": make("aot_eager"))
    r = runner(model, "compiled")
    assert r.general_step.ops.name == f"compiled-{backend}"
    _compare(run_script(r), want, rtol=1e-5, atol=1e-5)


def test_fused_in_bf16_is_within_the_reference_bf16_noise():
    """bf16 against the float32 reference: the fused path's error is at most 3x the bf16 reference's own.

    The interpreter's float32 -> bf16 casts truncate (the GPU rounds to nearest even), which biases every
    rounding one way; measured here about 1.3-2.5x the reference's error, on the GPU it should be about 1x."""
    exact = run_script(runner("tiny-qwen3", "reference"))
    ref = run_script(runner("tiny-qwen3", "reference", "bfloat16"))
    fused = run_script(runner("tiny-qwen3", "fused", "bfloat16"))
    pairs = [(f, r, e) for mode in (P, D, V) for f, r, e in zip(fused[0][mode], ref[0][mode], exact[0][mode])]
    pairs += list(zip(fused[1], ref[1], exact[1]))
    for f, r, e in pairs:
        err_fused, err_ref = (f.float() - e).abs().max().item(), (r.float() - e).abs().max().item()
        assert err_fused <= 3 * err_ref + 1e-2, (err_fused, err_ref)


def test_an_unknown_general_impl_is_refused():
    with pytest.raises(ConfigError, match="general_impl"):
        EngineConfig(general_impl="fast")


def test_bench_paths_name_the_general_variants():
    from lowlat.bench.config import BenchConfig
    from lowlat.bench.lowlat_path import engine_config

    cfg = BenchConfig.with_defaults("cpu", paths=("general", "general-fused", "general-compiled"))
    for path, impl in (("general", "auto"), ("general-reference", "reference"), ("general-fused", "fused"),
                       ("general-compiled", "compiled")):
        ecfg = engine_config(cfg, "tiny-llama", path, None)
        assert (ecfg.plugin, ecfg.general_impl) == ("none", impl)
    assert engine_config(cfg, "tiny-llama", "amd_mono", None).general_impl == "auto"  # its fallback: the default


def test_engine_greedy_tokens_are_the_same_with_fused():
    """End to end (prefill, decode steps, the engine's sampler): the same greedy tokens on tiny-qwen3-moe."""
    from lowlat.runtime.engine import Engine
    from lowlat.runtime.sampling import SamplingParams

    tokens = []
    for impl in ("reference", "fused"):
        engine = Engine(EngineConfig(model="tiny-qwen3-moe", device=DEV, dtype="float32", general_impl=impl,
                                     plugin="none", max_context_len=64, max_batch_size=2))
        out = engine.generate([[1, 2, 3, 4, 5], [7, 8, 9]], SamplingParams(max_new_tokens=8, stop_at_eos=False))
        tokens.append([c.token_ids for c in out])
        engine.close()
    assert tokens[0] == tokens[1]


def test_auto_is_fused_on_cuda_and_reference_elsewhere():
    cfg = EngineConfig()
    assert cfg.general_impl == "auto"
    assert cfg.resolved_general_impl(torch.device("cuda", 0)) == "fused"
    assert cfg.resolved_general_impl(torch.device("cpu")) == "reference"
    for impl in ("reference", "fused", "compiled"):  # an explicit choice is kept on every device
        assert EngineConfig(general_impl=impl).resolved_general_impl(torch.device("cpu")) == impl
        assert EngineConfig(general_impl=impl).resolved_general_impl(torch.device("cuda", 0)) == impl


def test_a_cpu_runner_with_the_default_runs_the_reference_forward():
    r = ModelRunner(EngineConfig(model="tiny-llama", device="cpu", dtype="float32", max_batch_size=1,
                                 max_context_len=32, plugin="none"))
    try:
        assert r.general_step is r.model  # make_general_step("reference") is the model itself
    finally:
        r.close()
