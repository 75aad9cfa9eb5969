#!/usr/bin/env bash
# Miri over every ivm-core unit test (intrusive pointers are where unsoundness hides) and
# every ivm-engine unit test with all its features (the pools, the index lists, the
# Dependence cells, the equivalence check and its planted bugs).
set -euo pipefail
export MIRIFLAGS="-Zmiri-strict-provenance -Zmiri-symbolic-alignment-check"
cargo +nightly miri test -p ivm-core
cargo +nightly miri test -p ivm-engine --all-features
