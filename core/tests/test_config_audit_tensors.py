"""Every checkpoint tensor accounted for before anything loads; quantized checkpoints refused; the tokenizer
fallback keeps the checkpoint's own stopping ids."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from lowlat.config import ConfigError
from lowlat.loader import CheckpointError, get_preset, load_tokenizer, open_weights, with_layers, write_checkpoint
from lowlat.models import build_model
from safetensors.torch import load_file, save_file


def _ckpt(tmp_path: Path, preset: str = "tiny-llama", **config_changes: object) -> Path:
    out = write_checkpoint(get_preset(preset), tmp_path / preset, seed=3, dtype="float32")
    if config_changes:
        p = out / "config.json"
        p.write_text(json.dumps({**json.loads(p.read_text()), **config_changes}))
    return out


def _rewrite(path: Path, edit) -> None:
    files = sorted(path.glob("model*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(f))
        f.unlink()
    (path / "model.safetensors.index.json").unlink(missing_ok=True)
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def _load(path: Path, config=None) -> torch.nn.Module:
    cfg, weights = open_weights(str(path), config, dtype=torch.float32)
    model = build_model(cfg, dtype=torch.float32, device="cpu", max_context_len=32)
    model.load_weights(weights)
    return model


def test_mlp_biases_without_mlp_bias_are_an_error_naming_them_once(tmp_path) -> None:
    """The issue's first example: the loader used to drop these before its unexpected-tensor check."""
    path = _ckpt(tmp_path)
    _rewrite(path, lambda t: t.update({f"model.layers.{i}.mlp.{p}.bias": torch.zeros(128 if p != "down_proj" else 64)
                                       for i in range(2) for p in ("gate_proj", "up_proj", "down_proj")}))
    with pytest.raises(CheckpointError) as e:
        open_weights(str(path), dtype=torch.float32)
    msg = str(e.value)
    assert "6 unexpected tensor(s)" in msg and "math lowlat would drop" in msg
    assert msg.count("model.layers.0.mlp.gate_proj.bias") == 1 and "model.layers.1.mlp.down_proj.bias" in msg
    # with mlp_bias in config.json the same checkpoint loads and uses them
    (path / "config.json").write_text(json.dumps({**json.loads((path / "config.json").read_text()), "mlp_bias": True}))
    model = _load(path)
    assert model.model.layers[0].mlp.gate_up_proj.bias is not None


@pytest.mark.parametrize("extra,shape", [("model.layers.0.self_attn.q_proj.bias", (128,)),
                                         ("model.layers.0.self_attn.q_norm.weight", (32,)),
                                         ("model.layers.1.mlp.shared_expert.gate_proj.weight", (16, 64)),
                                         ("model.layers.2.input_layernorm.weight", (64,))])
def test_unexpected_tensor_inside_the_network_is_an_error(tmp_path, extra: str, shape: tuple[int, ...]) -> None:
    path = _ckpt(tmp_path)
    _rewrite(path, lambda t: t.update({extra: torch.ones(shape)}))
    with pytest.raises(CheckpointError, match=f"1 unexpected tensor.*{extra.replace('.', '[.]')}"):
        open_weights(str(path), dtype=torch.float32)


def test_missing_tensor_is_an_error_naming_it(tmp_path) -> None:
    path = _ckpt(tmp_path, attention_bias=True)
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\), e.g. model.layers.0.self_attn.q_proj.bias"):
        open_weights(str(path), dtype=torch.float32)


def test_harmless_tensors_load_and_outside_ones_warn(tmp_path) -> None:
    path = _ckpt(tmp_path, "tiny-qwen3")  # tied
    want = _load(path).lm_head.weight.clone()
    _rewrite(path, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(16),
                                       "lm_head.weight": torch.zeros(512, 64)}))
    assert torch.equal(_load(path).lm_head.weight, want)  # tied: a stored lm_head is ignored, as transformers does
    _rewrite(path, lambda t: t.update({"mtp.0.proj.weight": torch.ones(4, 4)}))
    with pytest.warns(UserWarning, match="1 checkpoint tensor.*outside the Qwen3ForCausalLM network.*mtp.0.proj"):
        _load(path)


