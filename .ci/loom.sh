#!/usr/bin/env bash
# Every loom model in the workspace, at a bounded number of preemptions. A bounded run is
# evidence, not proof: LOOM_MAX_PREEMPTIONS=2 is the bound CI checks.
#
# Each binary runs its models one at a time (--test-threads=1). Loom's models are
# single-threaded, yet two of them side by side in one process are slower than one after
# the other on 2 cores: each execution maps and unmaps its fibres' stacks, and an unmap in
# a process whose threads run on both CPUs interrupts the other CPU to flush its TLB
# (docs/perf-2026-12-05.md has the measurements).
set -euo pipefail
export LOOM_MAX_PREEMPTIONS="${LOOM_MAX_PREEMPTIONS:-2}"
one_at_a_time=(-- --test-threads=1)
RUSTFLAGS="--cfg loom" cargo test --release --target-dir target/loom -p ivm-core --test 'loom_*' "${one_at_a_time[@]}"
RUSTFLAGS="--cfg loom" cargo test --release --target-dir target/loom -p ivm-engine --test 'loom_*' "${one_at_a_time[@]}"
RUSTFLAGS="--cfg loom" cargo test --release --target-dir target/loom -p ivm-core-loom-downstream "${one_at_a_time[@]}"
RUSTFLAGS="--cfg loom" cargo test --release --target-dir target/loom -p ivm-std --test 'loom_*' "${one_at_a_time[@]}"
