#!/usr/bin/env bash
# One device call: install the working tree, run the GPU-only core tests, and decode real presets.
source "$(dirname "$0")/gpu_common.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 240 python3 -m pytest -q -x core/tests/test_runtime_cuda_graph.py core/tests/test_decode_attention.py 2>&1 | tail -15
for m in llama-3.2-1b qwen3-30b-a3b; do
  timeout 240 python3 -m lowlat.cli run --model $m --device cuda --plugin none --max-new-tokens 64 --max-context-len 2048 \
    --prompt "a" --prompt "b" --prompt "c" --prompt "d" 2>&1 | tail -12
done
