#!/usr/bin/env bash
# A short run of every cargo-fuzz target (FUZZ_SECONDS each, default 30).
set -euo pipefail
cd fuzz
seconds="${FUZZ_SECONDS:-30}"
targets=$(cargo +nightly fuzz list)
[ -n "$targets" ] || { echo "no fuzz targets found" >&2; exit 1; }
for t in $targets; do
    echo "--- fuzz $t (${seconds}s)"
    cargo +nightly fuzz run "$t" -- -max_total_time="$seconds" -rss_limit_mb=4096
done
