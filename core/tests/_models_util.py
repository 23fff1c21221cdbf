"""Helpers of the test_models_* tests: tiny HF models as the oracle, and a driver for our forward."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from lowlat.config import ModelConfig
from lowlat.distributed import TPInfo
from lowlat.forward_batch import ForwardBatch, ForwardMode
from lowlat.kv_cache import KVPool
from lowlat.models import build_model
from safetensors.torch import load_file

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              head_dim=16, max_position_embeddings=256, initializer_range=0.2, rms_norm_eps=1e-6,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def hf_model(arch: str, seed: int = 0, **overrides: object) -> torch.nn.Module:
    """A tiny random HF model of ``arch`` ("llama", "qwen3", "qwen3_moe") in float32, eval mode."""
    import transformers as tf

    kw: dict[str, object] = dict(COMMON)
    if arch == "llama":
        kw.update(num_key_value_heads=2, attention_bias=True, rope_parameters=dict(LLAMA3_ROPE),
                  tie_word_embeddings=False)
        cfg, cls = tf.LlamaConfig, tf.LlamaForCausalLM
    elif arch == "qwen3":
        kw.update(num_key_value_heads=2, tie_word_embeddings=True, rope_parameters={"rope_theta": 1e6})
        cfg, cls = tf.Qwen3Config, tf.Qwen3ForCausalLM
    elif arch == "qwen3_moe":
        kw.update(num_key_value_heads=1, tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1])
        cfg, cls = tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM
    else:
        raise ValueError(arch)
    kw.update(overrides)
    torch.manual_seed(seed)
    return cls(cfg(**kw)).eval()


def save_hf(model: torch.nn.Module, path: Path) -> Path:
    model.save_pretrained(path, safe_serialization=True)
    return path


def model_config(path: Path) -> ModelConfig:
    """ModelConfig of a saved checkpoint.

    transformers 5.x writes Qwen3-MoE's expert count as ``num_local_experts``, which ModelConfig.from_hf_dict
    does not read (reported to the lead); fill it in here.
    """
    d = json.loads((path / "config.json").read_text())
    cfg = ModelConfig.from_hf_dict(d)
    if cfg.is_moe and not cfg.num_experts and d.get("num_local_experts"):
        cfg = dataclasses.replace(cfg, num_experts=int(d["num_local_experts"]))
    return cfg


def tiny_config(arch: str, **overrides: object) -> ModelConfig:
    """A tiny ModelConfig without transformers: "llama" (GQA 4:2, llama3 rope), "qwen3" (tied), "qwen3_moe"."""
    kw: dict[str, object] = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                                 rope_theta=10000.0, max_position_embeddings=256)
    if arch == "llama":
        kw.update(architecture="LlamaForCausalLM", rope_scaling=dict(LLAMA3_ROPE))
    elif arch == "qwen3":
        kw.update(architecture="Qwen3ForCausalLM", tie_word_embeddings=True)
    elif arch == "qwen3_moe":
        kw.update(architecture="Qwen3MoeForCausalLM", num_key_value_heads=1, num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=32, mlp_only_layers=(1,))
    kw.update(overrides)
    return ModelConfig(**kw)  # type: ignore[arg-type]


def random_checkpoint(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-named random tensors for ``cfg`` (per-expert layout), from the unsharded model's weight targets."""
    gen = torch.Generator().manual_seed(seed)
    model = build_model(cfg, dtype=torch.float32, device="cpu")
    out = {}
    for name, t in model.hf_targets().items():
        if t.required:
            base = 1.0 if name.endswith("norm.weight") else 0.0
            out[name] = base + 0.2 * torch.randn(t.shape, generator=gen)
    return out


def random_model(cfg: ModelConfig, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                 tp: TPInfo | None = None) -> torch.nn.Module:
    model = build_model(cfg, dtype=dtype, device="cpu", tp=tp, max_context_len=128)
    model.load_weights(random_checkpoint(cfg, seed).items())
    return model


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def load_ours(path: Path, dtype: torch.dtype = torch.float32, tp: TPInfo | None = None,
              max_context_len: int = 128) -> torch.nn.Module:
    model = build_model(model_config(path), dtype=dtype, device="cpu", tp=tp, max_context_len=max_context_len)
    model.load_weights(checkpoint_tensors(path).items())
    return model


class Driver:
    """Runs our model over a KV pool, tracking each request's cached length."""

    def __init__(self, model: torch.nn.Module, *, max_reqs: int = 4, max_context_len: int = 128,
                 page_size: int = 4) -> None:
        c = model.config
        self.model = model
        self.pool = KVPool(num_layers=c.num_hidden_layers, num_pages=max_reqs * max_context_len // page_size + 1,
                           page_size=page_size, num_kv_heads=model.local_kv_heads, head_dim=c.head_dim,
                           dtype=model.dtype, device="cpu", max_reqs=max_reqs, max_context_len=max_context_len)
        self.lens: dict[int, int] = {}

    def new_req(self) -> int:
        row = self.pool.alloc_req()
        self.lens[row] = 0
        return row

    def batch(self, mode: ForwardMode, reqs: list[tuple[int, list[int]]], host_lens: bool = True) -> ForwardBatch:
        prefix = [self.lens[r] for r, _ in reqs]
        ext = [len(toks) for _, toks in reqs]
        locs = torch.cat([self.pool.alloc_slots(r, p + e) for (r, _), p, e in zip(reqs, prefix, ext)])
        for (r, _), p, e in zip(reqs, prefix, ext):
            self.lens[r] = p + e
        ids = [t for _, toks in reqs for t in toks]
        b = ForwardBatch.build(mode, ids, prefix, ext, [r for r, _ in reqs], locs, "cpu")
        if not host_lens:
            b.seq_lens_cpu = b.extend_lens_cpu = None
        return b

    def step(self, mode: ForwardMode, reqs: list[tuple[int, list[int]]], host_lens: bool = True) -> torch.Tensor:
        return self.model(self.batch(mode, reqs, host_lens), self.pool)

    def generate(self, prompt: list[int], n: int) -> list[int]:
        row = self.new_req()
        tok = int(self.step(ForwardMode.PREFILL, [(row, prompt)]).argmax(-1)[0])
        out = [tok]
        while len(out) < n:
            tok = int(self.step(ForwardMode.DECODE, [(row, [tok])]).argmax(-1)[0])
            out.append(tok)
        return out


def script(model: torch.nn.Module) -> list[torch.Tensor]:
    """A fixed mix of steps (ragged prefill, chunked prefill, decode, verify); returns every step's logits."""
    d = Driver(model)
    a, b = d.new_req(), d.new_req()
    out = [d.step(ForwardMode.PREFILL, [(a, [1, 5, 9, 13, 17]), (b, [2, 4, 6])])]
    out.append(d.step(ForwardMode.PREFILL, [(b, [8, 10, 12, 14])]))
    out.append(d.step(ForwardMode.DECODE, [(a, [21]), (b, [16])], host_lens=False))
    out.append(d.step(ForwardMode.VERIFY, [(a, [3, 7, 11]), (b, [18, 20, 22])], host_lens=False))
    return out


def tp_worker(rank: int, world: int, store: str, archs: list[str], out_dir: str) -> None:
    """One rank of the TP test: run ``script`` on a seeded random model of each arch; rank 0 saves the logits."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        tp = TPInfo(rank=rank, size=world, group=dist.group.WORLD)
        for arch in archs:
            logits = script(random_model(tiny_config(arch), tp=tp))
            if rank == 0:
                torch.save(logits, Path(out_dir) / f"logits_{arch}.pt")
    finally:
        dist.destroy_process_group()
