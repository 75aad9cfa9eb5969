#!/usr/bin/env bash
# Every loom model in the workspace, at a bounded number of preemptions. A bounded run is
# evidence, not proof: LOOM_MAX_PREEMPTIONS=2 is the bound CI checks.
set -euo pipefail
export LOOM_MAX_PREEMPTIONS="${LOOM_MAX_PREEMPTIONS:-2}"
RUSTFLAGS="--cfg loom" cargo test --release --target-dir target/loom -p ivm-core --test 'loom_*'
RUSTFLAGS="--cfg loom" cargo test --release --target-dir target/loom -p ivm-engine --test 'loom_*'
RUSTFLAGS="--cfg loom" cargo test --release --target-dir target/loom -p ivm-core-loom-downstream
RUSTFLAGS="--cfg loom" cargo test --release --target-dir target/loom -p ivm-std --test 'loom_*'
