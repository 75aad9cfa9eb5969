#!/usr/bin/env bash
# Ordering mutants: how many weakened memory orderings and deleted wake calls the loom
# models catch. Not part of .ci/run (a full run takes about 30 minutes on 2 cores).
#
# For every site in ivm-core's sources, in ivm-std's engine token (engine/drive/token.rs,
# engine/drive/single_waits.rs), in what drives it (engine/core.rs, engine/submission.rs,
# engine/backpressure.rs, engine/helping.rs) and
# in its shutdown gate (engine/gate.rs) —
# or in the files named on the command line (ivm-std's `model/thread_ctx.rs` and
# `model/express.rs`, ivm-engine's
# `completer.rs` have models too) —
# outside test modules (in-file ones and `tests.rs` files) and `fn planted_*` bodies (bugs
# planted on purpose):
#   * each Acquire / Release / AcqRel / SeqCst in code is replaced by Relaxed, one at a
#     time (a `fence(..)` call is deleted instead: a Relaxed fence is not allowed);
#   * each `W::wake_one(..)` / `W::wake_all(..)` call (ivm-std: `FutexWait::`) is deleted,
#     one at a time;
# then the non-planted loom models run at LOOM_MAX_PREEMPTIONS (default 2): ivm-core's
# models for an ivm-core mutant, ivm-std's gate, wake-path, helper, awaited-release,
# backpressure, single-thread-wait, caller-runs and express models for an ivm-std mutant
# (or those MUTANT_STD_MODELS names), ivm-engine's
# models for an ivm-engine mutant; each binary runs its models one at a time (faster on 2
# cores, see .ci/loom.sh). A
# mutant is *killed* when a model fails (or does not build), *survives* when
# every model passes. The survivors are printed at the end, as `file:line (what)`.
#
#   bash .ci/ordering_mutants.sh                       # every site
#   bash .ci/ordering_mutants.sh crates/ivm-core/src/notifier.rs   # the sites of some files
#   MUTANT_TIMEOUT=900 bash .ci/ordering_mutants.sh    # seconds per mutant (default 600)
#   MUTANT_STD_MODELS="loom_backpressure loom_awaited" bash .ci/ordering_mutants.sh \
#       crates/ivm-std/src/engine/backpressure.rs      # only these ivm-std models (faster)
#
# A mutant whose models run past the timeout counts as killed (loom reports lost wake-ups
# as deadlocks quickly; a timeout means the model no longer terminates). Sources are
# restored after each mutant and on exit, whatever happens; still, run it in a checkout
# nobody is editing (a build started meanwhile would see a mutant).
set -euo pipefail
cd "$(dirname "$0")/.."
export LOOM_MAX_PREEMPTIONS="${LOOM_MAX_PREEMPTIONS:-2}"
timeout_s="${MUTANT_TIMEOUT:-600}"
if [ "$#" -gt 0 ]; then
    files=("$@")
