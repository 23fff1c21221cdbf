"""Test-wide setup: on a machine without CUDA, Triton kernels run under the interpreter.

TRITON_INTERPRET must be set before the first ``import triton`` (triton.language builds its helpers at
import), so it is set here, before any test module is collected.
"""

import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).parent))  # plugin_dists helpers
