#!/usr/bin/env bash
# Every test spillway has, in the order CI runs them. This is the README's test command.
set -euo pipefail
cd "$(dirname "$0")/.."

log=$(mktemp)
trap 'rm -f "$log"' EXIT
step() { printf '\n=== %s\n' "$*"; }

step "tools: what the tests need, installed where missing"
rustup component add rustfmt clippy >/dev/null 2>&1 || true
# cargo-fuzz (stable toolchain, run with -s none): builds in about two minutes.
cargo fuzz --help >/dev/null 2>&1 || cargo install cargo-fuzz --locked
# cryptography: dask's Security.temporary(), for the TLS cluster test.
python3 -m pip install -q --disable-pip-version-check maturin pytest pytest-timeout numpy "dask[dataframe]" \
  distributed psutil prometheus_client bokeh cryptography
# Debian's Chromium, for the test that looks at dask's dashboard (test_dashboard.py).
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null 2>&1 \
    || echo "chromium could not be installed: test_dashboard.py will be skipped"
fi

step "format"
cargo fmt --all -- --check

step "clippy (all targets, warnings are errors)"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "layout and docs: the engine's files in layers, each type implemented in its own file; rustdoc links"
python3 scripts/check_layout.py engine/src
RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --locked -q -p spillway

step "unit and integration tests"
# The Python extension is a cdylib tested from Python (below), not by cargo test.
cargo test --workspace --exclude spillway-python --locked 2>&1 | tee -a "$log"

step "loom models (own target dir, --cfg spillway_loom): slot, store, log, bufpool, doorbell"
# --tests: every model file in loom-tests/tests (the store's take about 5-6 minutes on 2 cores).
RUSTFLAGS="--cfg spillway_loom" CARGO_TARGET_DIR=target/loom \
  cargo test --release --locked -p spillway-loom-tests --tests 2>&1 | tee -a "$log"

step "python bindings: build the extension, run pytest (including a real dask cluster)"
maturin build --release --locked -q -m python/Cargo.toml -o target/wheels
# Unpack the wheel next to the build instead of installing it: the package under test is this one.
rm -rf target/python && mkdir -p target/python
python3 -m zipfile -e "$(ls -t target/wheels/spillway-*.whl | head -1)" target/python
# A test that hangs (a cluster that lost a worker, say) fails after 10 minutes instead of stalling CI.
PYTHONPATH="$PWD/target/python" python3 -m pytest -p no:cacheprovider -q --timeout=600 python/tests 2>&1 | tee -a "$log"

step "python bindings against the lowest distributed spillway supports (python/pyproject.toml)"
# A virtual environment with that dask (and a pandas it knows): the tests where dask meets spillway.
lowest=$(sed -n 's/.*"distributed>=\([0-9.]*\),.*/\1/p' python/pyproject.toml)
venv=target/venv-distributed-$lowest
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install -q --disable-pip-version-check "distributed==$lowest" "dask[dataframe]==$lowest" \
  "pandas<3" numpy pytest pytest-timeout psutil prometheus_client cryptography
echo "distributed $("$venv/bin/python" -c 'import distributed; print(distributed.__version__)')"
PYTHONPATH="$PWD/target/python" "$venv/bin/python" -m pytest -p no:cacheprovider -q --timeout=600 \
  python/tests/test_spill_contract.py python/tests/test_dask_parity.py python/tests/test_config.py \
  python/tests/test_worker.py python/tests/test_memory.py python/tests/test_dask_plugin.py \
  python/tests/test_dask_received.py python/tests/test_dask_side_channel.py \
  python/tests/test_dask_metrics.py python/tests/test_dask_cli.py 2>&1 | tee -a "$log"

step "fuzz smoke: every cargo-fuzz target for ${FUZZ_SECONDS:-20} s from its seed corpus"
for t in $(cargo fuzz list); do
  # Work on a copy: new corpus entries found by the run stay out of the repository.
  rm -rf "target/fuzz-corpus/$t" && mkdir -p "target/fuzz-corpus/$t"
  cp fuzz/corpus/"$t"/seed-* "target/fuzz-corpus/$t/" 2>/dev/null || true
  if cargo fuzz run -s none "$t" "target/fuzz-corpus/$t" -- -max_total_time="${FUZZ_SECONDS:-20}" \
      -rss_limit_mb=2048 >"target/fuzz-$t.log" 2>&1; then
    echo "fuzz $t: 1 passed ($(grep -Eo 'Done [0-9]+ runs' "target/fuzz-$t.log" | tail -1))" | tee -a "$log"
  else
    tail -30 "target/fuzz-$t.log"
    echo "fuzz $t: 1 failed (see target/fuzz-$t.log and fuzz/artifacts/$t)" | tee -a "$log"
  fi
done

# One closing line over every suite above.
passed=$(grep -Eo '[0-9]+ passed' "$log" | awk '{s+=$1} END {print s+0}')
failed=$(grep -Eo '[0-9]+ failed' "$log" | awk '{s+=$1} END {print s+0}')
printf '\nspillway: %s passed, %s failed\n' "$passed" "$failed"
[ "$failed" -eq 0 ] && [ "$passed" -gt 0 ]
