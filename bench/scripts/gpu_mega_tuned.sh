#!/usr/bin/env bash
# One device call: nvidia_mega with tuned plans: GPU tests, kernel/layer bench,
# an 8-row plan sweep, and the 256-token greedy compare on qwen3-30b-a3b.
source "$(dirname "$0")/gpu_common.sh"
step "mega tests on GPU" 90 python3 -m pytest -q -x vendors/nvidia_mega/tests 2>&1 | tail -4
step "bench kernels" 200 python3 vendors/nvidia_mega/bench_kernels.py 2>&1 | tee $OUT/bench_kernels.txt | grep -v "^$" | tail -80
step "tune 8 rows" 90 python3 vendors/nvidia_mega/tune_plans.py --models llama-3.2-1b --rows 8 --json $OUT/tune_8rows.json \
  2>&1 | tee $OUT/tune_8rows.txt | grep -v rejected
step "compare qwen3-moe" 170 python3 -m lowlat.cli run --compare --plugin nvidia_mega --model qwen3-30b-a3b --device cuda \
  --dtype bfloat16 --max-new-tokens 256 --max-context-len 1024 --prompt "The capital of France" 2>&1 | tee $OUT/compare_qwen.txt | tail -14
