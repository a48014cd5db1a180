#!/usr/bin/env bash
# GPU parity at Mistral-7B shape (bf16) and on a smaller fp32 shape, with window wraps; < 8 minutes on one H200.
# Writes gpu_parity.md and gpu_parity.json to $1, else $OUT, else ./gpu_parity_out. Run from the repository root;
# needs torch (CUDA), jax (CUDA), flax, transformers, safetensors and tokenizers, e.g. the GPU machine's stack:
#   PYTHONPATH=. bash parity_tests/gpu_check.sh /tmp/out
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu_parity_out}}"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # JAX shares the GPU with torch, which holds the weights
py="${PYTHON:-python3}"  # the GPU machine's image has python3 (the one holding torch); `python` may not exist
"$py" -c "import torch, jax; print('torch', torch.__version__, torch.cuda.get_device_name(), '| jax', jax.__version__, jax.devices())"
timeout 470 "$py" -m parity_tests.gpu_parity "$out"
