#!/usr/bin/env bash
# Every test spillway has, in the order CI runs them. This is the README's test command.
set -euo pipefail
cd "$(dirname "$0")/.."

log=$(mktemp)
trap 'rm -f "$log"' EXIT
step() { printf '\n=== %s\n' "$*"; }

step "format"
cargo fmt --all -- --check

step "clippy (all targets, warnings are errors)"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "unit and integration tests"
cargo test --workspace --locked 2>&1 | tee -a "$log"

step "loom models (own target dir, --cfg spillway_loom)"
RUSTFLAGS="--cfg spillway_loom" CARGO_TARGET_DIR=target/loom \
  cargo test --release --locked -p spillway-loom-tests --test slot 2>&1 | tee -a "$log"

# One closing line over every suite above.
passed=$(grep -Eo '[0-9]+ passed' "$log" | awk '{s+=$1} END {print s+0}')
failed=$(grep -Eo '[0-9]+ failed' "$log" | awk '{s+=$1} END {print s+0}')
printf '\nspillway: %s passed, %s failed\n' "$passed" "$failed"
[ "$failed" -eq 0 ] && [ "$passed" -gt 0 ]
