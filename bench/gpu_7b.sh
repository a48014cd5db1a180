#!/usr/bin/env bash
# The 7b preset on one GPU: Mistral-7B shape, bf16, random weights built on the device (nothing written to disk),
# prompt 502, 128 new tokens, every implementation x both caches, then as much of the latency-vs-context and
# tok/s-vs-batch curves as fits. Budget: under 8 minutes in all.
#
# Usage: bench/gpu_7b.sh [OUT_DIR]     OUT_DIR defaults to $OUT/bench_7b (the device machine's output folder),
#                                      else bench_out/7b. Writes OUT_DIR/results.json (the records),
#                                      OUT_DIR/results.md, the PNG plots and OUT_DIR/bench.log.
# Needs torch (CUDA), transformers, jax (CUDA), flax, safetensors, matplotlib, psutil, tqdm; no package registry:
# it runs from the source tree.
set -euo pipefail
cd "$(dirname "$0")/.."
out_dir="${1:-${OUT:+$OUT/bench_7b}}"
out_dir="${out_dir:-bench_out/7b}"
mkdir -p "$out_dir"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # torch, transformers and JAX share the GPU in one process
export TWINCACHE_HOME="${TWINCACHE_HOME:-$(mktemp -d)}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
# The table (every impl x cache) always completes: compiles dominate it (~5 min cold for 6 impls x 2 caches).
# Curve and batch points past --deadline seconds are recorded as skipped; `timeout` is the hard stop, and every
# phase rewrites results.json, so a cut run still leaves the table.
status=0
timeout --signal=INT --kill-after=20 460 "${PYTHON:-python3}" -m bench --preset 7b --out "$out_dir" --deadline 330 --no-progress \
  2>&1 | tee "$out_dir/bench.log" || status=$?
echo "gpu_7b.sh: exit status $status; results in $out_dir/results.json and $out_dir/results.md"
exit "$status"
