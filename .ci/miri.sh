#!/usr/bin/env bash
# Miri over every ivm-core unit test (intrusive pointers are where unsoundness hides),
# every ivm-engine unit test with all its features (the pools, the index lists, the
# Dependence cells, the equivalence check and its planted bugs), ivm-std's VM layer:
# every unit test of the lib (the engine wrapper, the instruction pool and ownership
# steps, the lazy door's buffers and records, smallfn, the futex) and the reduced VM run
# of tests/miri_vm.rs (both modes, two streams, the sync-access ring, a kernel panic, the
# express lane's raw-pointer copies),
# and ivm-graph's reduced lazy run, tests/miri_graph.rs (the lazy door and the graph
# runtime's actors and register slots, both modes). Strict provenance everywhere: nothing
# in the VM or its dependencies casts an integer to a pointer. On 2 cores the ivm-std
# part takes about 3 minutes (each of its two test binaries runs in about a minute).
set -euo pipefail
export MIRIFLAGS="-Zmiri-strict-provenance -Zmiri-symbolic-alignment-check"
cargo +nightly miri test -p ivm-core
cargo +nightly miri test -p ivm-engine --all-features
cargo +nightly miri test -p ivm-std --lib
cargo +nightly miri test -p ivm-std --test miri_vm
cargo +nightly miri test -p ivm-graph --test miri_graph
