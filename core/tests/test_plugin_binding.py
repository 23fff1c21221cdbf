"""PluginBinding: workspace accounting, the KV pool's late arrival, checkpoint release, RoPE tables (API 2)."""

from __future__ import annotations

import pytest
import torch
from lowlat.config import EngineConfig
from lowlat.layers.rotary import RotaryEmbedding
from lowlat.loader.presets import get_preset
from lowlat.plugin import KVPoolNotReady, PluginBinding, PluginBuildError, rope_tables


def binding(budget=None, **kw) -> PluginBinding:
    mc = get_preset("tiny-llama")
    return PluginBinding(plugin="p", model_config=mc, engine_config=EngineConfig(max_context_len=96),
                         device=torch.device("cpu"), dtype=torch.float32, params={}, workspace_budget_bytes=budget,
                         **kw)


def test_workspaces_are_counted_and_capped():
    b = binding(budget=1000)
    t = b.alloc_workspace("a", (10, 20), torch.float32)
    assert t.shape == (10, 20) and b.workspace_bytes == 800
    with pytest.raises(PluginBuildError, match="plugin 'p' asked for workspace 'b'"):
        b.alloc_workspace("b", (100,), torch.float32)


def test_kv_pool_read_too_early_is_an_error_and_callbacks_run_when_ready():
    b = binding()
    with pytest.raises(KVPoolNotReady, match="on_kv_pool_ready"):
        _ = b.kv_pool
    seen = []
    b.on_kv_pool_ready(seen.append)
    b.attach_kv_pool("pool")
    b.on_kv_pool_ready(seen.append)  # after the pool exists: called at once
    assert seen == ["pool", "pool"] and b.kv_pool == "pool"


def test_checkpoint_tensors_are_released():
    b = binding(checkpoint_tensors={"w": torch.ones(2)})
    assert "w" in b.checkpoint_tensors
    b.release_checkpoint()
    assert b.checkpoint_tensors == {}


@pytest.mark.parametrize("preset", ["tiny-llama", "llama-3.2-1b", "qwen3-30b-a3b"])
def test_rope_tables_are_the_general_paths_bit_for_bit(preset):
    mc = get_preset(preset)
    cos, sin = rope_tables(mc.head_dim, mc.rope_theta, mc.rope_scaling, 257, "cpu")
    ref = RotaryEmbedding(mc.head_dim, mc.rope_theta, mc.rope_scaling, 257, device=torch.device("cpu"))
    half = mc.head_dim // 2
    assert cos.shape == (257, half) and cos.dtype == torch.float32 and cos.is_contiguous()
    assert torch.equal(ref.cos_cache, torch.cat((cos, cos), -1))
    assert torch.equal(ref.sin_cache, torch.cat((sin, sin), -1))


def test_binding_rope_cos_sin_covers_the_engine_context():
    cos, sin = binding().rope_cos_sin()
    assert cos.shape == (96, 16) and sin.shape == (96, 16)
