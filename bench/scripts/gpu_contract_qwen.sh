#!/usr/bin/env bash
# One device call: the contract suite on CUDA for both vendors at the real Qwen3 presets (qwen3-8b, qwen3-30b-a3b),
# every architecture's tiny preset included; llama-3.2-1b ran in gpu_release_check.sh / gpu_amd_defaults.sh.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 -m pip install -q --no-deps --no-build-isolation -e core -e vendors/nvidia_mega -e vendors/amd_mono -e contract_tests 2>&1 | grep -v "Running pip"
step() { echo "=== $1"; shift; timeout "$@"; echo "=== rc=$?"; }
for p in nvidia_mega amd_mono; do
  step "contract $p on cuda, qwen3 presets" ${CONTRACT_S:-270} python3 -m pytest -q -p no:cacheprovider --pyargs lowlat_contract \
    --lowlat-plugin $p --lowlat-device cuda --lowlat-model qwen3-8b --lowlat-model qwen3-30b-a3b > $OUT/contract_${p}_qwen.txt 2>&1
  grep -E "^=== |passed|failed|^performance|Error" $OUT/contract_${p}_qwen.txt | cut -c1-300
done
