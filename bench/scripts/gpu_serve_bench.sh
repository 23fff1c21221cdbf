#!/usr/bin/env bash
# One device call: `lowlat bench serve` (a lowlat serve per path, concurrent streaming users, per-user decode tok/s).
# Defaults: general vs nvidia_mega on llama-3.2-1b, 8192 prompt / 1024 new tokens, concurrency 1,2,4,8,
# REQUESTS=8 measured requests per level (about 4-5 minutes in all on an H200; raise it when the budget allows).
# The device is offline: when its image lacks the serve libraries, download their wheels on this side first
#   pip download -d .whl/serve --only-binary=:all: --python-version 3.X --platform manylinux2014_x86_64 \
#     fastapi uvicorn prometheus-client httpx jinja2
# and carry .whl/serve with the call; they are installed from there without an index.
source "$(dirname "$0")/gpu_common.sh"
if [ -d .whl/serve ]; then
  python3 -m pip install -q --no-index --find-links .whl/serve fastapi uvicorn prometheus-client httpx jinja2
fi
python3 -c "import fastapi, uvicorn, prometheus_client, httpx, jinja2" || {
  echo "=== the serve libraries are missing on the device: carry .whl/serve (see the header of $0)"; exit 3; }
timeout ${BENCH_TIMEOUT:-560} python3 -m lowlat.cli bench serve --paths ${PATHS:-general,nvidia_mega} \
  --model ${MODEL:-llama-3.2-1b} --device cuda --input-len ${INPUT_LEN:-8192} --output-len ${OUTPUT_LEN:-1024} \
  --concurrency ${CONCURRENCY:-1,2,4,8} --requests ${REQUESTS:-8} --out $OUT/bench_serve 2>&1 \
  | tee $OUT/bench_serve_log.txt | tail -40
echo "=== bench serve rc=${PIPESTATUS[0]}"
tail -30 $OUT/bench_serve/server-*.log 2>/dev/null
