#!/usr/bin/env bash
# Sourced by .ci/miri.sh and .ci/fuzz.sh: runs two lanes of work side by side, one per
# core, for the steps whose tools use one thread each (Miri interprets on one thread;
# half the fuzz targets fuzz on one).
#
#   two_lanes LABEL FIRST SECOND
#
# runs the shell function SECOND in the background (its output kept in a temporary file)
# and FIRST in the foreground, waits for both, then prints SECOND's output under a
# "--- second lane (LABEL)" header. Returns non-zero if either lane failed. A lane stops at
# its first failing command only if the function says so (`cmd || return`): `set -e` does
# not apply inside a function called as `FIRST || status=$?`.
two_lanes() {
    local label=$1 first=$2 second=$3
    local log lane status=0
    log=$(mktemp)
    "$second" >"$log" 2>&1 &
    lane=$!
    "$first" || status=$?
    wait "$lane" || status=$?
    echo "--- second lane ($label)"
    cat "$log"
    rm -f "$log"
    return "$status"
}
