#!/usr/bin/env bash
# Run dask's own tests against spillway: on stock dask, with spillway as every worker's default
# store, and with spillway + its plugin on every worker, one after the other, and print the counts.
#
#   scripts/dask-tests.sh DISTRIBUTED_SRC [MODES] [-- PYTEST_ARGS...]
#
# DISTRIBUTED_SRC: a checkout of dask/distributed at the installed version (its tests are not in the
# wheel or the sdist). MODES: any of stock, spillway, plugin (default: all three). PYTEST_ARGS:
# default distributed/tests/test_worker_memory.py. The Python is $PYTHON (default: target/venv, where
# scripts/test-all.sh installs the built wheel with the versions tested).
set -uo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
src="$(cd "${1:?usage: $0 DISTRIBUTED_SRC [stock|spillway|plugin ...] [-- PYTEST_ARGS]}" && pwd)"
shift
modes=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do modes+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
[ ${#modes[@]} -eq 0 ] && modes=(stock spillway plugin)
args=("$@")
[ ${#args[@]} -eq 0 ] && args=(distributed/tests/test_worker_memory.py)
py="${PYTHON:-$here/target/venv/bin/python}"
echo "distributed $("$py" -c 'import distributed; print(distributed.__version__)') from $("$py" -c 'import distributed, os; print(os.path.dirname(distributed.__file__))')"
summary=()
for mode in "${modes[@]}"; do
  env=(PYTHONPATH="$here/scripts/dask-default-store${PYTHONPATH:+:$PYTHONPATH}")
  case "$mode" in
    stock) ;;
    spillway) env+=(SPILLWAY_DASK_DEFAULT_STORE=1) ;;
    plugin) env+=(SPILLWAY_DASK_DEFAULT_STORE=1 DASK_DISTRIBUTED__WORKER__PRELOAD='["spillway.dask"]') ;;
    *) echo "unknown mode $mode (stock, spillway or plugin)"; exit 2 ;;
  esac
  log="$(mktemp)"
  echo "=== $mode: ${args[*]}"
  (cd "$src" && env "${env[@]}" "$py" -m pytest -p no:cacheprovider -q -rfE --color=no --durations=0 --timeout=300 -o timeout_method=signal "${args[@]}") 2>&1 | tee "$log" | grep -E "^(FAILED|ERROR)|(passed|failed|error).* in [0-9.]+s"
  summary+=("$mode: $(grep -E '(passed|failed|error).* in [0-9.]+s' "$log" | tail -1 | tr -d '=' | sed 's/^ *//')")
  rm -f "$log"
done
printf '\n'
printf '%s\n' "${summary[@]}"
