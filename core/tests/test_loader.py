"""Presets, synthetic weights, checkpoint writing/reading and its errors, open_weights/resolve_model."""

from __future__ import annotations

import json
import math
from collections import namedtuple

import pytest
import torch
from lowlat.config import ConfigError, ModelConfig
from lowlat.loader import (
    PRESETS,
    CheckpointError,
    CheckpointReader,
    get_preset,
    hf_tensor_shapes,
    iter_synthetic_weights,
    open_weights,
    resolve_model,
    synthetic_num_bytes,
    synthetic_tensor,
    with_layers,
    write_checkpoint,
)
from safetensors.torch import save_file

TINY = ["tiny-llama", "tiny-qwen3", "tiny-qwen3-moe"]


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_are_valid_configs(name: str) -> None:
    cfg = get_preset(name)
    assert cfg.vocab_size >= 258 and cfg.torch_dtype == "bfloat16"
    assert (cfg.bos_token_id, cfg.eos_token_id) == (256, 257)
    assert ModelConfig.from_hf_dict(json.loads(json.dumps(cfg.to_hf_dict()))) == cfg


def test_real_preset_shapes() -> None:
    llama = get_preset("llama-3.2-1b")
    assert (llama.vocab_size, llama.hidden_size, llama.num_hidden_layers, llama.num_attention_heads,
            llama.num_key_value_heads, llama.head_dim, llama.intermediate_size) == (128256, 2048, 16, 32, 8, 64, 8192)
    assert llama.tie_word_embeddings and llama.rope_scaling["factor"] == 32.0
    moe = get_preset("qwen3-30b-a3b")
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size, moe.num_hidden_layers) == (
        128, 8, 768, 48)
    # published parameter counts: Llama-3.2-1B 1.24 B, Qwen3-8B 8.2 B, Qwen3-30B-A3B 30.5 B
    assert synthetic_num_bytes(llama, "bfloat16") / 2 == pytest.approx(1.236e9, rel=0.01)
    assert synthetic_num_bytes(get_preset("qwen3-8b"), torch.bfloat16) / 2 == pytest.approx(8.19e9, rel=0.01)
    assert synthetic_num_bytes(moe, torch.bfloat16) / 2 == pytest.approx(30.5e9, rel=0.01)


def test_get_preset_unknown_lists_presets() -> None:
    with pytest.raises(ConfigError, match="tiny-llama.*qwen3-30b-a3b") as e:
        get_preset("tiny-lama")
    assert "did you mean 'tiny-llama'" in str(e.value)


def test_with_layers() -> None:
    cfg = with_layers(get_preset("qwen3-30b-a3b"), 2)
    assert cfg.num_hidden_layers == 2 and cfg.num_experts == 128
    assert sum(n.startswith("model.layers.") for n, _ in hf_tensor_shapes(cfg)) == 2 * (8 + 1 + 3 * 128)
    with pytest.raises(ConfigError, match="num_layers"):
        with_layers(cfg, 0)


def test_hf_tensor_shapes_layout() -> None:
    qwen = dict(hf_tensor_shapes(get_preset("tiny-qwen3")))
    assert "lm_head.weight" not in qwen  # tied
    assert qwen["model.layers.0.self_attn.q_proj.weight"] == (8 * 32, 64)
    assert qwen["model.layers.0.self_attn.o_proj.weight"] == (64, 8 * 32)
    assert qwen["model.layers.1.self_attn.k_norm.weight"] == (32,)
    llama = dict(hf_tensor_shapes(get_preset("tiny-llama")))
    assert "lm_head.weight" in llama and "model.layers.0.self_attn.q_norm.weight" not in llama
    moe = dict(hf_tensor_shapes(get_preset("tiny-qwen3-moe")))
    assert moe["model.layers.1.mlp.gate.weight"] == (8, 64)
    assert moe["model.layers.1.mlp.experts.7.down_proj.weight"] == (64, 32)
    assert "model.layers.0.mlp.gate_proj.weight" not in moe


