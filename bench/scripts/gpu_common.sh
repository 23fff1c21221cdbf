# Sourced by the gpu_*.sh device scripts: strict mode, unbuffered output, NCCL without NVLink multicast (the
# device notes), $OUT, the four packages installed editable without dependencies (the image has them), and
# `step NAME SECONDS CMD...`: CMD under a time limit, between "=== NAME" and "=== rc=N" lines.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e core -e vendors/nvidia_mega -e vendors/amd_mono \
  -e contract_tests 2>&1 | grep -v "Running pip"
step() { echo "=== $1"; shift; timeout "$@"; echo "=== rc=$?"; }
