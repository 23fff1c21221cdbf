"""Read HF safetensors checkpoints (validated up front), and choose between a directory and a preset.

safetensors file format (huggingface/safetensors README): an 8-byte little-endian header length N, N bytes of
JSON mapping tensor name -> {dtype, shape, data_offsets: [begin, end]} (offsets relative to the data section)
plus an optional "__metadata__", then the data section. A complete file is therefore 8 + N + max(end) bytes.
A sharded checkpoint has ``model.safetensors.index.json`` = {"metadata": {...}, "weight_map": {name: file}}.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from lowlat.config import ConfigError, ModelConfig
from lowlat.loader.presets import PRESETS, closest_preset, get_preset
from lowlat.loader.synthetic import as_dtype, check_device, hf_tensor_shapes, iter_synthetic_weights

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_MAX_HEADER = 100 * 2**20  # the safetensors library's own header limit

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


HARMLESS = ("rotary_emb.inv_freq",)  # buffers older checkpoints saved; recomputed from config.json
_WEIGHT_DTYPES = ("BF16", "F16", "F32", "F64")
_QUANT_SUFFIXES = ("_scale", "_scale_inv", ".qweight", ".qzeros", ".scales", ".g_idx", "_packed", ".absmax")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _listing(names: list[str], limit: int = 20) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def _examples(names: list[str], entries: dict[str, dict]) -> str:
    return ", ".join(f"{n} ({entries[n]['dtype']})" for n in names[:3]) + (" ..." if len(names) > 3 else "")


class CheckpointError(ConfigError):
    """A checkpoint directory is unusable; the message names the file, the problem and the fix."""


def _read_header(path: Path) -> tuple[dict[str, dict], int]:
    """Parse one safetensors file's header; return (tensor entries, expected file size in bytes).

    Raises CheckpointError when the file is shorter than its header says, or the header is malformed.
    """
    size = path.stat().st_size
    redo = "re-download or re-create it"
    if size < 8:
        raise CheckpointError(f"{path} is truncated: {size} bytes, not even the 8-byte header length; {redo}")
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > _MAX_HEADER:
            raise CheckpointError(f"{path} is not a safetensors file (header length {n} bytes); {redo}")
        if size < 8 + n:
            raise CheckpointError(f"{path} is truncated: it lacks {8 + n - size} bytes of its {n}-byte header "
                                  f"(file has {size} bytes); {redo}")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path} has a corrupt safetensors header ({e}); {redo}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} has a corrupt safetensors header (not a JSON object); {redo}")
    header.pop("__metadata__", None)
    end = 0
    for name, e in header.items():
        try:
            begin, stop = e["data_offsets"]
            dtype = SAFETENSORS_DTYPES[e["dtype"]]
            numel = math.prod(e["shape"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed or unsupported header entry {e!r} "
                                  f"(dtypes read: {', '.join(SAFETENSORS_DTYPES)})") from None
        if stop - begin != numel * torch.empty((), dtype=dtype).element_size():
            raise CheckpointError(f"{path}: tensor {name!r} spans {stop - begin} bytes but its shape {e['shape']} "
                                  f"and dtype {e['dtype']} need {numel * torch.empty((), dtype=dtype).element_size()}")
        end = max(end, stop)
    expected = 8 + n + end
    if size < expected:
        raise CheckpointError(f"{path} is truncated: it lacks {expected - size} bytes (has {size}, its header "
                              f"says {expected}); {redo}")
    if size > expected:
        raise CheckpointError(f"{path} has {size - expected} bytes past the data its header describes "
                              f"(has {size}, expected {expected}); {redo}")
    return header, expected


def _stays_inside(name: object) -> bool:
    """Whether an index entry names a file inside the checkpoint directory (lexically: no absolute path, no
    ``..`` escape; symlinks inside the directory, as in the HF cache, are allowed)."""
    if not isinstance(name, str) or not name or "\x00" in name:
        return False
    norm = os.path.normpath(name)
    return not (os.path.isabs(norm) or norm == ".." or norm.startswith(".." + os.sep) or norm == ".")


class CheckpointReader:
    """Lazy reader of an HF checkpoint directory (``model.safetensors.index.json`` + shards, or one
    ``model.safetensors``).

    Construction validates everything that can be checked without reading tensor data: the index parses,
    every shard it names exists, every shard's header parses, its size matches the header's data length,
    and every tensor the index maps to a shard is in that shard.

    Raises:
        CheckpointError: on any of the problems above (message names the file and the fix).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path} is not a directory; pass an HF checkpoint directory")
        index = self.path / INDEX_NAME
        single = self.path / SINGLE_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                if not isinstance(weight_map, dict):
                    raise TypeError
            except (json.JSONDecodeError, KeyError, TypeError):
                raise CheckpointError(f"{index} is not a safetensors index (needs a 'weight_map' object of "
                                      "tensor name -> file); re-download or re-create it") from None
            files = sorted(set(weight_map.values()))
            outside = [f for f in files if not _stays_inside(f)]
            if outside:
                raise CheckpointError(f"{index} maps tensors to {len(outside)} file(s) outside {self.path}: "
                                      f"{', '.join(map(repr, outside[:5]))}; an index may only name files in its own "
                                      "directory (refusing to read them)")
            missing = [f for f in files if not (self.path / f).is_file()]
            if missing:
                raise CheckpointError(f"{index} names {len(missing)} shard(s) missing from {self.path}: "
                                      f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}; "
                                      "download or re-create them")
        elif single.is_file():
            weight_map, files = None, [SINGLE_NAME]
        else:
            found = sorted(p.name for p in self.path.glob("*.safetensors"))[:5]
            raise CheckpointError(f"{self.path} has neither {INDEX_NAME} nor {SINGLE_NAME}"
                                  f"{' (found ' + ', '.join(found) + ')' if found else ''}; "
                                  "it is not an HF safetensors checkpoint")
        self._entries: dict[str, dict] = {}
        self._file_of: dict[str, str] = {}
        self._file_bytes: dict[str, int] = {}
        for fname in files:
            header, size = _read_header(self.path / fname)
            self._file_bytes[fname] = size
            for name, e in header.items():
                if weight_map is None or weight_map.get(name) == fname:
                    self._entries[name] = e
                    self._file_of[name] = fname
        if weight_map is not None:
            absent = [n for n, f in weight_map.items() if n not in self._entries]
            if absent:
                raise CheckpointError(f"{index} maps {len(absent)} tensor(s) to shards that do not hold them, e.g. "
                                      f"{absent[0]!r} -> {weight_map[absent[0]]}; re-download or re-create it")

    def names(self) -> list[str]:
        """All tensor names, in file order (shard by shard, header order within one)."""
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def _entry(self, name: str) -> dict:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"{self.path} has no tensor {name!r}") from None

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of tensor ``name``. Raises KeyError for an unknown name."""
        return tuple(self._entry(name)["shape"])

    def dtype(self, name: str) -> torch.dtype:
        """Stored dtype of tensor ``name``. Raises KeyError for an unknown name."""
        return SAFETENSORS_DTYPES[self._entry(name)["dtype"]]

    def file_of(self, name: str) -> Path:
        """The shard holding tensor ``name``."""
        self._entry(name)
        return self.path / self._file_of[name]

    def total_bytes(self) -> int:
        """Bytes of tensor data in all tensors (for progress bars)."""
        return sum(e["data_offsets"][1] - e["data_offsets"][0] for e in self._entries.values())

    def check_matches(self, config: ModelConfig, *, partial: bool = False) -> list[str]:
        """Account for every tensor against ``config`` before anything loads; return the names to load.

        Each tensor is one ``config`` needs (with its HF shape; an MoE layer's experts may be per-expert or fused
        ``experts.gate_up_proj`` / ``experts.down_proj``), a known harmless one (``HARMLESS``: rotary inv_freq
        buffers, an ``lm_head.weight`` beside tied embeddings, which transformers ignores too), or reported:
        an unexpected tensor inside the network (``model.*``, ``lm_head.*``: biases the config does not enable,
        norms or experts of another architecture) means math lowlat would drop and is an error; one outside it
        (e.g. an extra head such as ``mtp.*``) is warned about, names listed once. ``partial``: ``config`` keeps
        only the first ``num_hidden_layers`` layers, so later layers' tensors are expected and skipped.
        The layer count is compared with the checkpoint's before any per-layer work (a huge count fails fast).

        Raises:
            CheckpointError: listing quantized tensors (FP8/int dtypes, scale tensors), missing tensors, shape
                mismatches and unexpected tensors, all at once.
        """
        names = self.names()
        lowp = [n for n in names if self._entries[n]["dtype"] not in _WEIGHT_DTYPES]
        scales = [n for n in names if n.endswith(_QUANT_SUFFIXES) and n not in lowp]
        if lowp or scales:
            what = []
            if lowp:
                what.append(f"{len(lowp)} tensor(s) stored in a quantized dtype, e.g. {_examples(lowp, self._entries)}")
            if scales:
                what.append(f"{len(scales)} scale/packing tensor(s), e.g. {_examples(scales, self._entries)}")
            raise CheckpointError(
                f"{self.path} is a quantized checkpoint ({'; '.join(what)}); lowlat loads unquantized "
                "bfloat16/float16/float32 weights only; use an unquantized checkpoint")
        have_layers = 1 + max((int(m.group(1)) for n in names if (m := _LAYER.match(n))), default=-1)
        if config.num_hidden_layers > have_layers:
            raise CheckpointError(f"{self.path}: config.json says num_hidden_layers={config.num_hidden_layers} but "
                                  f"the checkpoint holds tensors of {have_layers} layer(s); fix config.json")
        expected = dict(hf_tensor_shapes(config))
        for i in range(config.num_hidden_layers):
            if not config.is_moe_layer(i):
                continue
            p = f"model.layers.{i}.mlp.experts."
            e, h, inter = config.num_experts, config.hidden_size, config.moe_intermediate_size
            for fused, parts, shape in (("gate_up_proj", ("gate_proj", "up_proj"), (e, 2 * inter, h)),
                                        ("down_proj", ("down_proj",), (e, h, inter))):
                if p + fused in self._entries:
                    expected[p + fused] = shape
                    for j in range(e):
                        for part in parts:
                            expected.pop(f"{p}{j}.{part}.weight", None)
        missing = [n for n in expected if n not in self._entries]
        wrong = [f"{n} is {list(self.shape(n))}, config.json implies {list(expected[n])}"
                 for n in expected if n in self._entries and self.shape(n) != expected[n]]
        errors, extra = [], []
        for n in names:
            if n in expected or n.endswith(HARMLESS) or (n == "lm_head.weight" and config.tie_word_embeddings):
                continue
            m = _LAYER.match(n)
            if partial and m and int(m.group(1)) >= config.num_hidden_layers:
                continue
            (errors if n.startswith(("model.", "lm_head.")) else extra).append(n)
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing tensor(s), e.g. {', '.join(missing[:3])}")
        if wrong:
            parts.append(f"{len(wrong)} shape mismatch(es): {'; '.join(wrong[:3])}")
        if errors:
            parts.append(f"{len(errors)} unexpected tensor(s) that {config.architecture} with this config.json would "
                         f"not use (math lowlat would drop): {_listing(errors)}")
        if parts:
            raise CheckpointError(f"{self.path} does not match its config.json: {'; '.join(parts)}")
        if extra:
            warnings.warn(f"{self.path}: {len(extra)} checkpoint tensor(s) outside the {config.architecture} network "
                          f"are not used: {_listing(extra)}", stacklevel=2)
        return [n for n in names if n in expected]

    def iter_tensors(self, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
                     names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF name, tensor) lazily, one shard open at a time (``safetensors.safe_open``).

        ``device``: where tensors are loaded (safetensors reads straight to CUDA when given "cuda:N").
        ``dtype``: cast floating-point tensors to it (None keeps the stored dtype). ``names``: only these
        (unknown names raise KeyError before anything is read); default all, in file order.
        """
        from safetensors import safe_open

        wanted = self.names() if names is None else list(names)
        for n in wanted:
            self._entry(n)
        by_file: dict[str, list[str]] = {}
        for n in wanted:
            by_file.setdefault(self._file_of[n], []).append(n)
        dev = torch.device(device)
        dev_str = str(dev) if dev.type != "cuda" or dev.index is not None else f"cuda:{torch.cuda.current_device()}"
        for fname, file_names in by_file.items():
            with safe_open(str(self.path / fname), framework="pt", device=dev_str) as f:
                for n in file_names:
                    t = f.get_tensor(n)
                    if dtype is not None and t.is_floating_point() and t.dtype != dtype:
                        t = t.to(dtype)
                    yield n, t

    def __repr__(self) -> str:
        return f"CheckpointReader({str(self.path)!r}, {len(self._entries)} tensors, {len(self._file_bytes)} files)"


