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
# in the VM or its dependencies casts an integer to a pointer.
#
# Miri interprets on one thread, so the five invocations run in two lanes, one per core,
# balanced by their times (the unit tests in the first, the two reduced VM runs in the
# second). The second lane has a target directory of its own, so that the lanes never wait
# for each other's build lock; its output is printed when it ends, and either lane failing
# fails the script (.ci/lanes.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
source .ci/lanes.sh
export MIRIFLAGS="-Zmiri-strict-provenance -Zmiri-symbolic-alignment-check"
unit_tests() {
    cargo +nightly miri test -p ivm-core || return
    cargo +nightly miri test -p ivm-engine --all-features || return
    cargo +nightly miri test -p ivm-std --lib
}
reduced_vm_runs() {
    cargo +nightly miri test --target-dir target/miri-lane2 -p ivm-std --test miri_vm || return
    cargo +nightly miri test --target-dir target/miri-lane2 -p ivm-graph --test miri_graph
}
two_lanes "ivm-std tests/miri_vm.rs, ivm-graph tests/miri_graph.rs" unit_tests reduced_vm_runs
