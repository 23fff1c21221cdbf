"""load_weights: fusion, layouts, and errors that name the offending tensor."""

from __future__ import annotations

import pytest
import torch
from _models_util import Driver, checkpoint_tensors, hf_model, model_config, random_checkpoint, save_hf, tiny_config
from lowlat.distributed import TPInfo
from lowlat.forward_batch import ForwardMode
from lowlat.layers.weights import WeightLoadError
from lowlat.models import UnknownArchitecture, build_model, model_class


def _empty(cfg, dtype=torch.float32, **kw):
    model = build_model(cfg, dtype=dtype, device="cpu", max_context_len=64, **kw)
    for p in model.parameters():
        p.fill_(float("nan"))
    return model


@pytest.fixture(scope="module")
def moe_hf(tmp_path_factory):
    hf = hf_model("qwen3_moe")
    return hf, save_hf(hf, tmp_path_factory.mktemp("moe"))


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
def test_every_parameter_is_loaded_in_the_model_dtype(arch):
    cfg = tiny_config(arch)
    model = _empty(cfg, dtype=torch.bfloat16)
    model.load_weights(random_checkpoint(cfg).items())
    for name, p in model.named_parameters():
        assert p.dtype == torch.bfloat16, name
        assert not p.isnan().any(), f"{name} was not written by load_weights"