def resolve_model(model: str | os.PathLike[str]) -> ModelConfig:
    """The ModelConfig of ``model``: a directory with config.json, else a preset name.

    Raises:
        ConfigError: ``model`` is neither a directory with config.json nor a preset (the message lists them).
    """
    p = Path(model)
    if p.is_dir() and (p / "config.json").is_file():
        return ModelConfig.from_dir(p)
    if str(model) in PRESETS:
        return get_preset(str(model))
    why = "a directory without config.json" if p.is_dir() else "a file" if p.exists() else "no such path"
    close = closest_preset(str(model))
    hint = f"did you mean the preset {close!r}? " if close else ""
    raise ConfigError(f"model {str(model)!r} is neither a directory with config.json ({why}) nor one of the "
                      f"presets: {', '.join(PRESETS)}; {hint}`lowlat run` / `lowlat serve --model` also take an "
                      f"HF repo id (org/name) in the local HF cache (`hf download org/name` fetches one)")


def open_weights(model: str | os.PathLike[str], config: ModelConfig | None = None, *, seed: int = 0,
                 dtype: torch.dtype | str = torch.bfloat16, device: torch.device | str = "cpu",
                 ) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]]]:
    """(config, iterator of (HF name, tensor)) for a checkpoint directory or a preset name.

    Both kinds yield the tensors of ``hf_tensor_shapes(config)`` (a directory's MoE experts may be fused instead),
    in an unspecified order. A directory is validated before the iterator is returned (``CheckpointReader``,
    then ``check_matches``, which accounts for every tensor: known harmless ones are skipped, anything else
    unexpected is an error or a warning, never silently dropped);
    its tensors are loaded on ``device`` and cast to ``dtype`` (floating point only). A preset gives
    ``iter_synthetic_weights(config, seed=seed, dtype=dtype, device=device)``.
    ``config``: use this config instead of resolving ``model``'s (e.g. ``with_layers(preset, 2)``); for a
    directory it must describe the same model up to the number of layers (fewer layers load the first ones).

    Raises:
        ConfigError / CheckpointError: ``model`` cannot be resolved, the checkpoint is unusable, or ``config``
            does not fit it.
    """
    dt, device = as_dtype(dtype), check_device(device)
    resolved = resolve_model(model)
    cfg = config if config is not None else resolved
    p = Path(model)
    if not (p.is_dir() and (p / "config.json").is_file()):
        return cfg, iter_synthetic_weights(cfg, seed=seed, dtype=dt, device=device)
    if cfg.num_hidden_layers > resolved.num_hidden_layers or any(
            getattr(cfg, f) != getattr(resolved, f) for f in
            ("architecture", "vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
             "intermediate_size", "num_experts", "moe_intermediate_size", "tie_word_embeddings", "attention_bias",
             "mlp_bias", "rms_norm_eps", "rope_theta", "rope_scaling", "norm_topk_prob", "num_experts_per_tok",
             "decoder_sparse_step")):
        raise ConfigError(f"the config passed for {p} does not describe its checkpoint (only num_hidden_layers may "
                          f"be lower than config.json's {resolved.num_hidden_layers}); pass config=None")
    reader = CheckpointReader(p)
    keep = reader.check_matches(cfg, partial=cfg.num_hidden_layers < resolved.num_hidden_layers)
    return cfg, reader.iter_tensors(device=device, dtype=dt, names=keep)
