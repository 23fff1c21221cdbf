"""The persistent kernels on CPU: the one-launch step (``kernels.step``) and the two-launch K1/K2, run under the
Triton interpreter over a grid of one program, where every wait finds its flags already published by that
program. They must match the general path and each other bit for bit (same tiles), publish every flag the
cross-layer waits need, and turn a stage that never publishes into MonoStageTimeout naming the layer and stage.
Run with TRITON_INTERPRET=1."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("CPU kernel tests need TRITON_INTERPRET=1 (set before triton is imported)", allow_module_level=True)

from lowlat.loader.presets import get_preset, with_layers  # noqa: E402
from lowlat_amd_mono.forward import MonoForward, MonoStageTimeout  # noqa: E402
from lowlat_amd_mono.kernels import plan as P  # noqa: E402
from lowlat_amd_mono.kernels.launch import MonoOptions  # noqa: E402
from lowlat_amd_mono.kernels.step import COL_O  # noqa: E402
from mono_testutil import (  # noqa: E402
    MAX_CTX,
    Setup,
    clone_pool,
    empty_params,
    make_pool,
    make_setup,
    new_requests,
    step_batch,
)

PRESETS = ["tiny-llama", "tiny-qwen3", "tiny-qwen3-moe"]


def _mono(s, **opts) -> MonoForward:
    # One program never waits for another, so a wait that spins at all is a bug: 1000 polls fail it fast.
    opts.setdefault("deadline_ms", 1.0)
    opts.setdefault("one_launch", True)
    return MonoForward(model_config=s.cfg, params=s.binding.params, dtype=s.dtype, device=s.device,
                       alloc_workspace=s.binding.alloc_workspace, max_context_len=MAX_CTX,
                       options=MonoOptions(staged=False, **opts))


def _step(s, fwd: MonoForward, prefix: list[int], tpr: int, seed: int = 3):
    """One step of ``fwd`` and of the general path on identical pools: (mono logits, general logits, pools)."""
    pool_ref = make_pool(s)
    rows = new_requests(pool_ref, prefix)
    pool = clone_pool(pool_ref)
    fwd.attach_kv_pool(pool)
    ids = torch.randint(0, s.cfg.vocab_size, (len(prefix) * tpr,), generator=torch.Generator().manual_seed(seed))
    batch = step_batch(pool_ref, rows, tpr, ids)
    step_batch(pool, rows, tpr, ids)
    return fwd.forward(batch), s.model(batch, pool_ref), pool, pool_ref, batch


@pytest.mark.parametrize("preset", PRESETS)
def test_one_launch_matches_two_launches_and_the_general_path(preset: str) -> None:
    s = make_setup(preset, torch.bfloat16, "cpu", layers=2)
    one, two = _mono(s), _mono(s, one_launch=False)
    assert one.one_launch and not two.one_launch and one.runner.nprog == 1
    prefix, tpr = ([4, 19, 33], 1) if preset != "tiny-qwen3" else ([21, 6], 3)
    out1, ref, pool1, pool_ref, batch = _step(s, one, prefix, tpr)
    out2, _, pool2, _, _ = _step(s, two, prefix, tpr)
    assert torch.equal(out1, out2)  # the same stage bodies and tiles in one launch or two per layer
    torch.testing.assert_close(out1, ref, atol=0.1, rtol=0.02)
    for layer in range(s.cfg.num_hidden_layers):
        assert torch.equal(pool1.k_buffers[layer], pool2.k_buffers[layer])
        torch.testing.assert_close(pool1.v_buffers[layer].float(), pool_ref.v_buffers[layer].float(), atol=0.02,
                                   rtol=0.02)
    # Every stage a later wait reads published this step's tag: the RoPE heads (attention waits on them in the
    # one launch) and the last stage of every layer (the next layer's QKV waits on it).
    tag = int(one.step.item())
    last = P.S_MLP3 if s.cfg.num_experts else P.S_MLP2
    shape = one.plan.step_shape(batch.num_tokens, tpr)
    n_rope = s.cfg.num_attention_heads + 2 * s.cfg.num_key_value_heads
    n_last = one.plan.items(last, shape, bool(s.cfg.num_experts))
    assert torch.all(one.flags[:, P.S_ROPE, :n_rope] == tag) and torch.all(one.flags[:, last, :n_last] == tag)
    assert torch.all(two.flags[:, P.S_ROPE, :n_rope] == 0)  # K1 publishes no RoPE flags: the launch boundary orders


def test_the_next_layer_reads_the_previous_layers_output() -> None:
    """A one-launch step with layer 0's MLP skipped (it still publishes) must differ from the full step: layer 1
    reads layer 0's output through the workspace, after the cross-layer wait."""
    s = make_setup("tiny-llama", torch.float32, "cpu", layers=2)
    fwd = _mono(s)
    full, ref, *_ = _step(s, fwd, [7, 12], 1)
    torch.testing.assert_close(full, ref, atol=1e-4, rtol=1e-4)
    fwd.set_debug(0, skip=(P.S_MLP1, P.S_MLP2))
    assert int(fwd.dbg[0]) == (1 << P.S_MLP1) | (1 << P.S_MLP2)
    skipped, *_ = _step(s, fwd, [7, 12], 1)
    assert not torch.allclose(skipped, full, atol=1e-3)


