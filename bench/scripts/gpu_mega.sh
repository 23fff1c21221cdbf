#!/usr/bin/env bash
# One device call: nvidia_mega kernels and plugin on the H200 (tests, kernel benches, greedy compare).
source "$(dirname "$0")/gpu_common.sh"
if [ "${1:-a}" = a ]; then
step "core GPU tests" 60 python3 -m pytest -q -x core/tests/test_runtime_cuda_graph.py core/tests/test_decode_attention.py 2>&1 | tail -5
step "mega tests on GPU" 120 python3 -m pytest -q -x vendors/nvidia_mega/tests 2>&1 | tail -15
step "compare llama" 120 python3 -m lowlat.cli run --compare --plugin nvidia_mega --model llama-3.2-1b --device cuda --dtype bfloat16 --max-new-tokens 256 --prompt "The capital of France" 2>&1 | tail -12
step "compare qwen3-moe" 180 python3 -m lowlat.cli run --compare --plugin nvidia_mega --model qwen3-30b-a3b --device cuda --dtype bfloat16 --max-new-tokens 256 --max-context-len 1024 --prompt "The capital of France" 2>&1 | tail -12
else
step "bench moe/head" 150 python3 vendors/nvidia_mega/bench_moe_head.py 2>&1 | tee $OUT/bench_moe_head.txt | tail -30
step "bench kernels" 170 python3 vendors/nvidia_mega/bench_kernels.py 2>&1 | tee $OUT/bench_kernels.txt | tail -60
fi