def test_synthetic_deterministic_and_seeded() -> None:
    cfg = get_preset("tiny-qwen3-moe")
    a = dict(iter_synthetic_weights(cfg, seed=1))
    b = dict(iter_synthetic_weights(cfg, seed=1))
    c = dict(iter_synthetic_weights(cfg, seed=2))
    assert list(a) == [n for n, _ in hf_tensor_shapes(cfg)]
    for name, t in a.items():
        assert t.dtype == torch.bfloat16 and t.device.type == "cpu"
        assert torch.equal(t, b[name]), name
        assert not torch.equal(t, c[name]), name
    # a tensor depends on (seed, name) only, and bf16 is the rounding of the float32 draw
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    alone = synthetic_tensor(cfg, name, (32, 64), seed=1, dtype=torch.float32)
    assert torch.equal(alone.to(torch.bfloat16), a[name])
    assert not torch.equal(a["model.layers.0.mlp.experts.3.up_proj.weight"], a[name])


def test_synthetic_scales() -> None:
    cfg = get_preset("tiny-llama")
    w = dict(iter_synthetic_weights(cfg, seed=0, dtype=torch.float32))
    norm = w["model.layers.0.input_layernorm.weight"]
    assert (norm - 1).abs().max() < 0.3 and norm.std() > 0
    q = w["model.layers.0.self_attn.q_proj.weight"]
    assert q.std().item() == pytest.approx(1 / math.sqrt(64), rel=0.1)
    assert w["lm_head.weight"].std().item() == pytest.approx(2.5 / math.sqrt(64), rel=0.1)


def test_synthetic_bad_args() -> None:
    with pytest.raises(ConfigError, match="dtype"):
        iter_synthetic_weights(get_preset("tiny-llama"), dtype="int8")
    with pytest.raises(ConfigError, match="device"):
        iter_synthetic_weights(get_preset("tiny-llama"), device="tpu")


@pytest.mark.parametrize("name", TINY)
def test_write_read_round_trip_bit_exact(tmp_path, name: str) -> None:
    cfg = get_preset(name)
    out = write_checkpoint(cfg, tmp_path / "ckpt", seed=3, max_shard_bytes=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert index["metadata"]["total_size"] == synthetic_num_bytes(cfg)
    assert ModelConfig.from_dir(out) == cfg
    assert (out / "tokenizer.json").is_file()

    reader = CheckpointReader(out)
    reader.check_matches(cfg)
    assert reader.total_bytes() == synthetic_num_bytes(cfg)
    expected = dict(iter_synthetic_weights(cfg, seed=3))
    assert sorted(reader.names()) == sorted(expected)
    got = dict(reader.iter_tensors())
    for n, t in expected.items():
        assert reader.shape(n) == tuple(t.shape) and reader.dtype(n) == torch.bfloat16
        assert torch.equal(got[n], t), n
    # cast on load
    name0, t0 = next(reader.iter_tensors(dtype=torch.float32, names=["model.norm.weight"]))
    assert t0.dtype == torch.float32 and torch.equal(t0, expected[name0].float())


def test_write_float32_sets_config_dtype(tmp_path) -> None:
    out = write_checkpoint(get_preset("tiny-llama"), tmp_path, seed=0, dtype="float32")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"
    assert CheckpointReader(out).dtype("model.norm.weight") == torch.float32


def _sharded(tmp_path, name="tiny-llama"):
    out = write_checkpoint(get_preset(name), tmp_path / "ckpt", seed=0, max_shard_bytes=40_000)
    return out, sorted(out.glob("model-*.safetensors"))


def test_truncated_shard_names_file_and_missing_bytes(tmp_path) -> None:
    out, shards = _sharded(tmp_path)
    victim = shards[1]
    data = victim.read_bytes()
    victim.write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match=rf"{victim.name} is truncated: it lacks 100 bytes"):
        CheckpointReader(out)
    victim.write_bytes(data[:20])  # cut inside the header
    with pytest.raises(CheckpointError, match=rf"{victim.name} is truncated: it lacks \d+ bytes of its"):
        CheckpointReader(out)
    victim.write_bytes(data + b"xx")
    with pytest.raises(CheckpointError, match="2 bytes past the data"):
        CheckpointReader(out)


def test_missing_shard_is_named(tmp_path) -> None:
    out, shards = _sharded(tmp_path)
    shards[-1].unlink()
    with pytest.raises(CheckpointError, match=rf"names 1 shard\(s\) missing .*{shards[-1].name}"):
        CheckpointReader(out)


