#!/usr/bin/env bash
# One device call: validate the GPU path after host-path changes (graphs, plugin compare, amd_mono GPU tests).
source "$(dirname "$0")/gpu_common.sh"
step "core GPU tests" 90 python3 -m pytest -q core/tests/test_runtime_cuda_graph.py core/tests/test_decode_attention.py core/tests/test_host_inputs.py 2>&1 | tail -4
step "compare llama nvidia_mega" 100 python3 -m lowlat.cli run --compare --plugin nvidia_mega --model llama-3.2-1b --device cuda --dtype bfloat16 --max-new-tokens 128 --prompt "The capital of France" 2>&1 | tee $OUT/compare_llama.txt | tail -8
step "run llama nvidia_mega b4" 60 python3 -m lowlat.cli run --plugin nvidia_mega --model llama-3.2-1b --device cuda --dtype bfloat16 --max-new-tokens 64 --prompt a --prompt b --prompt c --prompt d 2>&1 | tee $OUT/run_llama_b4.txt | tail -9
step "amd_mono GPU tests" 150 python3 -m pytest -q vendors/amd_mono/tests/test_gpu.py 2>&1 | tee $OUT/amd_gpu_tests.txt | tail -6
