#!/usr/bin/env bash
# A short run of every cargo-fuzz target (FUZZ_SECONDS each, default 30). The targets
# that decode programs also read their seed corpus of long programs (fuzz/seeds/<target>,
# written by `cargo run --release -p ivm-fuzz-seeds` in fuzz/) next to their working
# corpus (fuzz/corpus/<target>, which libFuzzer grows), with inputs up to FUZZ_MAX_LEN
# bytes (default 4096).
set -euo pipefail
cd fuzz
seconds="${FUZZ_SECONDS:-30}"
max_len="${FUZZ_MAX_LEN:-4096}"
targets=$(cargo +nightly fuzz list)
[ -n "$targets" ] || { echo "no fuzz targets found" >&2; exit 1; }
for t in $targets; do
    echo "--- fuzz $t (${seconds}s)"
    if [ -d "seeds/$t" ]; then
        mkdir -p "corpus/$t"
        cargo +nightly fuzz run "$t" "corpus/$t" "seeds/$t" -- \
            -max_total_time="$seconds" -rss_limit_mb=4096 -max_len="$max_len"
    else
        cargo +nightly fuzz run "$t" -- -max_total_time="$seconds" -rss_limit_mb=4096
    fi
done
