#!/usr/bin/env bash
# A short run of every cargo-fuzz target (FUZZ_SECONDS each, default 30). The targets
# that decode programs also read their seed corpus of long programs (fuzz/seeds/<target>,
# written by `cargo run --release -p ivm-fuzz-seeds` in fuzz/) next to their working
# corpus (fuzz/corpus/<target>, which libFuzzer grows), with inputs up to FUZZ_MAX_LEN
# bytes (default 4096). The VM targets read IVM_FUSION (`fuzzing::ci_lane`): vm_program
# and vm_faults fuzz with fusion on, vm_program_sim with the default (off), so that both
# paths are fuzzed in every run (the engine target picks fusion per input itself).
#
# Every target is built first, then the targets run in two lanes of their own (every other
# target in the list goes to the second lane), so that the half of them that fuzz on one
# thread (the engine, the list, most of the queue's ops) do not leave a core idle. Each
# target still fuzzes for FUZZ_SECONDS; the second lane's output is printed when it ends,
# and a crash in either lane fails the script (.ci/lanes.sh). The price: a VM target
# beside another runs fewer inputs than alone (docs/perf-2026-12-05.md has the figures).
set -euo pipefail
cd "$(dirname "$0")/.."
source .ci/lanes.sh
cd fuzz
seconds="${FUZZ_SECONDS:-30}"
max_len="${FUZZ_MAX_LEN:-4096}"
targets=$(cargo +nightly fuzz list)
[ -n "$targets" ] || { echo "no fuzz targets found" >&2; exit 1; }

fuzz_one() {
    local t=$1 fusion=0
    case $t in vm_program | vm_faults) fusion=1 ;; esac
    echo "--- fuzz $t (${seconds}s, IVM_FUSION=$fusion)"
    if [ -d "seeds/$t" ]; then
        mkdir -p "corpus/$t"
        IVM_FUSION=$fusion cargo +nightly fuzz run "$t" "corpus/$t" "seeds/$t" -- \
            -max_total_time="$seconds" -rss_limit_mb=4096 -max_len="$max_len"
    else
        IVM_FUSION=$fusion cargo +nightly fuzz run "$t" -- -max_total_time="$seconds" -rss_limit_mb=4096
    fi
}

cargo +nightly fuzz build
first=() second=()
i=0
for t in $targets; do
    if (( i % 2 == 0 )); then first+=("$t"); else second+=("$t"); fi
    i=$((i + 1))
done

fuzz_lane() {
    local t
    for t in "$@"; do fuzz_one "$t" || return; done
}
first_lane() { fuzz_lane "${first[@]}"; }
second_lane() { fuzz_lane "${second[@]}"; }
two_lanes "${second[*]}" first_lane second_lane
