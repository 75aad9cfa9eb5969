#!/usr/bin/env bash
# Sourced by .ci/miri.sh and .ci/fuzz.sh: runs two lanes of work side by side, one per
# core, for the steps whose tools use one thread each (Miri interprets on one thread;
# half the fuzz targets fuzz on one).
#
#   two_lanes LABEL FIRST SECOND
#
# runs the shell function SECOND in the background (its output kept in a temporary file)
# and FIRST in the foreground (printed as it goes, and kept too), waits for both, then
# prints SECOND's output under a "--- second lane (LABEL)" header. Returns non-zero if
# either lane failed, and then prints, last, which lane failed and the end of its output:
# CI's report keeps only the tail of a run, and the first lane's crash would otherwise sit
# above the whole of the second lane's output. A lane stops at its first failing command
# only if the function says so (`cmd || return`): `set -e` does not apply inside a
# function called as `FIRST || status=$?`. Its locals are prefixed (`_lanes_`): bash's
# locals are seen by the functions it calls, and a plain `first` would hide a caller's
# array of that name from FIRST.
two_lanes() {
    local _lanes_label=$1 _lanes_first=$2 _lanes_second=$3
    local _lanes_log _lanes_log1 _lanes_rc1 _lanes_pid _lanes_s1=0 _lanes_s2=0
    _lanes_log=$(mktemp)
    _lanes_log1=$(mktemp)
    _lanes_rc1=$(mktemp)
    "$_lanes_second" >"$_lanes_log" 2>&1 &
    _lanes_pid=$!
    # Through tee, so in a subshell: the status goes through a file. Called in a list
    # (`&&`/`||`), so a caller's `set -e` neither stops the lane's function early nor
    # leaves the file empty, and the pipeline itself always succeeds.
    { "$_lanes_first" 2>&1 && echo 0 >"$_lanes_rc1" || echo $? >"$_lanes_rc1"; } |
        tee "$_lanes_log1"
    _lanes_s1=$(cat "$_lanes_rc1")
    wait "$_lanes_pid" || _lanes_s2=$?
    echo "--- second lane ($_lanes_label)"
    cat "$_lanes_log"
    if [ "$_lanes_s1" != 0 ]; then
        echo "--- FAILED: the first lane ($_lanes_first) exited $_lanes_s1; the end of its output:"
        tail -n 80 "$_lanes_log1"
    fi
    if [ "$_lanes_s2" != 0 ]; then
        echo "--- FAILED: the second lane ($_lanes_second, $_lanes_label) exited $_lanes_s2 (its output is just above)"
    fi
    rm -f "$_lanes_log" "$_lanes_log1" "$_lanes_rc1"
    if [ "$_lanes_s1" != 0 ]; then return "$_lanes_s1"; fi
    return "$_lanes_s2"
}
