"""The ground types of the GPU jobs (bench/gpu_jobs.py): a Step, the Options, the shared commands.

Stdlib only: it runs on the device image as it is.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
CONTRACT = [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs", "lowlat_contract"]
LOWLAT = [PY, "-m", "lowlat.cli"]
STANDARD_BENCH = ["--batch-sizes", "1,2,4,8", "--modes", "decode,verify", "--verify-tokens", "6", "--context",
                  "1024", "--input-sets", "2", "--warmup", "5", "--iters", "50"]
PASS_FAIL = r"^=+ .*(passed|failed|error)|^(FAILED|ERROR) "


@dataclass(frozen=True)
class Step:
    """One command: ``argv`` under ``timeout_s`` seconds, output to ``out``; lines matching ``show`` are echoed."""

    name: str
    timeout_s: float
    argv: list[str]
    out: str
    show: str = PASS_FAIL
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Options:
    models: list[str]
    plugins: list[str]
    scale: float


def slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", s).strip("_")


