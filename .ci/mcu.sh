#!/usr/bin/env bash
# The dependency engine on a Cortex-M4 under QEMU: builds examples/mcu (its own workspace,
# target thumbv7em-none-eabihf) in release and boots it on QEMU's mps2-an386 board. The
# example leaves QEMU through semihosting, with status 0 only when its results match the
# sequential reference; any other status (1: mismatch, panic or fault; 124: timed out)
# fails this step.
set -euo pipefail
cd "$(dirname "$0")/../examples/mcu"

cargo build --release
elf="${CARGO_TARGET_DIR:-target}/thumbv7em-none-eabihf/release/ivm-mcu"

status=0
timeout 60 qemu-system-arm -machine mps2-an386 -cpu cortex-m4 -nographic \
    -semihosting-config enable=on,target=native -kernel "$elf" || status=$?
if [ "$status" -ne 0 ]; then
    echo "examples/mcu: QEMU exited with status $status" >&2
    exit "$status"
fi
