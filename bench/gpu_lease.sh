#!/usr/bin/env bash
# Everything a GPU lease runs, as one prepared call that ends within SECONDS (default 360): bench/gpu_7b.sh, then
# parity_tests/gpu_check.sh, each under a hard stop and a deadline after which it starts nothing new, so that the
# call always returns measurements. A lease is 15 minutes of device time in all, the machine's start included (a
# minute or more): 6 minutes leaves room to run it a second time.
#
# Usage: bench/gpu_lease.sh [SECONDS]         e.g. through the device tool:
#          run(command="bash bench/gpu_lease.sh 360", timeout_s=420)
#   Writes under $OUT (else ./gpu_lease_out), within what a device call brings back (at most 8 files, 2 folders
#   down): bench_7b/{results.json,results.md,bench.log,*.png} and parity/{gpu_parity.md,gpu_parity.json}; prints the
#   decode table and the parity verdict last. GPU_LEASE_SMOKE=1 runs the same steps at tiny shapes on CPU (the test
#   suite does, in seconds).
set -uo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-360}"
if ! [[ "$seconds" =~ ^[0-9]+$ ]] || ((seconds < 120)); then
  echo "gpu_lease.sh: SECONDS must be a whole number of seconds, at least 120 (got '$seconds'); default 360" >&2
  exit 2
fi
out="${OUT:-gpu_lease_out}"
start=$SECONDS
bench_args=()
parity_args=()
if [[ "${GPU_LEASE_SMOKE:-0}" == 1 ]]; then
  bench_args=(--preset tiny --impls transformers_eager,torch_eager --caches static --no-curves --no-batch --repeats 1)
  parity_args=(--smoke)
fi
# The bench gets just over half (its table's compiles dominate; it starts no warm-up in its last 70 s, which its
# timed rounds and closing probe need); the parity gets whatever is left, starting no 7B case in its last 70 s.
# Each `timeout` may add 20 s of grace (--kill-after) to its share.
bench_s=$((seconds * 55 / 100 - 20))
BENCH_TIMEOUT_S=$bench_s BENCH_DEADLINE_S=$((bench_s > 140 ? bench_s - 70 : bench_s / 2)) \
  bash bench/gpu_7b.sh "$out/bench_7b" ${bench_args[@]+"${bench_args[@]}"}
bench_status=$?
parity_s=$((seconds - (SECONDS - start) - 25))
parity_s=$((parity_s > 30 ? parity_s : 30))
PARITY_TIMEOUT_S=$parity_s bash parity_tests/gpu_check.sh "$out/parity" \
  --deadline $((parity_s > 140 ? parity_s - 70 : parity_s / 2)) ${parity_args[@]+"${parity_args[@]}"}
parity_status=$?
echo
echo "== gpu_lease.sh: $((SECONDS - start)) s of $seconds; bench exit $bench_status, parity exit $parity_status =="
# The call's reply carries the end of the output: the decode table and the parity verdict go last, after the
# warnings of a run that is slow without failing (else only in bench.log): a step inductor left out of CUDA graphs
# (docs/design.md §7.38), a JAX cache buffer XLA could not update in place (a copy per call).
grep -i -E -m 4 'skipping cudagraphs|donated buffers were not usable' "$out/bench_7b/bench.log" 2>/dev/null \
  | cut -c1-200
sed -n '/^## Decode, batch 1/,/^Bytes a decode step/p' "$out/bench_7b/results.md" 2>/dev/null | cut -c1-200
grep -E '^## |^(PASS|FAIL)' "$out/parity/gpu_parity.md" 2>/dev/null
exit $((bench_status != 0 || parity_status != 0))
