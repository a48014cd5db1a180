#!/usr/bin/env bash
# The 7b preset on one GPU: Mistral-7B shape, bf16, random weights built on the device (nothing written to disk),
# prompt 502, 128 new tokens, every implementation x both caches, then as much of the latency-vs-context and
# tok/s-vs-batch curves as fits. Budget: under 8 minutes in all (bench/gpu_lease.sh runs it in less).
#
# Usage: bench/gpu_7b.sh [OUT_DIR [BENCH_ARGS...]]
#   OUT_DIR defaults to $OUT/bench_7b (the device machine's output folder), else bench_out/7b. Writes
#   OUT_DIR/results.json (the records), OUT_DIR/results.md, the PNG plots and OUT_DIR/bench.log.
#   BENCH_ARGS go to `python -m bench` after the preset's (the last of a repeated option wins: --impls, --preset...).
#   BENCH_TIMEOUT_S (default 460): the hard stop; BENCH_DEADLINE_S (default 330): after it no warm-up (compile),
#   curve or batch point starts.
# Needs torch (CUDA), transformers, jax (CUDA), flax, safetensors, matplotlib, psutil, tqdm; no package registry:
# it runs from the source tree.
set -euo pipefail
cd "$(dirname "$0")/.."
out_dir="${1:-${OUT:+$OUT/bench_7b}}"
out_dir="${out_dir:-bench_out/7b}"
shift $(($# > 0 ? 1 : 0))
mkdir -p "$out_dir"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Unbuffered: a cell's failure line (tqdm.write, no flush) reaches bench.log and the reply's tail even when the hard
# stop ends in SIGKILL (a compile that holds off SIGINT past --kill-after), which drops a buffer's contents.
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # torch, transformers and JAX share the GPU in one process
export TWINCACHE_HOME="${TWINCACHE_HOME:-$(mktemp -d)}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
# The table's warm-ups (compiles) run in the preset's order until the deadline; every cell warmed up is timed. Curve
# and batch points past the deadline are recorded as skipped; `timeout` is the hard stop (SIGINT: the run saves what
# it measured), and every phase rewrites results.json, so a cut run still leaves the table.
status=0
timeout --signal=INT --kill-after=20 "${BENCH_TIMEOUT_S:-460}" "${PYTHON:-python3}" -m bench --preset 7b \
  --out "$out_dir" --deadline "${BENCH_DEADLINE_S:-330}" --no-progress "$@" 2>&1 | tee "$out_dir/bench.log" \
  || status=$?
echo "gpu_7b.sh: exit status $status; results in $out_dir/results.json and $out_dir/results.md"
exit "$status"
