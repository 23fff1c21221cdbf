#!/usr/bin/env bash
# One device call: sweep nvidia_mega's GEMM / QKV launch plans (tune_plans.py) and re-time its kernels.
source "$(dirname "$0")/gpu_common.sh"
step "tune plans" ${TUNE_S:-330} python3 vendors/nvidia_mega/tune_plans.py --models ${MODELS:-llama-3.2-1b,qwen3-30b-a3b} \
  --rows ${ROWS:-1} --json $OUT/tune.json 2>&1 | tee $OUT/tune.txt | grep -v rejected
step "bench kernels" ${KERN_S:-150} python3 vendors/nvidia_mega/bench_kernels.py --models llama-3.2-1b --rows 1 2>&1 \
  | tee $OUT/bench_kernels.txt | tail -25
