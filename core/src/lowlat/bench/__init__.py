"""``lowlat bench``: decode step latency against the roofline and the peers, measured side by side.

Modules: ``config`` (BenchConfig, Shape, defaults), ``timing`` (CUDA-event step timing, the copy bandwidth,
launch counts), ``roofline`` (bytes a step must read, MoE routing), ``lowlat_path`` (general path and plugins
through a ModelRunner), ``peers`` (HF transformers with a static cache and torch.compile), ``harness``
(``run_bench``: rows, ratios, files), ``report`` (markdown and console tables), ``plot`` (the PNG), ``env``
(commit, GPU, versions). The method is described in docs/benchmarks.md.
"""

from lowlat.bench.config import BenchConfig, Shape
from lowlat.bench.harness import run_bench
from lowlat.bench.report import load_results, render_markdown
from lowlat.bench.roofline import StepBytes, step_bytes

__all__ = ["BenchConfig", "Shape", "StepBytes", "load_results", "render_markdown", "run_bench", "step_bytes"]
