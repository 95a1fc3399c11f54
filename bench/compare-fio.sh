#!/usr/bin/env bash
# Run fio and spillway-bench on the same directory with equivalent O_DIRECT jobs, alternating, and
# print one ratio (spillway / fio) per job and round, then each job's median ratio.
#
#   bench/compare-fio.sh [DIR] [--quick] [--rounds N]
#
# DIR defaults to a new directory under /var/tmp (a disk-backed file system; O_DIRECT needs one).
# --rounds N (default 3; 1 with --quick): this VM's disk moves by a quarter from one minute to the
# next, so each job runs fio and spillway back to back N times and the median of the N ratios is the
# job's result. Jobs (the io_uring issue's targets in brackets):
#   seqwrite-1M-qd16    sequential write, 1 MiB blocks, 16 in flight      [>= 0.9x fio bandwidth]
#   sustained-1M-qd16   the same writes for 2x the runtime over --size of keys (overwrites, dead
#                       segments), spillway as a spill log (`--spill-log`) vs fio overwriting its
#                       file for as long                                 [>= 0.9x fio bandwidth]
#   sustained-no-reuse  the same with `--recycle-segments 0` (each segment a new file; no target)
#   kept-store          one time-based run per round into a spill store kept from round to round
#                       (each run opens the directory the last one left), vs fio's time-based
#                       overwrite of its file, kept too; both laid out by one run before round 1
#                                                                        [>= 0.9x, no decline]
#   randread-64K-qd16   random read, 64 KiB blocks, 16 in flight          [>= 0.9x fio bandwidth]
#   randread-4K-qd32    random read, 4 KiB blocks, 32 in flight           [>= 0.8x fio IOPS]
#   uring-vs-portable   spillway randread 4K QD32 on io_uring vs the portable backend run with the
#                       same options (one thread: a synchronous backend, like fio's psync, has one
#                       read in flight per thread)                        [>= 1.5x]
#   uring-vs-32threads  the same io_uring run vs the portable backend with 32 threads, which keeps
#                       32 reads in flight too (no target: both sides are at the device's limit)
set -euo pipefail
cd "$(dirname "$0")/.."

DIR=""
QUICK=0
ROUNDS=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --quick) QUICK=1 ;;
        --rounds) ROUNDS=$2; shift ;;
        *) DIR="$1" ;;
    esac
    shift
done
if [[ -z "$DIR" ]]; then
    DIR=$(mktemp -d /var/tmp/spillway-fio.XXXXXX)
    trap 'rm -rf "$DIR"' EXIT
fi
mkdir -p "$DIR"

if ! command -v fio >/dev/null; then
    echo "installing fio from Debian..." >&2
    SUDO=""
    if [[ $(id -u) != 0 ]]; then SUDO=sudo; fi
    ($SUDO apt-get install -y fio >/dev/null 2>&1 || { $SUDO apt-get update >/dev/null && $SUDO apt-get install -y fio >/dev/null; })
fi

if [[ $QUICK == 1 ]]; then SIZE_MB=512; RUNTIME=4; ROUNDS=${ROUNDS:-1}; else SIZE_MB=2048; RUNTIME=10; ROUNDS=${ROUNDS:-3}; fi
cargo build --release -q -p spillway-bench
BENCH=target/release/spillway-bench

# Field of fio-shaped JSON: jobs[last].<side>.<field>
field() { python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['jobs'][-1][sys.argv[2]][sys.argv[3]])" "$@"; }
ratio() { python3 -c "import sys; print(f'{float(sys.argv[1]) / float(sys.argv[2]):.2f}')" "$1" "$2"; }
median() { python3 -c "import statistics,sys; print(f'{statistics.median(map(float, sys.argv[1:])):.2f}')" "$@"; }
fmt() { python3 -c "import sys; print(f'{float(sys.argv[1]) / float(sys.argv[2]):.1f} {sys.argv[3]}')" "$@"; }

run_fio() { # name rw bs iodepth extra...
    local name=$1 rw=$2 bs=$3 qd=$4; shift 4
    rm -rf "$DIR/fio" && mkdir -p "$DIR/fio"
    fio --name="$name" --directory="$DIR/fio" --rw="$rw" --bs="$bs" --iodepth="$qd" --size="${SIZE_MB}M" \
        --direct=1 --ioengine=io_uring --output-format=json "$@" >"$DIR/$name.fio.json"
    rm -rf "$DIR/fio"
}
run_spill() { # name args...
    local name=$1; shift
    "$BENCH" --dir "$DIR/spill" --output-format json "$@" >"$DIR/$name.spill.json"
    rm -rf "$DIR/spill"
}

declare -A RATIOS
printf '%-20s %5s %16s %16s %8s\n' job round baseline spillway ratio
row() { # job round baseline-value spillway-value unit scale
    local r
    r=$(ratio "$4" "$3")
    RATIOS[$1]="${RATIOS[$1]:-} $r"
    printf '%-20s %5s %16s %16s %8s\n' "$1" "$2" "$(fmt "$3" "$6" "$5")" "$(fmt "$4" "$6" "$5")" "$r"
}

# The kept store and fio's kept file live across rounds, laid out by one unreported run each.
KEPT=(--backend uring --direct --rw write --bs 1MiB --iodepth 16 --size "${SIZE_MB}MiB" --spill-log
    --runtime "$RUNTIME" --time-based --dir "$DIR/kept/spill" --keep --output-format json)
