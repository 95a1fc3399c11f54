#!/usr/bin/env bash
# Every test spillway has, in the order CI runs them. This is the README's test command.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n=== %s\n' "$*"; }

step "format"
cargo fmt --all -- --check

step "clippy (all targets, warnings are errors)"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "unit and integration tests"
cargo test --workspace --locked

if [ -d loom-tests/tests ] && ls loom-tests/tests/*.rs >/dev/null 2>&1; then
  step "loom models (own target dir, --cfg spillway_loom)"
  RUSTFLAGS="--cfg spillway_loom" CARGO_TARGET_DIR=target/loom \
    cargo test --release --locked -p spillway-loom-tests
fi
