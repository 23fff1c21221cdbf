"""Seeded random weights in the HF checkpoint layout, generated on the target device, and a writer for them.

Each tensor comes from its own ``torch.Generator`` on the target device, seeded from (seed, tensor name), so a
tensor does not depend on which others are generated. Values are drawn in float32 and cast to the requested
dtype, so a bfloat16 model is the rounding of the float32 one. CPU and CUDA generators give different streams:
the same seed gives the same weights on the same device type (and torch version), not across devices.

Scales keep activations and logits sane at any size (so greedy decoding is not degenerate):
- embeddings (and tied lm_head) and an untied lm_head: std 2.5 / sqrt(hidden), giving logits of std about 2.5;
- input-side projections (q, k, v, gate, up, router): std 1 / sqrt(fan_in), outputs of unit scale;
- residual-side projections (o, down): std ``8 / sqrt(fan_in) / sqrt(2 * layers)`` (the 1/sqrt(2 * layers) is
  GPT-2's scaled residual init, Radford et al. 2019). The layers' sum then outweighs the embedding in the
  residual stream; otherwise a tied lm_head scores the current token far above the rest and greedy decoding
  repeats it forever (measured with transformers on the tiny presets);
- RMSNorm weights: 1 + normal(0, 0.05); biases (when ``attention_bias``): normal(0, 0.02).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from lowlat.config import DTYPES, ConfigError, ModelConfig

LOGIT_STD = 2.5
RESIDUAL_STD = 8.0  # see the module docstring
NORM_NOISE = 0.05
BIAS_STD = 0.02
DEFAULT_MAX_SHARD_BYTES = 5_000_000_000  # HF save_pretrained's default "5GB"
_PROGRESS_MIN_BYTES = 256 * 2**20


def as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """``torch.bfloat16`` / ``"bfloat16"`` etc. -> torch.dtype. Raises ConfigError on other dtypes."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        return DTYPES[dtype]
    if dtype not in DTYPES.values():
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype}")
    return dtype


def check_device(device: torch.device | str) -> torch.device:
    """``device`` as a torch.device, checked usable. Raises ConfigError naming the problem and the fix."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"invalid device {device!r}; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {device!r} asked for but no CUDA/ROCm GPU is available; use cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"device {device!r} does not exist: {torch.cuda.device_count()} GPU(s) visible")
    elif dev.type != "cpu":
        raise ConfigError(f"device {device!r} is not supported for weight generation; use cpu or cuda")
    return dev


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the config.json spelling)."""
    return next(k for k, v in DTYPES.items() if v == dtype)


