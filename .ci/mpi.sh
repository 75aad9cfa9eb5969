#!/usr/bin/env bash
# ivm-ccl over MPI (Open MPI from Debian, installed by .ci/install.sh): the collective
# scenarios of crates/ivm-ccl/tests/scenarios under mpirun with 2 ranks and with 3 (an odd
# count), then the training demo's data-parallel run on 2 ranks as the README gives it (its
# defaults: 150 epochs, about a second of training per rank), which exits non-zero unless
# both ranks' losses and final weights are bit-identical to each other and to the
# single-process run's.
set -euo pipefail
cd "$(dirname "$0")/.."

mpirun=(mpirun --oversubscribe)
[ "$(id -u)" -ne 0 ] || mpirun+=(--allow-run-as-root)

cargo clippy -p ivm-ccl --features mpi --all-targets -- -D warnings
cargo clippy --example train --features mpi -- -D warnings
# The test binary's path, from cargo itself (not a glob over stale builds).
bin=$(cargo test -p ivm-ccl --features mpi --test mpi_collectives --no-run --message-format=json \
    | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "mpi_collectives":
        print(m["executable"])')
echo "mpi_collectives: $bin"
for np in 2 3; do
    echo "--- $np ranks"
    timeout 300 "${mpirun[@]}" -np "$np" "$bin"
done

if grep -q -- "--data-parallel" examples/train/main.rs; then
    echo "--- training demo, 2 ranks, data parallel"
    cargo build --release --example train --features mpi
    timeout 600 "${mpirun[@]}" -np 2 target/release/examples/train --data-parallel
fi
