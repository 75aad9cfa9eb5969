#!/usr/bin/env bash
# A/B sitting of the training demo and perf_report, two trees interleaved (A B A B):
#   bash benches/ab_sitting.sh BEFORE_EXAMPLES_DIR AFTER_EXAMPLES_DIR [ROUNDS] [OUT]
# Each *_EXAMPLES_DIR is a tree's target/release/examples (build both first with
# `cargo build --release --example train --example perf_report`). Writes one file per
# condition under OUT (default ab-sitting/), each run headed by its tree, time and load.
set -u
A=$1; B=$2; R=${3:-2}; OUT=${4:-ab-sitting}
mkdir -p "$OUT"
run() { # condition tree command...
    local tag=$1 tree=$2; shift 2
    echo "== $tag $tree $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)" >>"$OUT/$tag.txt"
    "$@" >>"$OUT/$tag.txt" 2>&1
}
for _ in $(seq 1 "$R"); do
    for t in "$A" "$B"; do
        run quiet "$t" "$t/train" --quiet --runs 3 --no-trace
        run hog1 "$t" "$t/train" --quiet --runs 3 --no-trace --hog 1
        run hog2 "$t" "$t/train" --quiet --runs 3 --no-trace --hog 2
        run nopin "$t" "$t/train" --quiet --runs 3 --no-trace --no-pin
        run nopin_hog1 "$t" "$t/train" --quiet --runs 3 --no-trace --hog 1 --no-pin
        run single_hog1 "$t" env IVM_MODE=single "$t/train" --quiet --runs 3 --no-trace --hog 1
        run single_hog2 "$t" env IVM_MODE=single "$t/train" --quiet --runs 3 --no-trace --hog 2
        run single_quiet "$t" env IVM_MODE=single "$t/train" --quiet --runs 3 --no-trace
    done
done
for t in "$A" "$B"; do
    run perf "$t" "$t/perf_report" --quick
done
