#!/usr/bin/env bash
# The checks that need an NVIDIA GPU, so that the day one is lent, one command tells the
# truth: every CUDA test (crates/ivm-device/tests/cuda.rs, its GPU tests included), every
# NCCL test (crates/ivm-ccl/tests/nccl.rs: one rank, and two under mpirun when the machine
# has two GPUs), the training demo on the GPU (`--device cuda`, which exits non-zero
# unless every mode's losses are bit-identical) and perf_report's device section on cuda.
#
# Without a GPU (nvidia-smi missing, failing, or listing no device) it says so and exits
# 0: CI calls it everywhere. The same code paths run without a GPU on the sim's launcher
# streams (`SimConfig::launcher`) in `cargo test --workspace`.
set -euo pipefail
cd "$(dirname "$0")/.."

gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
if [ "${gpus:-0}" -eq 0 ]; then
    echo "gpu.sh: no NVIDIA GPU here (nvidia-smi missing, failing or listing no device): skipping the CUDA and NCCL checks"
    exit 0
fi
nvidia-smi -L

echo "--- the cuda adapter: every test, the GPU ones included"
cargo test -p ivm-device --features cuda --test cuda -- --include-ignored

echo "--- NCCL, one rank (MPI as a singleton)"
cargo test -p ivm-ccl --features cuda --test nccl -- --include-ignored
if [ "$gpus" -ge 2 ]; then
    echo "--- NCCL, two ranks on two GPUs"
    mpirun=(mpirun --oversubscribe)
    [ "$(id -u)" -ne 0 ] || mpirun+=(--allow-run-as-root)
    # The test binary's path, from cargo itself (not a glob over stale builds).
    bin=$(cargo test -p ivm-ccl --features cuda --test nccl --no-run --message-format=json \
        | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "nccl":
        print(m["executable"])')
    timeout 300 "${mpirun[@]}" -np 2 "$bin" --include-ignored
fi

echo "--- the training demo on the GPU"
cargo run --release --example train --features cuda -- --device cuda --epochs 1 --runs 1 --quiet

echo "--- perf_report on cuda (the cpu sections, then the device section)"
cargo run --release --example perf_report --features cuda -- --device cuda
