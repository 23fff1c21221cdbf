"""Checkpoints and presets: read HF safetensors directories, make seeded random weights, tokenize.

Entry points: ``open_weights(model, ...)`` (a directory or a preset name -> config and tensors),
``resolve_model``, ``CheckpointReader``, ``write_checkpoint``, ``get_preset`` / ``with_layers``,
``load_tokenizer``.
"""

from lowlat.loader.checkpoint import CheckpointError, CheckpointReader, open_weights, resolve_model
from lowlat.loader.presets import PRESETS, get_preset, with_layers
from lowlat.loader.synthetic import (
    hf_tensor_shapes,
    iter_synthetic_weights,
    synthetic_num_bytes,
    synthetic_tensor,
    write_checkpoint,
)
from lowlat.loader.tokenizer import TokenizerWrapper, load_tokenizer, make_byte_tokenizer

__all__ = [
    "PRESETS",
    "CheckpointError",
    "CheckpointReader",
    "TokenizerWrapper",
    "get_preset",
    "hf_tensor_shapes",
    "iter_synthetic_weights",
    "load_tokenizer",
    "make_byte_tokenizer",
    "open_weights",
    "resolve_model",
    "synthetic_num_bytes",
    "synthetic_tensor",
    "with_layers",
    "write_checkpoint",
]
