#!/usr/bin/env bash
# One device call: speculative decoding on the GPU. Greedy identity (CUDA graphs on, general path and
# nvidia_mega, ngram and a self-draft), then the cost of speculation with simulated acceptance (mean acceptance
# length 3.51, k = 5: six verified rows per step, as the reference design) against plain decoding, batch 1.
source "$(dirname "$0")/gpu_common.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
step identity 420 python3 bench/scripts/spec_identity.py --model llama-3.2-1b --device cuda --paths none,nvidia_mega
for plugin in none nvidia_mega; do
  step "plain $plugin" 240 python3 -m lowlat.cli run --model llama-3.2-1b --device cuda --dtype bfloat16 \
    --plugin $plugin --max-new-tokens 256 --max-context-len 2048 --prompt a 2>&1 | tail -14
  step "simulated $plugin" 240 python3 -m lowlat.cli run --model llama-3.2-1b --device cuda --dtype bfloat16 \
    --plugin $plugin --max-new-tokens 256 --max-context-len 2048 --prompt a --speculative simulated:3.51 \
    --num-draft-tokens 5 --no-spec-adaptive 2>&1 | tail -18
done