FAULTS = [("tiny-llama", 0, P.S_MLP2, False, r"layer 1, stage k1\.qkv_proj waited .* for k2\.down_residual of "
                                             r"layer 0 \(item 0 unpublished\)"),
          ("tiny-llama", 1, P.S_ROPE, False, r"layer 1, stage k2\.attention waited .* for "
                                             r"k1\.qk_norm_rope_kv_write \(item 0 unpublished\)"),
          ("tiny-qwen3-moe", 0, P.S_MLP3, True, r"layer 1, stage k1\.qkv_proj waited .* for "
                                                r"k2\.expert_down_combine_residual of layer 0 \(0 items published\)"),
          ("tiny-qwen3-moe", 1, P.S_MLP2, False, r"layer 1, stage k2\.expert_down_combine_residual waited .* for "
                                                 r"k2\.expert_gate_up \(item 0 unpublished\)")]


@pytest.mark.parametrize("preset,layer,stage,counters,message", FAULTS,
                         ids=[f"{f[0]}-layer{f[1]}-stage{f[2]}-{'counters' if f[3] else 'flags'}" for f in FAULTS])
def test_a_stage_that_never_publishes_stops_the_one_launch_step(preset: str, layer: int, stage: int, counters: bool,
                                                                message: str) -> None:
    s = make_setup(preset, torch.float32, "cpu", layers=2)
    fwd = _mono(s, deadline_ms=0.02, stage_counters=counters)  # 20 polls under the interpreter
    fwd.set_debug(layer, never_publish=(stage,))
    with pytest.raises(MonoStageTimeout, match=message):
        _step(s, fwd, [5, 9], 1)
    fwd.set_debug(layer)
    out, ref, *_ = _step(s, fwd, [5, 9], 1)  # a new tag: the stale flags and the old abort do not matter
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("missing", ["q", "k", "v"])
def test_attention_waits_for_exactly_its_kv_heads_rope_items(missing: str) -> None:
    """Layer 1's RoPE never publishes, but its flags are pre-set to this step's tag for every head except one kind:
    attention must time out on the first missing head of its kv head 0 (q head 0, k head Hq, or v head Hq + Hkv)."""
    s = make_setup("tiny-llama", torch.float32, "cpu", layers=2)
    fwd = _mono(s, deadline_ms=0.02)
    fwd.set_debug(1, never_publish=(P.S_ROPE,))
    hq, hkv = s.cfg.num_attention_heads, s.cfg.num_key_value_heads
    first = {"q": 0, "k": hq, "v": hq + hkv}[missing]
    span = {"q": range(0, hq), "k": range(hq, hq + hkv), "v": range(hq + hkv, hq + 2 * hkv)}[missing]
    fwd.flags[1, P.S_ROPE, :hq + 2 * hkv] = int(fwd.step.item()) + 1  # the tag the next step runs with
    fwd.flags[1, P.S_ROPE, list(span)] = 0
    with pytest.raises(MonoStageTimeout, match=rf"layer 1, stage k2\.attention waited .* for "
                                               rf"k1\.qk_norm_rope_kv_write \(item {first} unpublished\)"):
        _step(s, fwd, [5, 9], 1)


def _bare(cfg, params=None, **opts) -> MonoForward:
    """A MonoForward over uninitialized weights (for the launch-mode choice; no step runs)."""
    return MonoForward(model_config=cfg, params=params or empty_params(cfg, torch.bfloat16), dtype=torch.bfloat16,
                       device=torch.device("cpu"), alloc_workspace=lambda n, s, d: torch.zeros(s, dtype=d),
                       max_context_len=MAX_CTX, options=MonoOptions(**opts))


def test_launch_mode_falls_back_by_name_where_one_launch_cannot_run() -> None:
    """The one launch needs layers of one kind and 16-byte aligned tensors; otherwise two launches per layer, and
    ``launch_note`` says why. Staged options (the interpreter's default) run one launch per stage."""
    cfg = with_layers(get_preset("tiny-qwen3-moe"), 2)
    assert _bare(cfg, staged=False, one_launch=True).launch_note == "one persistent launch for all layers"
    mixed = dataclasses.replace(cfg, mlp_only_layers=(0,))
    fwd = _bare(mixed, staged=False, one_launch=True)
    assert not fwd.one_launch and fwd.launch_note == "two persistent launches per layer"
    assert _bare(cfg, staged=True, one_launch=True).launch_note == "one launch per stage"
    assert _bare(cfg, staged=False).launch_note == "two persistent launches per layer"  # the default
    params = empty_params(cfg, torch.bfloat16)
    name = "model.layers.1.self_attn.o_proj.weight"
    flat = torch.empty(params[name].numel() + 1, dtype=torch.bfloat16)
    params[name] = flat[1:].view(params[name].shape)  # contiguous, 2 bytes past an aligned address
    fwd = _bare(cfg, params, staged=False, one_launch=True)
    assert fwd.one_launch  # decided when the KV pool (and with it every pointer) is known
    fwd.attach_kv_pool(make_pool(Setup(cfg, None, None, torch.bfloat16, torch.device("cpu")), num_pages=8,
                                 fill_seed=None))
    assert not fwd.one_launch
    assert fwd.launch_note == ("two persistent launches per layer (layer 1's tensor for pointer-table column "
                               f"{COL_O} is not 16-byte aligned)")
