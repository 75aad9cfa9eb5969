#!/usr/bin/env bash
# Miri over every ivm-core unit test (intrusive pointers are where unsoundness hides).
set -euo pipefail
MIRIFLAGS="-Zmiri-strict-provenance -Zmiri-symbolic-alignment-check" \
    cargo +nightly miri test -p ivm-core
