#!/usr/bin/env bash
# One model and one cache across the GPUs of one host (docs/design.md §10). Prepared for a multi-GPU host; not run
# yet (the machines lent so far have one GPU). For every mesh the GPUs allow:
#   1. twincache parity --mesh: each implementation split over the mesh against the float64 reference and against
#      itself on one GPU, at every decode step, by the parity rule (exit 1 when a row is out of bounds);
#   2. twincache generate --mesh for each backend: greedy tokens, which must equal the one-GPU run's;
# then 3. twincache bench --meshes: per-GPU bytes of weights and KV and decode tok/s against the mesh shape.
#
# Usage: bench/gpu_mesh.sh [MODEL_DIR] [OUT_DIR]
#   MODEL_DIR  an HF Mistral checkpoint directory (default: the embedded default model)
#   OUT_DIR    default $OUT/gpu_mesh (the device machine's output folder), else bench_out/gpu_mesh
# Writes OUT_DIR/parity_<mesh>.json, OUT_DIR/generate_<backend>_<mesh>.json, OUT_DIR/mesh.json, OUT_DIR/mesh.md and
# OUT_DIR/gpu_mesh.log. Needs torch (CUDA, NCCL), jax (CUDA), flax, transformers, safetensors; no package registry:
# it runs from the source tree. torch starts one process per GPU itself; JAX drives every GPU from one process.
set -euo pipefail
cd "$(dirname "$0")/.."
model_dir="${1:-}"
out_dir="${2:-${OUT:+$OUT/gpu_mesh}}"
out_dir="${out_dir:-bench_out/gpu_mesh}"
mkdir -p "$out_dir"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # JAX (all GPUs, rank 0's process) shares the GPUs with the torch ranks
export TWINCACHE_HOME="${TWINCACHE_HOME:-$(mktemp -d)}"
py="${PYTHON:-python3}"
model_args=()
[ -n "$model_dir" ] && model_args=(--model "$model_dir")
gpus=$("$py" -c "import torch; print(torch.cuda.device_count())")
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
meshes=(model=1)
[ "$gpus" -ge 2 ] && meshes+=(model=2 data=2)
[ "$gpus" -ge 4 ] && meshes+=(model=4 model=2,data=2)
[ "$gpus" -ge 8 ] && meshes+=(model=8 model=4,data=2 model=2,data=4)
echo "gpu_mesh.sh: $gpus GPU(s); meshes: ${meshes[*]}" | tee "$out_dir/gpu_mesh.log"
status=0
for mesh in "${meshes[@]}"; do
  name="${mesh//[=,]/_}"
  timeout 900 "$py" -m twincache_app.cli parity --mesh "$mesh" "${model_args[@]}" --dtype bfloat16 --json \
    > "$out_dir/parity_$name.json" 2>> "$out_dir/gpu_mesh.log" || status=$?
  for backend in torch jax; do
    timeout 600 "$py" -m twincache_app.cli generate --backend "$backend" --mesh "$mesh" "${model_args[@]}" \
      --dtype bfloat16 --max-new-tokens 128 --json > "$out_dir/generate_${backend}_$name.json" \
      2>> "$out_dir/gpu_mesh.log" || status=$?
  done
done
# Greedy tokens on every mesh must equal the 1-GPU run's, backend by backend.
"$py" - "$out_dir" <<'EOF' | tee -a "$out_dir/gpu_mesh.log" || status=$?
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
bad = 0
for backend in ("torch", "jax"):
    runs = {p.stem.split("_", 2)[2]: json.loads(p.read_text()) for p in sorted(out.glob(f"generate_{backend}_*.json"))
            if p.stat().st_size}
    single = runs.get("model_1")
    for mesh, run in runs.items():
        same = single is not None and run["token_ids"] == single["token_ids"]
        bad += not same
        print(f"{backend} {mesh}: {run['decode_tok_s']} tok/s, tokens {'equal to' if same else 'DIFFER from'} model=1")
sys.exit(1 if bad else 0)
EOF
timeout 1200 "$py" -m bench --preset small --meshes "${meshes[@]}" --out "$out_dir" --no-progress \
  2>&1 | tee -a "$out_dir/gpu_mesh.log" || status=$?
echo "gpu_mesh.sh: exit status $status; results in $out_dir"
exit "$status"
