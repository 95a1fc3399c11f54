#!/usr/bin/env bash
# Run dask's own tests against spillway: on stock dask, with spillway as every worker's default
# store, and with spillway + its plugin on every worker, one after the other, and print the counts.
#
#   scripts/dask-tests.sh DISTRIBUTED_GIT [MODES] [-- PYTEST_ARGS...]
#
# DISTRIBUTED_GIT: a git repository of dask/distributed (a clone, or the bare snapshot the tool
# library's fetch brings) that has the installed version's tag: its tests (not in the wheel or the
# sdist) are laid into a copy of the installed package, so that `distributed.tests` imports in every
# process, workers included. MODES: any of stock, spillway, plugin (default: all three).
# PYTEST_ARGS: default distributed/tests/test_worker_memory.py. The Python is $PYTHON (default:
# target/venv, where scripts/test-all.sh installs the built wheel with the versions tested); dask's
# tests need pytest-rerunfailures there too.
set -uo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
git_dir="${1:?usage: $0 DISTRIBUTED_GIT [stock|spillway|plugin ...] [-- PYTEST_ARGS]}"
shift
modes=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do modes+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
[ ${#modes[@]} -eq 0 ] && modes=(stock spillway plugin)
args=("$@")
[ ${#args[@]} -eq 0 ] && args=(distributed/tests/test_worker_memory.py)
py="${PYTHON:-$here/target/venv/bin/python}"
py="$(cd "$(dirname "$py")" && pwd)/$(basename "$py")"  # (the tests run from another directory)
version="$("$py" -c 'import distributed; print(distributed.__version__)')"
installed="$("$py" -c 'import distributed, os; print(os.path.dirname(distributed.__file__))')"
echo "distributed $version from $installed"
git -C "$git_dir" rev-parse -q --verify "refs/tags/$version" >/dev/null \
  || { echo "$git_dir has no tag $version: its tests would not be the installed version's"; exit 2; }
# The installed package over the repository's tree at its version: what the wheel leaves out (the
# tests, the pytest plugins they load) comes from the repository, everything else is as installed.
tree="$(mktemp -d)"
trap 'rm -rf "$tree"' EXIT
git -C "$git_dir" archive "$version" distributed conftest.py pyproject.toml | tar -x -C "$tree"
cp -r "$installed/." "$tree/distributed/"
summary=()
for mode in "${modes[@]}"; do
  env=(PYTHONPATH="$here/scripts/dask-default-store:$tree${PYTHONPATH:+:$PYTHONPATH}")
  case "$mode" in
    stock) ;;
    spillway) env+=(SPILLWAY_DASK_DEFAULT_STORE=1) ;;
    plugin) env+=(SPILLWAY_DASK_DEFAULT_STORE=1 DASK_DISTRIBUTED__WORKER__PRELOAD='["spillway.dask"]') ;;
    *) echo "unknown mode $mode (stock, spillway or plugin)"; exit 2 ;;
  esac
  log="$(mktemp)"
  echo "=== $mode: ${args[*]}"
  (cd "$tree" && env "${env[@]}" "$py" -m pytest -p no:cacheprovider -q -rfE --color=no --durations=0 --timeout=300 -o timeout_method=signal -o addopts="" "${args[@]}") 2>&1 | tee "$log" | grep -E "^(FAILED|ERROR)|(passed|failed|error).* in [0-9.]+s"
  summary+=("$mode: $(grep -E '(passed|failed|error).* in [0-9.]+s' "$log" | tail -1 | tr -d '=' | sed 's/^ *//')")
  rm -f "$log"
done
printf '\n'
printf '%s\n' "${summary[@]}"