KEPT_FIO=(--name=kept-store --directory="$DIR/kept/fio" --rw=write --bs=1M --iodepth=16 --size="${SIZE_MB}M"
    --direct=1 --ioengine=io_uring --runtime="$RUNTIME" --time_based --output-format=json)
rm -rf "$DIR/kept" && mkdir -p "$DIR/kept/fio"
"$BENCH" "${KEPT[@]}" >/dev/null
fio "${KEPT_FIO[@]}" >/dev/null

S4K=(--backend uring --direct --rw randread --bs 4KiB --iodepth 32 --size "${SIZE_MB}MiB" --runtime "$RUNTIME" --time-based)
for ((i = 1; i <= ROUNDS; i++)); do
    run_fio seqwrite-1M-qd16 write 1M 16
    run_spill seqwrite-1M-qd16 --backend uring --direct --rw write --bs 1MiB --iodepth 16 --size "${SIZE_MB}MiB"
    row seqwrite-1M-qd16 "$i" "$(field "$DIR/seqwrite-1M-qd16.fio.json" write bw_bytes)" \
        "$(field "$DIR/seqwrite-1M-qd16.spill.json" write bw_bytes)" MB/s 1e6

    # Sustained: time-based writes over --size of keys, so after the first pass every write replaces
    # a value and old segments die (spillway as a spill store's log, reusing dead segments' files,
    # and without that reuse), against fio overwriting its file for as long.
    run_fio sustained-1M-qd16 write 1M 16 --runtime="$((2 * RUNTIME))" --time_based
    run_spill sustained-1M-qd16 --backend uring --direct --rw write --bs 1MiB --iodepth 16 --size "${SIZE_MB}MiB" \
        --spill-log --runtime "$((2 * RUNTIME))" --time-based
    sf=$(field "$DIR/sustained-1M-qd16.fio.json" write bw_bytes)
    row sustained-1M-qd16 "$i" "$sf" "$(field "$DIR/sustained-1M-qd16.spill.json" write bw_bytes)" MB/s 1e6
    run_spill sustained-no-reuse --backend uring --direct --rw write --bs 1MiB --iodepth 16 --size "${SIZE_MB}MiB" \
        --spill-log --recycle-segments 0 --runtime "$((2 * RUNTIME))" --time-based
    row sustained-no-reuse "$i" "$sf" "$(field "$DIR/sustained-no-reuse.spill.json" write bw_bytes)" MB/s 1e6

    # A store that has been running a while: each round reopens the directory the last one left.
    "$BENCH" "${KEPT[@]}" >"$DIR/kept-store.spill.json"
    fio "${KEPT_FIO[@]}" >"$DIR/kept-store.fio.json"
    row kept-store "$i" "$(field "$DIR/kept-store.fio.json" write bw_bytes)" \
        "$(field "$DIR/kept-store.spill.json" write bw_bytes)" MB/s 1e6

    run_fio randread-64K-qd16 randread 64k 16 --runtime="$RUNTIME" --time_based
    run_spill randread-64K-qd16 --backend uring --direct --rw randread --bs 64KiB --iodepth 16 --size "${SIZE_MB}MiB" \
        --runtime "$RUNTIME" --time-based
    row randread-64K-qd16 "$i" "$(field "$DIR/randread-64K-qd16.fio.json" read bw_bytes)" \
        "$(field "$DIR/randread-64K-qd16.spill.json" read bw_bytes)" MB/s 1e6

    run_fio randread-4K-qd32 randread 4k 32 --runtime="$RUNTIME" --time_based
    run_spill randread-4K-qd32 "${S4K[@]}"
    u=$(field "$DIR/randread-4K-qd32.spill.json" read iops)
    row randread-4K-qd32 "$i" "$(field "$DIR/randread-4K-qd32.fio.json" read iops)" "$u" kIOPS 1e3

    run_spill portable-4K-qd32 --backend portable --direct --rw randread --bs 4KiB --iodepth 32 \
        --size "${SIZE_MB}MiB" --runtime "$RUNTIME" --time-based
    row uring-vs-portable "$i" "$(field "$DIR/portable-4K-qd32.spill.json" read iops)" "$u" kIOPS 1e3

    run_spill portable-4K-32jobs --backend portable --direct --rw randread --bs 4KiB --numjobs 32 \
        --size "$((SIZE_MB / 32))MiB" --runtime "$RUNTIME" --time-based
    row uring-vs-32threads "$i" "$(field "$DIR/portable-4K-32jobs.spill.json" read iops)" "$u" kIOPS 1e3
done
rm -rf "$DIR/kept"

echo "(uring-vs-*: the baseline column is spillway on the portable backend, same options / 32 threads)"
echo
printf '%-20s %8s  %s\n' job median "ratios"
for job in seqwrite-1M-qd16 sustained-1M-qd16 sustained-no-reuse kept-store randread-64K-qd16 randread-4K-qd32 uring-vs-portable uring-vs-32threads; do
    # shellcheck disable=SC2086
    printf '%-20s %8s  %s\n' "$job" "$(median ${RATIOS[$job]})" "${RATIOS[$job]# }"
done
