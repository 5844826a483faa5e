#!/usr/bin/env bash
# The GPU checks, as one script for a lent device machine (see docs/gpu.md):
#   run from the repository root there, with the wheels of casnap's dependencies in
#   .device-wheels/ (pip download them here; the device image has torch and pytest only).
# Writes its results under $OUT (default: a temp dir) and prints them. GIBS="2 8": the
# state sizes of benchmarks/gpu_take.py (GiB).
set -u
OUT="${OUT:-$(mktemp -d)}"
W="$(mktemp -d)"
trap 'rm -rf "$W"' EXIT
python -V
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
python -m pip install -q --break-system-packages --root-user-action=ignore --no-index --find-links .device-wheels blake3 lmdb zstandard pydantic fsspec rich \
    2>&1 | tail -8
nproc; free -g | head -2; df -h "$W" | tail -1
# The CUDA paths of the staging code, and the GPU round trips of the rest of the suite.
python -m pytest -q -p no:cacheprovider -o addopts="" tests/test_staging_gpu_path.py \
    tests/test_distributed_cuda.py \
    2>&1 | tail -15 | tee "$OUT/pytest.txt"
n=0
for gib in ${GIBS:-2 8}; do
    n=$((n + 1))  # a size named twice (GIBS="2 2") keeps both runs' results
    timeout 200 python benchmarks/gpu_take.py --gib "$gib" --repeat 3 --dir "$W" \
        | tee "$OUT/gpu_take_${n}_${gib}g.json"
done