def test_parameter_names_and_layouts_follow_the_brief(moe_hf):
    hf, path = moe_hf
    cfg = model_config(path)
    model = _empty(cfg)
    model.load_weights(checkpoint_tensors(path).items())
    params = dict(model.named_parameters())
    sd = hf.state_dict()
    d, hq, hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    qkv = params["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv.shape == ((hq + 2 * hkv) * d, cfg.hidden_size)
    a = "model.layers.0.self_attn."
    assert torch.equal(qkv, torch.cat([sd[a + "q_proj.weight"], sd[a + "k_proj.weight"], sd[a + "v_proj.weight"]]))
    w13 = params["model.layers.0.mlp.experts.w13_weight"]
    assert w13.shape == (cfg.num_experts, 2 * cfg.moe_intermediate_size, cfg.hidden_size)
    assert torch.equal(w13, sd["model.layers.0.mlp.experts.gate_up_proj"])  # HF's fused layout is the same
    assert torch.equal(params["model.layers.0.mlp.experts.w2_weight"], sd["model.layers.0.mlp.experts.down_proj"])
    assert params["model.layers.0.mlp.gate.weight"].shape == (cfg.num_experts, cfg.hidden_size)
    assert params["model.layers.1.mlp.gate_up_proj.weight"].shape == (2 * cfg.intermediate_size, cfg.hidden_size)
    assert params["model.layers.1.mlp.down_proj.weight"].shape == (cfg.hidden_size, cfg.intermediate_size)
    assert params["model.layers.0.self_attn.q_norm.weight"].shape == (d,)


def test_fused_expert_layout_loads_like_per_expert(moe_hf):
    hf, path = moe_hf
    cfg = model_config(path)
    per_expert, fused = _empty(cfg), _empty(cfg)
    per_expert.load_weights(checkpoint_tensors(path).items())
    sd = hf.state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in sd  # what transformers 5.x holds in memory
    fused.load_weights(sd.items())
    for (n, a), b in zip(per_expert.named_parameters(), fused.parameters()):
        assert torch.equal(a, b), n


def test_a_weight_supplied_in_both_expert_layouts_is_refused(moe_hf):
    hf, path = moe_hf
    ckpt = checkpoint_tensors(path)
    ckpt["model.layers.0.mlp.experts.down_proj"] = hf.state_dict()["model.layers.0.mlp.experts.down_proj"]
    with pytest.raises(WeightLoadError, match=r"model\.layers\.0\.mlp\.experts\.down_proj.*already loaded"):
        _empty(model_config(path)).load_weights(ckpt.items())


def test_missing_tensors_are_named():
    cfg = tiny_config("llama")
    ckpt = random_checkpoint(cfg)
    del ckpt["model.layers.1.self_attn.k_proj.weight"], ckpt["lm_head.weight"]
    with pytest.raises(WeightLoadError, match=r"missing 2 .*lm_head\.weight, model\.layers\.1\.self_attn\.k_proj"):
        _empty(cfg).load_weights(ckpt.items())


def test_missing_expert_is_named():
    cfg = tiny_config("qwen3_moe")
    ckpt = random_checkpoint(cfg)
    del ckpt["model.layers.0.mlp.experts.5.up_proj.weight"]
    with pytest.raises(WeightLoadError, match=r"missing 1 .*model\.layers\.0\.mlp\.experts\.5\.up_proj\.weight"):
        _empty(cfg).load_weights(ckpt.items())


def test_unexpected_tensors_are_named():
    cfg = tiny_config("llama")
    ckpt = random_checkpoint(cfg)
    ckpt["model.layers.7.mlp.gate_proj.weight"] = torch.zeros(3)
    with pytest.raises(WeightLoadError, match=r"unexpected 1 .*model\.layers\.7\.mlp\.gate_proj\.weight"):
        _empty(cfg).load_weights(ckpt.items())


def test_wrong_shape_names_tensor_and_both_shapes():
    cfg = tiny_config("qwen3")
    ckpt = random_checkpoint(cfg)
    ckpt["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(60, 64)
    with pytest.raises(WeightLoadError, match=r"'model\.layers\.0\.self_attn\.q_proj\.weight' has shape \(60, 64\)"
                       r".*expects \(64, 64\)"):
        _empty(cfg).load_weights(ckpt.items())


def test_non_float_tensor_is_refused():
    cfg = tiny_config("qwen3")
    ckpt = random_checkpoint(cfg)
    ckpt["model.norm.weight"] = ckpt["model.norm.weight"].to(torch.int8)
    with pytest.raises(WeightLoadError, match=r"'model\.norm\.weight' has dtype torch\.int8"):
        _empty(cfg).load_weights(ckpt.items())


def test_tied_lm_head_is_the_embedding_and_a_stored_copy_is_accepted():
    cfg = tiny_config("qwen3")
    ckpt = random_checkpoint(cfg)
    assert "lm_head.weight" not in ckpt
    model = _empty(cfg)
    model.load_weights({**ckpt, "lm_head.weight": torch.zeros(cfg.vocab_size, cfg.hidden_size)}.items())
    shared = dict(model.named_parameters(remove_duplicate=False))
    assert shared["lm_head.weight"] is shared["model.embed_tokens.weight"]
    assert torch.equal(model.lm_head.weight, ckpt["model.embed_tokens.weight"])
    with pytest.raises(WeightLoadError, match=r"'lm_head\.weight' has shape \(97, 32\)"):
        _empty(cfg).load_weights({**ckpt, "lm_head.weight": torch.zeros(cfg.vocab_size, 32)}.items())


def test_unknown_architecture_and_bad_tp_size_are_refused():
    with pytest.raises(UnknownArchitecture, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        model_class("GPT2LMHeadModel")
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by tp_size=3"):
        build_model(tiny_config("llama"), dtype=torch.float32, device="cpu", tp=TPInfo(rank=0, size=3))
    with pytest.raises(ValueError, match="num_experts=0"):
        build_model(tiny_config("qwen3_moe", num_experts=0), dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="triton attention backend runs on CUDA"):
        build_model(tiny_config("llama"), dtype=torch.float32, device="cpu", attention_backend="triton")


def test_kv_pool_that_does_not_fit_is_refused():
    cfg = tiny_config("llama")
    model = _empty(cfg)
    model.load_weights(random_checkpoint(cfg).items())
    other = _empty(tiny_config("llama", num_key_value_heads=4))
    d = Driver(other)
    with pytest.raises(ValueError, match="num_kv_heads=model.local_kv_heads"):
        model(d.batch(ForwardMode.PREFILL, [(d.new_req(), [1, 2])]), d.pool)


def test_prefill_past_max_context_len_is_refused():
    cfg = tiny_config("qwen3")
    model = build_model(cfg, dtype=torch.float32, device="cpu", max_context_len=8)
    model.load_weights(random_checkpoint(cfg).items())
    d = Driver(model, max_context_len=16)
    with pytest.raises(ValueError, match="10 tokens exceeds the model's max_context_len=8"):
        model(d.batch(ForwardMode.PREFILL, [(d.new_req(), list(range(10)))]), d.pool)