else
    mapfile -t files < <(ls crates/ivm-core/src/*.rs crates/ivm-core/src/list/*.rs crates/ivm-core/src/mpsc/*.rs | grep -v "/tests.rs$"; echo crates/ivm-std/src/engine/drive/token.rs; echo crates/ivm-std/src/engine/drive/single_waits.rs; echo crates/ivm-std/src/engine/core.rs; echo crates/ivm-std/src/engine/submission.rs; echo crates/ivm-std/src/engine/backpressure.rs; echo crates/ivm-std/src/engine/helping.rs; echo crates/ivm-std/src/engine/gate.rs)
fi
backup="$(mktemp -d)"
restore() {
    for f in "${files[@]}"; do
        [ -f "$backup/$(echo "$f" | tr / _)" ] && cp "$backup/$(echo "$f" | tr / _)" "$f"
    done
    return 0
}
trap restore EXIT
for f in "${files[@]}"; do cp "$f" "$backup/$(echo "$f" | tr / _)"; done

# Lists the mutants of a file: "line<TAB>column<TAB>kind<TAB>description".
sites() {
    python3 - "$1" <<'EOF'
import re, sys
lines = open(sys.argv[1]).read().split("\n")
in_test = False
planted_indent = None  # inside a `fn planted_*` (a bug planted on purpose): not a site
for n, line in enumerate(lines):
    code = line.split("//")[0]
    if re.match(r"\s*#\[cfg\(test\)\]", line) and n + 1 < len(lines) and re.match(
        r"\s*(pub(\([a-z]+\))? )?mod\b", lines[n + 1]
    ):
        in_test = True  # by convention the test module is the last item
    m = re.match(r"(\s*)(pub(\([a-z]+\))? )?fn planted_", code)
    if m:
        planted_indent = m.group(1)
    if planted_indent is not None:
        if code.rstrip() == planted_indent + "}":
            planted_indent = None
        continue
    if in_test or not code.strip() or re.match(r"\s*(use|pub use)\b", code):
        continue
    m = re.search(r"\bfence\((Ordering::)?(Acquire|Release|AcqRel|SeqCst)\)", code)
    if m:
        print(f"{n + 1}\t{m.start()}\tdelete-fence\tfence({m.group(2)}) deleted")
        continue
    for m in re.finditer(r"\b(Ordering::)?(Acquire|Release|AcqRel|SeqCst)\b", code):
        print(f"{n + 1}\t{m.start()}\trelax\t{m.group(2)} -> Relaxed")
    m = re.search(r"\b(W|FutexWait)::(wake_one|wake_all)\([^;]*\);", code)
    if m:
        print(f"{n + 1}\t{m.start()}\tdelete-wake\t{m.group(2)} deleted")
EOF
}

# Applies one mutant to a file in place.
mutate() {
    python3 - "$1" "$2" "$3" "$4" <<'EOF'
import re, sys
path, line, col, kind = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
lines = open(path).read().split("\n")
s = lines[line - 1]
if kind == "relax":
    m = re.compile(r"\b(Ordering::)?(Acquire|Release|AcqRel|SeqCst)\b").match(s, col)
    # A bare `Acquire` (imported) becomes a full path, so no import is needed.
    s = s[:m.start()] + (m.group(1) or "crate::sync::Ordering::") + "Relaxed" + s[m.end():]
elif kind == "delete-fence":
    s = re.sub(r"\bfence\([^)]*\)", "()", s, count=1)
elif kind == "delete-wake":
    s = re.sub(r"\b(W|FutexWait)::(wake_one|wake_all)\([^;]*\);", "();", s, count=1)
lines[line - 1] = s
open(path, "w").write("\n".join(lines))
EOF
}

models() {
    case "$1" in
        crates/ivm-std/*)
            local tests=() t
            for t in ${MUTANT_STD_MODELS:-loom_gate loom_wake_path loom_helpers loom_single_waits loom_caller_runs loom_express loom_awaited loom_backpressure}; do
                tests+=(--test "$t")
            done
            RUSTFLAGS="--cfg loom" timeout "$timeout_s" cargo test --quiet --release \
                --target-dir target/mutants -p ivm-std "${tests[@]}" \
                -- --skip planted --test-threads=1 ;;
        crates/ivm-engine/*)
            RUSTFLAGS="--cfg loom" timeout "$timeout_s" cargo test --quiet --release \
                --target-dir target/mutants -p ivm-engine --test 'loom_*' -- --skip planted --test-threads=1 ;;
        *)
            RUSTFLAGS="--cfg loom" timeout "$timeout_s" cargo test --quiet --release \
                --target-dir target/mutants -p ivm-core --test 'loom_*' -- --skip planted --test-threads=1 ;;
    esac
}

killed=0
timeouts=0
survived=()
total=0
for f in "${files[@]}"; do
    while IFS=$'\t' read -r line col kind what; do
        [ -n "$line" ] || continue
        total=$((total + 1))
        cp "$backup/$(echo "$f" | tr / _)" "$f"
        mutate "$f" "$line" "$col" "$kind"
        rc=0
        models "$f" >/dev/null 2>&1 || rc=$?
        if [ "$rc" -eq 0 ]; then
            survived+=("$f:$line ($what)")
            echo "SURVIVED $f:$line ($what)"
        elif [ "$rc" -eq 124 ]; then
            # A slow machine can time out a mutant no model catches: said apart.
            killed=$((killed + 1))
            timeouts=$((timeouts + 1))
            echo "killed   $f:$line ($what) by the ${timeout_s} s timeout"
        else
            killed=$((killed + 1))
            echo "killed   $f:$line ($what)"
        fi
        cp "$backup/$(echo "$f" | tr / _)" "$f"
    done < <(sites "$f")
done

echo
echo "ordering mutants: $total, killed $killed ($timeouts of them by the timeout), survived ${#survived[@]} (LOOM_MAX_PREEMPTIONS=$LOOM_MAX_PREEMPTIONS)"
for s in "${survived[@]}"; do echo "  $s"; done
