#!/usr/bin/env bash
# Every loom model in the workspace, at a bounded number of preemptions. A bounded run is
# evidence, not proof: LOOM_MAX_PREEMPTIONS=2 is the bound CI checks.
#
# Each binary runs its models one at a time (--test-threads=1). Loom's models are
# single-threaded, yet two of them side by side in one process are slower than one after
# the other on 2 cores. Measured alternately on 2026-12-04: loom_wake_path 254 s with one
# test thread, 357 s with two, 271 s with one, 377 s with two; the second pair ran every
# ivm-std model (309 s in all with one thread, 442 s with two; system time 169 s against
# 508 s). Why: each execution maps and unmaps its fibres' stacks, and an unmap in a process
# whose threads run on both CPUs interrupts the other CPU to flush its TLB. Measured on
# loom_caller_runs (the "TLB" row of /proc/interrupts before and after): one test thread
# 37 s, sys 24 s, 8 shootdowns; two test threads 65 s, sys 80 s, 1 280 002 shootdowns.
set -euo pipefail
export LOOM_MAX_PREEMPTIONS="${LOOM_MAX_PREEMPTIONS:-2}"
one_at_a_time=(-- --test-threads=1)
RUSTFLAGS="--cfg loom" cargo test --release --target-dir target/loom -p ivm-core --test 'loom_*' "${one_at_a_time[@]}"
RUSTFLAGS="--cfg loom" cargo test --release --target-dir target/loom -p ivm-engine --test 'loom_*' "${one_at_a_time[@]}"
RUSTFLAGS="--cfg loom" cargo test --release --target-dir target/loom -p ivm-core-loom-downstream "${one_at_a_time[@]}"
RUSTFLAGS="--cfg loom" cargo test --release --target-dir target/loom -p ivm-std --test 'loom_*' "${one_at_a_time[@]}"
