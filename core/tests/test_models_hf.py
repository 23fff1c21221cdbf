"""The general forward against HF transformers (the outside oracle), on tiny random models."""

from __future__ import annotations

import pytest
import torch
from _models_util import Driver, hf_model, load_ours, save_hf
from lowlat.forward_batch import ForwardMode

ARCHS = ("llama", "qwen3", "qwen3_moe")  # llama: llama3 rope_scaling + attention bias; qwen3: tied; moe: 1 dense
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43]


@pytest.fixture(scope="module", params=ARCHS)
def checkpoint(request, tmp_path_factory):
    hf = hf_model(request.param)
    return hf, save_hf(hf, tmp_path_factory.mktemp(request.param))


def _prefill_last(model, prompt):
    d = Driver(model)
    return d.step(ForwardMode.PREFILL, [(d.new_req(), prompt)])[0]


def test_prefill_logits_match_hf_float32(checkpoint):
    hf, path = checkpoint
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0, -1].float()
    got = _prefill_last(load_ours(path), PROMPT)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_prefill_logits_match_hf_bfloat16(checkpoint):
    hf, path = checkpoint
    hf16 = hf_model({"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3",
                     "Qwen3MoeForCausalLM": "qwen3_moe"}[hf.config.architectures[0]])
    hf16.load_state_dict(hf.state_dict())
    hf16 = hf16.to(torch.bfloat16)
    with torch.no_grad():
        ref = hf16(torch.tensor([PROMPT])).logits[0, -1].float()
    got = _prefill_last(load_ours(path, dtype=torch.bfloat16), PROMPT)
    torch.testing.assert_close(got, ref, atol=0.15, rtol=0.02)


def test_greedy_generation_matches_hf(checkpoint):
    hf, path = checkpoint
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, min_new_tokens=32,
                          do_sample=False)[0, len(PROMPT):].tolist()
    assert Driver(load_ours(path)).generate(PROMPT, 32) == ref


def test_llama3_rope_inv_freq_matches_hf():
    from _models_util import LLAMA3_ROPE
    from lowlat.layers.rotary import rope_inv_freq
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = hf_model("llama").config
    want, scale = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    got = rope_inv_freq(16, 10000.0, dict(LLAMA3_ROPE))
    assert scale == 1.0
    torch.testing.assert_close(got, want, atol=0, rtol=0)
