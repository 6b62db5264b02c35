#!/usr/bin/env bash
# GPU evidence for the cuda target, run on the H200 machine:
#   source .gac-device/bootstrap.sh && bash benchmarks/gpu_suite.sh tests|bench
# `tests`: every cuda-marked test under tests/ (pytest -m cuda: op parity, OpInfo, ONNX, dynamic
#          shapes, models, fusion, pipeline, BEVFormer test configs), log in $OUT/pytest.log;
# `bench`: the eager / Inductor / gac baseline. Logs and a summary go to $OUT (default /tmp/gac-out).
set -uo pipefail
out=${OUT:-/tmp/gac-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$out/gpu.txt" 2>&1
case "${1:-tests}" in
  tests)
    python3 -m pytest -q -m cuda -rs -p no:cacheprovider --junitxml="$out/junit.xml" tests/ \
      2>&1 | tee "$out/pytest.log"
    status=${PIPESTATUS[0]}
    ;;
  bench)
    python3 benchmarks/bench_baseline.py --out "$out/baseline.md" 2>&1 | tee "$out/bench.log"
    status=${PIPESTATUS[0]}
    ;;
  *)
    echo "usage: $0 tests|bench" >&2
    exit 2
    ;;
esac
exit "$status"