def test_fewer_layers_in_config_json_is_an_error_but_with_layers_loads(tmp_path) -> None:
    path = _ckpt(tmp_path, num_hidden_layers=1)
    with pytest.raises(CheckpointError, match="unexpected tensor.*model.layers.1."):
        open_weights(str(path), dtype=torch.float32)
    full = _ckpt(tmp_path / "full")
    _load(full, with_layers(get_preset("tiny-llama"), 1))


def test_huge_layer_count_fails_fast_against_the_checkpoint(tmp_path) -> None:
    path = _ckpt(tmp_path, num_hidden_layers=9000)
    t0 = time.perf_counter()
    with pytest.raises(CheckpointError, match="num_hidden_layers=9000 but the checkpoint holds tensors of 2 layer"):
        open_weights(str(path), dtype=torch.float32)
    assert time.perf_counter() - t0 < 1.0


def test_fused_expert_layout_loads_like_per_expert(tmp_path) -> None:
    path = _ckpt(tmp_path, "tiny-qwen3-moe")
    want = _load(path).model.layers[1].mlp.experts.w13_weight.clone()

    def fuse(t: dict[str, torch.Tensor]) -> None:
        for i in range(2):
            p = f"model.layers.{i}.mlp.experts."
            gu = [torch.cat([t.pop(f"{p}{e}.gate_proj.weight"), t.pop(f"{p}{e}.up_proj.weight")]) for e in range(8)]
            t[p + "gate_up_proj"] = torch.stack(gu)
            t[p + "down_proj"] = torch.stack([t.pop(f"{p}{e}.down_proj.weight") for e in range(8)])

    _rewrite(path, fuse)
    assert torch.equal(_load(path).model.layers[1].mlp.experts.w13_weight, want)


def test_fp8_checkpoint_is_refused(tmp_path) -> None:
    """Before: FP8 tensors were cast to the model dtype and their scales dropped, so it loaded with wrong math."""
    path = _ckpt(tmp_path)

    def to_fp8(t: dict[str, torch.Tensor]) -> None:
        for n in [n for n in t if n.endswith("proj.weight")]:
            t[n] = t[n].to(torch.float8_e4m3fn)
            t[n.removesuffix("weight") + "weight_scale_inv"] = torch.ones(1)

    _rewrite(path, to_fp8)
    with pytest.raises(CheckpointError, match=r"quantized checkpoint .*model.layers.0.*\(F8_E4M3\).*unquantized"):
        open_weights(str(path), dtype=torch.float32)
    (path / "config.json").write_text(json.dumps({**json.loads((path / "config.json").read_text()),
                                                  "quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(ConfigError, match="quantization_config \\(quant_method='fp8'\\).*not supported"):
        open_weights(str(path), dtype=torch.float32)


def test_missing_tokenizer_warns_and_keeps_the_checkpoints_stopping(tmp_path) -> None:
    path = _ckpt(tmp_path, eos_token_id=[7, 9], bos_token_id=5)
    (path / "tokenizer.json").unlink()
    with pytest.warns(UserWarning, match="no tokenizer.json; using the built-in byte-level tokenizer"):
        tok = load_tokenizer(path)
    assert tok.eos_token_ids == (7, 9) and tok.bos_token_id == 5  # not the byte tokenizer's 257 / 256
    assert tok.note and tok.note.startswith("warning:")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 11}))
    with pytest.warns(UserWarning):
        assert load_tokenizer(path).eos_token_ids == (11,)
    cfg = json.loads((path / "config.json").read_text())
    del cfg["eos_token_id"]
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "generation_config.json").unlink()
    with pytest.warns(UserWarning, match="eos ids \\[\\]"):
        assert load_tokenizer(path).eos_token_ids == ()
