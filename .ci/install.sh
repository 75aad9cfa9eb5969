#!/usr/bin/env bash
# Installs what CI needs on a fresh machine. Never `rustup update` (it would change the
# pinned toolchains). RUSTUP_AUTO_INSTALL=0 may be set, so everything is explicit here.
set -euo pipefail

# python3 runs the layer check (.ci/layers.sh).
if ! command -v python3 >/dev/null 2>&1; then
    apt-get update && apt-get install -y python3
fi

rustup target add thumbv7em-none-eabihf
rustup component add clippy rustfmt
rustup component add miri rust-src --toolchain nightly
cargo +nightly miri setup
if ! command -v cargo-fuzz >/dev/null 2>&1; then
    cargo install cargo-fuzz --locked
fi
# QEMU for examples/mcu (.ci/mcu.sh), from Debian.
if ! command -v qemu-system-arm >/dev/null 2>&1; then
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update && $sudo apt-get install -y qemu-system-arm
fi

# Open MPI and libclang (rsmpi's bindings) for ivm-ccl's `mpi` feature (.ci/mpi.sh), from
# Debian.
if ! dpkg -s libopenmpi-dev openmpi-bin libclang-dev >/dev/null 2>&1; then
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update && $sudo apt-get install -y libopenmpi-dev openmpi-bin libclang-dev
fi

# Fail loudly if anything is still missing.
rustup target list --installed | grep -qx thumbv7em-none-eabihf || { echo "thumbv7em target missing" >&2; exit 1; }
cargo +nightly miri --version >/dev/null || { echo "miri missing" >&2; exit 1; }
cargo fuzz --version >/dev/null || { echo "cargo-fuzz missing" >&2; exit 1; }
cargo clippy --version >/dev/null || { echo "clippy missing" >&2; exit 1; }
qemu-system-arm --version >/dev/null || { echo "qemu-system-arm missing" >&2; exit 1; }
mpirun --version >/dev/null || { echo "mpirun missing" >&2; exit 1; }
