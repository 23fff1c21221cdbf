"""The general path against transformers on every supported variant: logits at every step and greedy tokens.

For each ``SUPPORTED_VARIANTS`` entry a tiny model is built by transformers' own config and model classes,
given seeded random weights of sane scale (biases and norms included, so dropping one shows), written with
``save_pretrained`` and read back through lowlat's loader (``resolve_model`` + ``open_weights``: the path the
engine takes). Our greedy run (a prefill and 32 decodes, float32, CPU) must give, at every step, the logits
transformers gives for the same prefix (one teacher-forced forward over prompt + our tokens), and each of our
tokens must be transformers' argmax, which makes the two greedy sequences equal.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from _models_util import Driver
from lowlat.distributed import TPInfo
from lowlat.forward_batch import ForwardMode
from lowlat.loader import open_weights, resolve_model
from lowlat.models import build_model
from lowlat.models.variants import SUPPORTED_VARIANTS, Variant

tf = pytest.importorskip("transformers")

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43]
STEPS = 33  # tokens generated: the prefill's and 32 decode steps'
ATOL = RTOL = 1e-4
CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
           "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM")}
# ModelConfig fields that carry no math (torch_dtype: the checkpoint's storage dtype; save_pretrained writes float32)
_NO_MATH = {"torch_dtype"}


def _std(name: str, shape: tuple[int, ...], hidden: int, layers: int) -> tuple[float, float]:
    if "norm" in name:
        return 1.0, 0.1
    if name.endswith("bias"):
        return 0.0, 0.2
    if "embed_tokens" in name or "lm_head" in name:
        return 0.0, 2.5 / math.sqrt(hidden)
    if name.endswith(("o_proj.weight", "down_proj.weight", "down_proj")):
        return 0.0, 8.0 / math.sqrt(shape[-1]) / math.sqrt(2 * layers)
    return 0.0, 1.0 / math.sqrt(shape[-1])


def hf_model(v: Variant, seed: int = 0) -> torch.nn.Module:
    """transformers' model of variant ``v`` (float32, eval) with seeded weights of sane scale."""
    cfg = v.config()
    d = cfg.to_hf_dict()
    cfg_cls, model_cls = CLASSES[d.pop("model_type")]
    d.pop("torch_dtype")
    hf_cfg = getattr(tf, cfg_cls)(**d)
    torch.manual_seed(seed)
    model = getattr(tf, model_cls)(hf_cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            mean, std = _std(name, tuple(p.shape), cfg.hidden_size, cfg.num_hidden_layers)
            p.copy_(mean + std * torch.randn(p.shape, generator=gen))
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


def save(v: Variant, root: Path) -> tuple[torch.nn.Module, Path]:
    model = hf_model(v)
    path = root / v.name
    model.save_pretrained(path)
    return model, path


def load_ours(path: Path, tp: TPInfo | None = None) -> torch.nn.Module:
    """Our general model of the checkpoint at ``path``, through the engine's loader path."""
    cfg = resolve_model(str(path))
    model = build_model(cfg, dtype=torch.float32, device="cpu", tp=tp, max_context_len=64)
    _, weights = open_weights(str(path), cfg, dtype=torch.float32)
    model.load_weights(weights)
    return model


def greedy(model: torch.nn.Module, steps: int = STEPS) -> tuple[list[int], torch.Tensor]:
    """(tokens, logits [steps, vocab]): a prefill of PROMPT then decode steps, argmax each time."""
    d = Driver(model, max_reqs=1, max_context_len=64)
    row = d.new_req()
    logits = [d.step(ForwardMode.PREFILL, [(row, PROMPT)])[0]]
    tokens = [int(logits[-1].argmax())]
    while len(tokens) < steps:
        logits.append(d.step(ForwardMode.DECODE, [(row, [tokens[-1]])], host_lens=False)[0])
        tokens.append(int(logits[-1].argmax()))
    return tokens, torch.stack(logits)


def hf_logits(hf: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """transformers' logits [len(tokens), vocab] for the prefixes PROMPT + tokens[:i], one teacher-forced forward."""
    ids = torch.tensor([PROMPT + tokens[:-1]])
    with torch.no_grad():
        out = hf(ids).logits[0].float()
    return out[len(PROMPT) - 1:]


def assert_matches_hf(tokens: list[int], logits: torch.Tensor, ref: torch.Tensor, name: str) -> None:
    assert logits.shape == ref.shape, name
    for step in range(len(tokens)):
        torch.testing.assert_close(logits[step], ref[step], atol=ATOL, rtol=RTOL,
                                   msg=lambda m, s=step: f"{name}, step {s}: {m}")
    assert tokens == ref.argmax(-1).tolist(), f"{name}: greedy tokens differ from transformers'"
    assert len(set(tokens)) > 3, f"{name}: degenerate greedy run, the test would prove little"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[torch.nn.Module, Path]]:
    root = tmp_path_factory.mktemp("hf_variants")
    return {v.name: save(v, root) for v in SUPPORTED_VARIANTS}


@pytest.mark.parametrize("v", SUPPORTED_VARIANTS, ids=lambda v: v.name)
def test_variant_matches_transformers(v: Variant, checkpoints) -> None:
    hf, path = checkpoints[v.name]
    cfg = resolve_model(str(path))
    want = v.config()
    assert {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in _NO_MATH} == \
        {f.name: getattr(want, f.name) for f in dataclasses.fields(want) if f.name not in _NO_MATH}
    tokens, logits = greedy(load_ours(path))
    assert_matches_hf(tokens, logits, hf_logits(hf, tokens), v.name)


def test_eos_list_reaches_the_stop_set(checkpoints) -> None:
    """transformers' generation_config.json carries the whole eos list; lowlat stops on each id."""
    from lowlat.loader import load_tokenizer

    hf, path = checkpoints["llama-eos-list"]
    assert hf.generation_config.eos_token_id == [257, 3]
    assert resolve_model(str(path)).eos_token_id == (257, 3)
    with pytest.warns(UserWarning, match="no tokenizer.json.*eos ids \\[257, 3\\]"):
        tok = load_tokenizer(path)
    assert tok.eos_token_ids == (257, 3)


def test_a_dropped_bias_would_be_caught(checkpoints) -> None:
    """The comparison has teeth: the mlp_bias variant without its biases is far from transformers."""
    hf, path = checkpoints["llama-mlp-bias"]
    model = load_ours(path)
    for layer in model.model.layers:
        layer.mlp.gate_up_proj.bias.zero_()
        layer.mlp.down_proj.bias.zero_()
    tokens, logits = greedy(model, steps=4)
    ref = hf_logits(hf, tokens)
    assert (logits - ref).abs().max() > 0.1


@pytest.mark.parametrize("v", SUPPORTED_VARIANTS, ids=lambda v: v.name)
def test_config_json_without_default_valued_fields(v: Variant, checkpoints, tmp_path) -> None:
    """A config.json that omits every field equal to transformers' default means the same model to both."""
    import json

    _, path = checkpoints[v.name]
    full = json.loads((path / "config.json").read_text())
    cfg_cls = getattr(tf, CLASSES[full["model_type"]][0])
    defaults = cfg_cls().to_dict()
    keep = {"architectures", "model_type"}
    stripped = {k: val for k, val in full.items() if k in keep or k not in defaults or defaults[k] != val}
    assert len(stripped) < len(full)
    (tmp_path / "config.json").write_text(json.dumps(stripped))
    hf_stripped = tf.AutoConfig.from_pretrained(tmp_path)
    for k, val in full.items():  # transformers reads the stripped file as the full one
        if k not in ("transformers_version", "dtype", "layer_types"):
            assert getattr(hf_stripped, k, val) == val, k
    assert resolve_model(str(tmp_path)) == resolve_model(str(path))
