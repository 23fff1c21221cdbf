"""``lowlat make-checkpoint``: write a preset's seeded random weights as an HF checkpoint directory.

The directory (config.json, sharded safetensors with an index, tokenizer.json) loads in lowlat and in HF
transformers, so both can be compared on the same weights.
"""

from __future__ import annotations

import argparse
import sys

from lowlat.config import DTYPES, ConfigError, dtype_name
from lowlat.loader.presets import PRESETS, get_preset, with_layers
from lowlat.loader.synthetic import DEFAULT_MAX_SHARD_BYTES, synthetic_num_bytes, write_checkpoint


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``make-checkpoint`` subcommand to ``subparsers``; it sets ``func=run``."""
    p = subparsers.add_parser(
        "make-checkpoint",
        help="write a preset's seeded random weights as an HF checkpoint directory",
        description="Write a preset's seeded random weights as an HF checkpoint directory (config.json, "
                    "sharded *.safetensors + index, tokenizer.json). Presets: " + ", ".join(PRESETS),
    )
    p.add_argument("--preset", required=True, metavar="NAME", help="preset name: " + ", ".join(PRESETS))
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (created if missing)")
    p.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    p.add_argument("--dtype", type=dtype_name, choices=list(DTYPES), default="bfloat16",
                   help="stored dtype (default bfloat16; aliases bf16, fp16, half, fp32, float)")
    p.add_argument("--layers", type=int, metavar="N", help="keep only the first N decoder layers")
    p.add_argument("--max-shard-gb", type=float, default=DEFAULT_MAX_SHARD_BYTES / 1e9, metavar="GB",
                   help="largest shard file in GB (default %(default)s)")
    p.add_argument("--device", default="cpu",
                   help="device that generates the weights, e.g. cuda (faster; values differ from cpu's)")
    p.add_argument("--force", action="store_true", help="overwrite checkpoint files already in --out")
    p.set_defaults(func=run)
    return p


def human_size(nbytes: int) -> str:
    """``nbytes`` in decimal units as ``--max-shard-gb`` counts them: "512 bytes", "1.5 KB", "64.0 MB", "2.47 GB"."""
    if nbytes < 1000:
        return f"{nbytes} bytes"
    for unit, scale in (("KB", 1e3), ("MB", 1e6)):
        if round(nbytes / scale, 1) < 1000:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes / 1e9:.2f} GB"


def run(args: argparse.Namespace) -> int:
    """Write the checkpoint; print where and how big. Returns 0, or 2 after printing an error to stderr."""
    try:
        config = get_preset(args.preset)
        if args.layers is not None:
            config = with_layers(config, args.layers)
        out = write_checkpoint(config, args.out, seed=args.seed, dtype=args.dtype,
                               max_shard_bytes=max(1, int(args.max_shard_gb * 1e9)), device=args.device,
                               overwrite=args.force)
    except (ConfigError, OSError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    size = synthetic_num_bytes(config, args.dtype)
    print(f"wrote {args.preset} ({config.num_hidden_layers} layers, {args.dtype}, seed {args.seed}, "
          f"{human_size(size)}) to {out}")
    return 0
