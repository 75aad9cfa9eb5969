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
# not apply inside a function called as `FIRST || status=$?`. Its locals are prefixed
# (`_lanes_`): bash's locals are seen by the functions it calls, and a plain `first`
# would hide a caller's array of that name from FIRST.
two_lanes() {
    local _lanes_label=$1 _lanes_first=$2 _lanes_second=$3
    local _lanes_log _lanes_pid _lanes_status=0
    _lanes_log=$(mktemp)
    "$_lanes_second" >"$_lanes_log" 2>&1 &
    _lanes_pid=$!
    "$_lanes_first" || _lanes_status=$?
    wait "$_lanes_pid" || _lanes_status=$?
    echo "--- second lane ($_lanes_label)"
    cat "$_lanes_log"
    rm -f "$_lanes_log"
    return "$_lanes_status"
}