def test_index_naming_a_tensor_its_shard_lacks(tmp_path) -> None:
    out, shards = _sharded(tmp_path)
    path = out / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    index["weight_map"]["model.norm.weight"] = shards[0].name
    index["weight_map"]["model.layers.9.ghost.weight"] = shards[0].name
    path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="maps 2 tensor\\(s\\) to shards that do not hold them"):
        CheckpointReader(out)


def test_corrupt_header_and_no_checkpoint(tmp_path) -> None:
    with pytest.raises(CheckpointError, match="neither model.safetensors.index.json nor model.safetensors"):
        CheckpointReader(tmp_path)
    bad = tmp_path / "model.safetensors"
    bad.write_bytes((10).to_bytes(8, "little") + b"not json!!")
    with pytest.raises(CheckpointError, match="corrupt safetensors header"):
        CheckpointReader(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(CheckpointError, match="weight_map"):
        CheckpointReader(tmp_path)


def test_single_file_checkpoint_and_check_matches(tmp_path) -> None:
    cfg = get_preset("tiny-qwen3")
    tensors = dict(iter_synthetic_weights(cfg, seed=0))
    del tensors["model.norm.weight"]
    tensors["model.layers.0.self_attn.k_norm.weight"] = torch.ones(8, dtype=torch.bfloat16)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    reader = CheckpointReader(tmp_path)
    assert len(reader.names()) == len(tensors)
    assert torch.equal(dict(reader.iter_tensors())["model.embed_tokens.weight"], tensors["model.embed_tokens.weight"])
    with pytest.raises(CheckpointError, match="1 missing tensor.*model.norm.weight.*k_norm.weight is \\[8\\]"):
        reader.check_matches(cfg)
    with pytest.raises(KeyError, match="no tensor 'nope'"):
        reader.shape("nope")


def test_write_refuses_existing_and_full_disk(tmp_path, monkeypatch) -> None:
    cfg = get_preset("tiny-llama")
    write_checkpoint(cfg, tmp_path, seed=0)
    with pytest.raises(ConfigError, match="already holds a checkpoint.*--force"):
        write_checkpoint(cfg, tmp_path, seed=0)
    write_checkpoint(cfg, tmp_path, seed=1, overwrite=True)
    assert len(list(tmp_path.glob("model-*.safetensors"))) == 1

    import lowlat.loader.synthetic as synthetic

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(synthetic.shutil, "disk_usage", lambda p: usage(10**9, 10**9, 1000))
    with pytest.raises(ConfigError, match=r"needs about .* GB but only 0.00 GB are free.*--out on a larger disk"):
        write_checkpoint(get_preset("qwen3-30b-a3b"), tmp_path / "big", seed=0)
    assert not (tmp_path / "big").exists()


def test_resolve_model_and_open_weights(tmp_path) -> None:
    cfg = get_preset("tiny-qwen3")
    assert resolve_model("tiny-qwen3") == cfg
    with pytest.raises(ConfigError, match="neither a directory with config.json .* presets: tiny-llama"):
        resolve_model(str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match="a directory without config.json"):
        resolve_model(str(tmp_path))

    out = write_checkpoint(cfg, tmp_path / "ckpt", seed=5)
    assert resolve_model(str(out)) == cfg
    got_cfg, it = open_weights(str(out), seed=0, dtype="float32")
    from_dir = dict(it)
    got_cfg2, it2 = open_weights("tiny-qwen3", seed=5, dtype=torch.float32)
    synth = dict(it2)
    assert got_cfg == got_cfg2 == cfg
    assert sorted(from_dir) == sorted(synth)
    for n in synth:
        assert from_dir[n].dtype == torch.float32
        assert torch.equal(from_dir[n], synth[n].to(torch.bfloat16).float()), n

    two = with_layers(get_preset("tiny-llama"), 1)
    out2 = write_checkpoint(get_preset("tiny-llama"), tmp_path / "llama", seed=0)
    c1, it1 = open_weights(str(out2), two)
    names = {n for n, _ in it1}
    assert c1 == two and names == {n for n, _ in hf_tensor_shapes(two)}
    c2, it2 = open_weights("tiny-llama", two)
    assert {n for n, _ in it2} == names
    with pytest.raises(ConfigError, match="does not describe its checkpoint"):
        open_weights(str(out2), get_preset("tiny-qwen3"))
