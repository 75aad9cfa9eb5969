#!/usr/bin/env bash
# Checks .ci/lanes.sh itself (under a second): exit statuses of either lane, a lane that
# stops at its first failure, the second lane's header, and a caller's arrays named like
# two_lanes' own parameters staying visible to the lanes.
cd "$(dirname "$0")/.."
set -euo pipefail
out=$(mktemp)
trap 'rm -f "$out"' EXIT
source .ci/lanes.sh
ok() { echo ok; }
bad() { echo bad; return 3; }
early() { false || return; echo "should not print"; }
check() { local want=$1; shift; local got=0; two_lanes t "$@" >"$out" 2>&1 || got=$?; if [ "$got" != "$want" ]; then echo "FAIL: $* -> $got (want $want)"; cat "$out"; exit 1; fi; }
check 0 ok ok
check 3 bad ok
check 3 ok bad
check 1 early ok
check 1 ok early
# (`! grep` would not stop the script: errexit ignores a negated command.)
if grep -q "should not print" "$out"; then echo "FAIL: a lane ran on after a failure"; exit 1; fi
two_lanes lbl ok ok >"$out"
grep -q -- "--- second lane (lbl)" "$out" || { echo "FAIL: no header"; exit 1; }
# Under a caller's `set -e` (as .ci/fuzz.sh calls it): the script still prints the second
# lane, then the failed first lane's end last, and exits with the lane's status.
got=0
bash -c 'set -euo pipefail; source .ci/lanes.sh; ok() { echo ok-lane; }
    bad() { echo crash-report; return 3; }; two_lanes t bad ok; echo "not reached"' >"$out" 2>&1 || got=$?
[ "$got" = 3 ] || { echo "FAIL: set -e caller -> $got (want 3)"; cat "$out"; exit 1; }
if grep -q "not reached" "$out"; then echo "FAIL: set -e caller ran on"; exit 1; fi
[ "$(tail -n 1 "$out")" = crash-report ] || { echo "FAIL: the failed lane's end is not last"; cat "$out"; exit 1; }
grep -q "ok-lane" "$out" || { echo "FAIL: second lane not printed"; cat "$out"; exit 1; }
echo lanes: all cases pass
# A caller's array named like two_lanes' parameters stays visible to the lanes.
first=(a b) second=(c)
f1() { echo "first=${first[*]}"; }
f2() { echo "second=${second[*]}"; }
two_lanes arrays f1 f2 >"$out"
grep -q "first=a b" "$out" && grep -q "second=c" "$out" || { echo "FAIL: arrays hidden"; cat "$out"; exit 1; }
echo lanes: arrays pass