def hf_tensor_shapes(config: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of ``config``'s HF checkpoint as (HF name, shape), in checkpoint order.

    Llama / Qwen3 / Qwen3-MoE layout (transformers' modeling_llama, modeling_qwen3, modeling_qwen3_moe):
    q/k/v/o_proj per layer, q_norm/k_norm [head_dim] for Qwen3, dense gate/up/down_proj or, on MoE layers,
    the router ``mlp.gate`` [E, H] and per-expert ``mlp.experts.{e}.{gate,up,down}_proj``; ``lm_head.weight``
    only when the embeddings are untied.
    """
    c = config
    h, d = c.hidden_size, c.head_dim
    q, kv = c.num_attention_heads * d, c.num_key_value_heads * d
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (c.vocab_size, h))]
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        out.append((p + "input_layernorm.weight", (h,)))
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            out.append((p + f"self_attn.{name}.weight", (rows, h)))
            if c.attention_bias:
                out.append((p + f"self_attn.{name}.bias", (rows,)))
        out.append((p + "self_attn.o_proj.weight", (h, q)))
        if c.attention_bias:
            out.append((p + "self_attn.o_proj.bias", (h,)))
        if c.has_qk_norm:
            out += [(p + "self_attn.q_norm.weight", (d,)), (p + "self_attn.k_norm.weight", (d,))]
        out.append((p + "post_attention_layernorm.weight", (h,)))
        if c.is_moe_layer(i):
            inter = c.moe_intermediate_size
            out.append((p + "mlp.gate.weight", (c.num_experts, h)))
            for e in range(c.num_experts):
                pe = p + f"mlp.experts.{e}."
                out += [(pe + "gate_proj.weight", (inter, h)), (pe + "up_proj.weight", (inter, h)),
                        (pe + "down_proj.weight", (h, inter))]
        else:
            inter = c.intermediate_size
            out += [(p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
                    (p + "mlp.down_proj.weight", (h, inter))]
            if c.mlp_bias:
                out += [(p + "mlp.gate_proj.bias", (inter,)), (p + "mlp.up_proj.bias", (inter,)),
                        (p + "mlp.down_proj.bias", (h,))]
    out.append(("model.norm.weight", (h,)))
    if not c.tie_word_embeddings:
        out.append(("lm_head.weight", (c.vocab_size, h)))
    return out


def synthetic_num_bytes(config: ModelConfig, dtype: torch.dtype | str = torch.bfloat16) -> int:
    """Bytes of all tensors of ``config``'s checkpoint in ``dtype`` (tied lm_head counted once)."""
    size = torch.empty((), dtype=as_dtype(dtype)).element_size()
    return sum(math.prod(shape) for _, shape in hf_tensor_shapes(config)) * size


def _tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"lowlat/{int(seed)}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _init(config: ModelConfig, name: str, shape: tuple[int, ...]) -> tuple[float, float]:
    """(mean, std) of tensor ``name`` (see the module docstring for the rule)."""
    emb_std = LOGIT_STD / math.sqrt(config.hidden_size)
    if name.endswith("norm.weight"):
        return 1.0, NORM_NOISE
    if name.endswith(".bias"):
        return 0.0, BIAS_STD
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return 0.0, emb_std
    fan_in = shape[-1]
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return 0.0, RESIDUAL_STD / math.sqrt(fan_in) / math.sqrt(2 * config.num_hidden_layers)
    return 0.0, 1.0 / math.sqrt(fan_in)


def synthetic_tensor(config: ModelConfig, name: str, shape: tuple[int, ...], *, seed: int,
                     dtype: torch.dtype | str = torch.bfloat16, device: torch.device | str = "cpu") -> torch.Tensor:
    """One synthetic tensor (float32 draw on ``device`` from a generator seeded by (seed, name), cast to dtype)."""
    device = torch.device(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(_tensor_seed(seed, name))
    mean, std = _init(config, name, shape)
    t = torch.empty(shape, dtype=torch.float32, device=device)
    t.normal_(mean, std, generator=gen)
    return t.to(as_dtype(dtype))


def iter_synthetic_weights(config: ModelConfig, *, seed: int = 0, dtype: torch.dtype | str = torch.bfloat16,
                           device: torch.device | str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor) for every tensor of ``config``'s checkpoint, generated lazily on ``device``.

    Shapes and order are ``hf_tensor_shapes(config)``; dtype is ``dtype`` (bfloat16, float16 or float32).
    Deterministic per (seed, name, device type). No CPU round trip: on CUDA each tensor is drawn by a CUDA
    generator in device memory.

    Raises:
        ConfigError: at call time, for a dtype other than bfloat16/float16/float32 or an unusable device.
    """
    dt, dev = as_dtype(dtype), check_device(device)
    return ((name, synthetic_tensor(config, name, shape, seed=seed, dtype=dt, device=dev))
            for name, shape in hf_tensor_shapes(config))


def _plan_shards(shapes: list[tuple[str, tuple[int, ...]]], elem: int, max_bytes: int) -> list[list[str]]:
    """Greedy split in checkpoint order; a tensor larger than ``max_bytes`` gets a shard of its own (HF's rule)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes:
        n = math.prod(shape) * elem
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def _existing_ancestor(p: Path) -> Path:
    p = p.absolute()
    while not p.exists():
        p = p.parent
    return p


def _umask() -> int:
    """The process's umask, read without changing it where Linux reports it (os.umask sets it to read it)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o077)  # briefly the strictest common mask: a file another thread makes meanwhile stays private
    os.umask(mask)
    return mask


def _checkpoint_files(d: Path) -> list[Path]:
    names = ("config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json")
    return sorted(f for f in d.iterdir() if f.name in names or (f.name.startswith("model") and
                                                                 f.name.endswith((".safetensors", ".safetensors.tmp"))))


def write_checkpoint(config: ModelConfig, out_dir: str | os.PathLike[str], *, seed: int = 0,
                     dtype: torch.dtype | str = torch.bfloat16, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                     device: torch.device | str = "cpu", overwrite: bool = False,
                     progress: bool | None = None) -> Path:
    """Write ``config``'s synthetic weights as an HF checkpoint directory and return its path.

    Writes sharded ``model-0000i-of-0000N.safetensors`` files with ``model.safetensors.index.json``, then
    ``tokenizer.json`` / ``tokenizer_config.json`` (the byte tokenizer) and, last, ``config.json``
    (``torch_dtype`` set to ``dtype``), so a directory with config.json is complete. Tensors are generated on
    ``device`` (see ``iter_synthetic_weights``; a CUDA device gives different values than CPU).
    ``progress``: show a rich progress bar on stderr (None: only above 256 MiB). Every file gets the mode a new
    file gets under the process's umask (0644 under 022), the shards too.

    Raises:
        ConfigError: bad dtype or device, vocab_size < 258, ``out_dir`` is a file or already holds checkpoint
            files (pass ``overwrite=True``), the disk lacks space for the checkpoint, or ``max_shard_bytes`` < 1.
    """
    from safetensors.torch import save_file

    from lowlat.loader.tokenizer import byte_tokenizer_config, make_byte_tokenizer

    dt, device = as_dtype(dtype), check_device(device)
    if config.vocab_size < 258:
        raise ConfigError(f"vocab_size {config.vocab_size} cannot hold the byte tokenizer written with the "
                          "checkpoint (258 ids); use a vocab_size >= 258")
    if max_shard_bytes < 1:
        raise ConfigError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} exists and is not a directory; choose another output directory")
    if out.is_dir():
        old = _checkpoint_files(out)
        if old and not overwrite:
            raise ConfigError(f"{out} already holds a checkpoint ({old[0].name}, ...); "
                              "choose another directory or overwrite it (--force / overwrite=True)")
        for f in old:
            f.unlink()

    shapes = hf_tensor_shapes(config)
    total = synthetic_num_bytes(config, dt)
    need = total + 64 * 2**20 + 1024 * len(shapes)  # headers, tokenizer, slack
    root = _existing_ancestor(out)
    free = shutil.disk_usage(root).free
    if free < need:
        raise ConfigError(
            f"writing this checkpoint needs about {need / 1e9:.2f} GB but only {free / 1e9:.2f} GB are free on the "
            f"disk holding {root}; choose --out on a larger disk, write fewer layers (--layers N), "
            f"or skip writing: pass the preset name as the model and the weights are generated in device memory")
    out.mkdir(parents=True, exist_ok=True)

    mode = 0o666 & ~_umask()  # a new file's mode, as for config.json (0644 under umask 022)
    elem = torch.empty((), dtype=dt).element_size()
    shard_names = _plan_shards(shapes, elem, max_shard_bytes)
    shape_of = dict(shapes)
    n = len(shard_names)
    weight_map: dict[str, str] = {}
    show = progress if progress is not None else total >= _PROGRESS_MIN_BYTES
    bar, task = None, None
    if show:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )
        bar = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                       TimeRemainingColumn(), console=Console(stderr=True))
        task = bar.add_task(f"writing {out.name}", total=total)
        bar.start()
    try:
        for k, names in enumerate(shard_names, start=1):
            fname = f"model-{k:05d}-of-{n:05d}.safetensors"
            tensors = {}
            for name in names:
                t = synthetic_tensor(config, name, shape_of[name], seed=seed, dtype=dt, device=device)
                tensors[name] = t.cpu().contiguous()
                weight_map[name] = fname
                if bar is not None:
                    bar.update(task, advance=tensors[name].numel() * elem / 2,
                               description=f"shard {k}/{n} generating")
            tmp = out / (fname + ".tmp")
            if bar is not None:
                bar.update(task, description=f"shard {k}/{n} writing")
            save_file(tensors, str(tmp), metadata={"format": "pt"})
            os.chmod(tmp, mode)  # safetensors writes 0600 whatever the umask; the other files follow it
            tmp.replace(out / fname)
            if bar is not None:
                bar.update(task, advance=sum(t.numel() for t in tensors.values()) * elem / 2)
            del tensors
    finally:
        if bar is not None:
            bar.stop()

    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    make_byte_tokenizer().save(str(out / "tokenizer.json"))
    tok_cfg = byte_tokenizer_config(config.max_position_embeddings)
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    cfg = dataclasses.replace(config, torch_dtype=dtype_name(dt)).to_hf_dict()
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out
