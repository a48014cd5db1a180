#!/usr/bin/env bash
# GPU parity at Mistral-7B shape (bf16) and on a smaller fp32 shape, with window wraps; < 8 minutes on one H200
# (bench/gpu_lease.sh runs it in less, with a deadline).
# Usage: parity_tests/gpu_check.sh [OUT [GPU_PARITY_ARGS...]]
#   Writes gpu_parity.md and gpu_parity.json to OUT, else $OUT, else ./gpu_parity_out. GPU_PARITY_ARGS go to
#   `python -m parity_tests.gpu_parity` (--deadline S: no case starts after S seconds; --smoke: one tiny case, CPU).
#   PARITY_TIMEOUT_S (default 470): the hard stop. Needs torch (CUDA), jax (CUDA), flax, transformers, safetensors and
#   tokenizers, e.g. the GPU machine's stack:  PYTHONPATH=. bash parity_tests/gpu_check.sh /tmp/out
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu_parity_out}}"
shift $(($# > 0 ? 1 : 0))
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # JAX shares the GPU with torch, which holds the weights
py="${PYTHON:-python3}"  # the GPU machine's image has python3 (the one holding torch); `python` may not exist
# The versions and devices, for the log: bounded and not fatal (a JAX start that hangs would otherwise hold the lease's
# call to its limit, and one that fails would stop the script before parity says what failed)
timeout --kill-after=5 60 "$py" -c "import torch, jax; print('torch', torch.__version__, torch.cuda.get_device_name() \
if torch.cuda.is_available() else 'no CUDA device', '| jax', jax.__version__, jax.devices())" \
  || echo "gpu_check: the version check failed or hung (exit $?); running parity anyway"
timeout --kill-after=20 "${PARITY_TIMEOUT_S:-470}" "$py" -m parity_tests.gpu_parity "$out" "$@"
