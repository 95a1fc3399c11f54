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
# Python packages go into virtual environments under target/ (python_env below), never into the
# system Python: each resolved with spillway's own bounds (python/pyproject.toml) under the
# constraints of the versions tested (python/requirements/).
# Debian's Chromium, for the test that looks at dask's dashboard (test_dashboard.py), and nftables,
# for the fault run's dropped packets (test_cluster.py, python/bench/faults.py).
missing=()
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v nft >/dev/null 2>&1 || missing+=(nftables)
if [ ${#missing[@]} -gt 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}") >/dev/null 2>&1 \
    || echo "${missing[*]} could not be installed: the tests that need them will be skipped"
fi

step "format"
cargo fmt --all -- --check

step "clippy (all targets, warnings are errors)"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "the engine as its users build it: -p spillway alone, no features (cargo merges the workspace's)"
cargo clippy -p spillway --all-targets --locked -- -D warnings

step "layout and docs: files in layers, each type implemented and its state kept in its own file; rustdoc links"
python3 scripts/check_layout.py engine/src
RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --locked -q -p spillway

step "unit and integration tests"
# The Python extension is a cdylib tested from Python (below), not by cargo test.
cargo test --workspace --exclude spillway-python --locked 2>&1 | tee -a "$log"

step "loom models (own target dir, --cfg spillway_loom): slot, store, log, bufpool, doorbell"
# --tests: every model file in loom-tests/tests (the store's take about 5-6 minutes on 2 cores).
RUSTFLAGS="--cfg spillway_loom" CARGO_TARGET_DIR=target/loom \
  cargo test --release --locked -p spillway-loom-tests --tests 2>&1 | tee -a "$log"

# python_env DIR [pip arguments...]: a virtual environment at DIR (made if missing) with spillway's
# freshly built wheel and its [test] extra installed as pip resolves them with the package's own
# bounds and the given arguments (constraints, pins, --pre...).
python_env() {
  local dir=$1; shift
  [ -x "$dir/bin/python" ] || python3 -m venv "$dir"
  "$dir/bin/python" -m pip install -q --disable-pip-version-check "$wheel[test]" "$@"
  # The wheel's version does not change between builds: put this build in place.
  "$dir/bin/python" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps "$wheel"
}
versions() { "$1/bin/python" -c 'import dask, distributed; print(f"dask {dask.__version__}, distributed {distributed.__version__}")'; }
# The tests where dask meets spillway: run again on other distributed releases.
dask_tests=(python/tests/test_spill_contract.py python/tests/test_dask_parity.py python/tests/test_config.py
  python/tests/test_worker.py python/tests/test_memory.py python/tests/test_dask_plugin.py
  python/tests/test_dask_received.py python/tests/test_dask_side_channel.py
  python/tests/test_dask_metrics.py python/tests/test_dask_cli.py python/tests/test_dask_hooks.py
  python/tests/test_dask_failures.py)
pytest_in() { local dir=$1; shift; "$dir/bin/python" -m pytest -p no:cacheprovider -q --timeout=600 "$@"; }

step "python bindings: build the wheel, install it in target/venv with the versions tested, run pytest"
main=target/venv
[ -x "$main/bin/python" ] || python3 -m venv "$main"
"$main/bin/python" -m pip install -q --disable-pip-version-check -c python/requirements/tested.txt "maturin>=1.5,<2"
"$main/bin/maturin" build --release --locked -q -m python/Cargo.toml -o target/wheels
wheel=$(ls -t "$PWD"/target/wheels/spillway-*.whl | head -1)
python_env "$main" -c python/requirements/tested.txt
echo "target/venv: $(versions "$main") (python/requirements/tested.txt)"
# A test that hangs (a cluster that lost a worker, say) fails after 10 minutes instead of stalling CI.
pytest_in "$main" python/tests 2>&1 | tee -a "$log"

step "python bindings against the lowest distributed spillway supports (python/requirements/lowest.txt)"
lowest=$(sed -n 's/.*"distributed>=\([0-9.]*\),.*/\1/p' python/pyproject.toml)
grep -qx "distributed==$lowest" python/requirements/lowest.txt \
  || { echo "python/requirements/lowest.txt does not pin distributed==$lowest (pyproject's lower bound)"; exit 1; }
python_env "target/venv-lowest" -c python/requirements/lowest.txt
echo "target/venv-lowest: $(versions target/venv-lowest)"
pytest_in target/venv-lowest "${dask_tests[@]}" 2>&1 | tee -a "$log"

step "python bindings against the newest release within spillway's bounds (whatever the registry serves today)"
python_env target/venv-newest --upgrade --upgrade-strategy eager
newest=$(versions target/venv-newest)
if [ "$newest" = "$(versions "$main")" ]; then
  echo "target/venv-newest: $newest, the versions tested above"
else
  echo "target/venv-newest: $newest (tested: $(versions "$main"))"
  pytest_in target/venv-newest "${dask_tests[@]}" 2>&1 | tee -a "$log"
fi

step "python bindings against the newest pre-release (reported, not counted)"
if ! python_env target/venv-pre --upgrade --upgrade-strategy eager --pre >target/venv-pre.log 2>&1; then
  echo "no pre-release environment could be installed:"; tail -5 target/venv-pre.log
elif [ "$(versions target/venv-pre)" = "$newest" ]; then
  echo "no pre-release newer than the newest release ($newest)"
else
  echo "target/venv-pre: $(versions target/venv-pre)"
  pytest_in target/venv-pre "${dask_tests[@]}" 2>&1 | tail -3 || true
fi

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
