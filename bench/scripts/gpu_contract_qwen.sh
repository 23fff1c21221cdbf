#!/usr/bin/env bash
# One device call: the contract suite on CUDA for both vendors at the real Qwen3 presets (qwen3-8b, qwen3-30b-a3b),
# every architecture's tiny preset included (llama-3.2-1b ran in gpu_release_check.sh / gpu_amd_defaults.sh), then
# nvidia_mega's 256-token greedy compare on llama-3.2-1b.
source "$(dirname "$0")/gpu_common.sh"
for p in nvidia_mega amd_mono; do
  step "contract $p on cuda, qwen3 presets" ${CONTRACT_S:-200} python3 -m pytest -q -p no:cacheprovider --pyargs lowlat_contract \
    --lowlat-plugin $p --lowlat-device cuda --lowlat-model qwen3-8b --lowlat-model qwen3-30b-a3b > $OUT/contract_${p}_qwen.txt 2>&1
  grep -E "^=== |passed|failed|^performance.*(8b|30b)" $OUT/contract_${p}_qwen.txt | cut -c1-300
done
step "compare nvidia_mega llama-3.2-1b" 100 python3 -m lowlat.cli run --compare --plugin nvidia_mega --model llama-3.2-1b \
  --device cuda --dtype bfloat16 --max-new-tokens 256 --max-context-len 1024 --prompt "The capital of France" \
  > $OUT/compare_mega_llama-3.2-1b.txt 2>&1
tail -7 $OUT/compare_mega_llama-3.2-1b.txt
