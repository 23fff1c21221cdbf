"""HF transformers loads the checkpoints we write (proof the format is real HF), with our exact tensors."""

from __future__ import annotations

import os

import pytest
import torch
from lowlat.loader import get_preset, iter_synthetic_weights, write_checkpoint

transformers = pytest.importorskip("transformers")


def _hf_view(ours: dict[str, torch.Tensor], hf_params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our per-expert tensors as transformers >= 5 stores them (fused experts.gate_up_proj / down_proj)."""
    out = {n: t for n, t in ours.items() if ".experts." not in n}
    for name in hf_params:
        if name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj"):
            prefix, kind = name.rsplit(".", 1)
            n_exp = hf_params[name].shape[0]
            if kind == "gate_up_proj":
                per = [torch.cat([ours[f"{prefix}.{e}.gate_proj.weight"], ours[f"{prefix}.{e}.up_proj.weight"]])
                       for e in range(n_exp)]
            else:
                per = [ours[f"{prefix}.{e}.down_proj.weight"] for e in range(n_exp)]
            out[name] = torch.stack(per)
    if not any(".experts." in n for n in out):  # transformers 4.x keeps per-expert modules
        out = dict(ours)
    return out


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3", "tiny-qwen3-moe"])
def test_transformers_loads_our_checkpoint(tmp_path, monkeypatch, preset: str) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    cfg = get_preset(preset)
    out = write_checkpoint(cfg, tmp_path, seed=11, max_shard_bytes=50_000)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(out), dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert type(model).__name__ == cfg.architecture
    hf = dict(model.named_parameters())
    ours = _hf_view({n: t.float() for n, t in iter_synthetic_weights(cfg, seed=11)}, hf)
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        ours.pop("lm_head.weight", None)
        hf.pop("lm_head.weight", None)
    assert sorted(hf) == sorted(ours)
    for name, t in ours.items():
        assert torch.equal(hf[name].detach(), t), name

    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    ids = tok("héllo")["input_ids"]
    assert ids == list("héllo".encode()) and tok.decode(ids) == "héllo"
    assert (tok.bos_token_id, tok.eos_token_id) == (256, 257)

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    assert torch.isfinite(logits).all()
    assert (logits.std(-1) > 1.0).all()  # not flat: greedy decoding has real choices
    assert len(set(logits.argmax(-1).tolist())) > 1


@pytest.mark.parametrize("preset", ["llama-3.2-1b", "qwen3-8b", "qwen3-30b-a3b"])
def test_real_preset_shapes_match_transformers(preset: str) -> None:
    """transformers builds the same tensor names and shapes from our config.json (on the meta device)."""
    from lowlat.loader import hf_tensor_shapes, with_layers

    cfg = with_layers(get_preset(preset), 2)
    d = cfg.to_hf_dict()
    hf_cfg = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    hf = {n: tuple(p.shape) for n, p in model.named_parameters()}
    if cfg.tie_word_embeddings:
        assert "lm_head.weight" not in hf or model.config.tie_word_embeddings
        hf.pop("lm_head.weight", None)
    ours = {n: torch.empty(s, device="meta") for n, s in hf_tensor_shapes(cfg)}
    assert {n: tuple(t.shape) for n, t in _hf_view(ours, dict(model.named_parameters())).items()} == hf
