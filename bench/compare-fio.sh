#!/usr/bin/env bash
# Run fio and spillway-bench back to back on the same directory with equivalent O_DIRECT jobs and
# print one ratio per job (spillway / fio). fio is installed from Debian when missing.
#
#   bench/compare-fio.sh [DIR] [--quick]
#
# DIR defaults to a new directory under /var/tmp (a disk-backed file system; O_DIRECT needs one).
# Jobs (the io_uring issue's targets in brackets):
#   seqwrite-1M-qd16    sequential write, 1 MiB blocks, 16 in flight      [>= 0.9x fio bandwidth]
#   randread-64K-qd16   random read, 64 KiB blocks, 16 in flight          [>= 0.9x fio bandwidth]
#   randread-4K-qd32    random read, 4 KiB blocks, 32 in flight           [>= 0.8x fio IOPS]
#   uring-vs-portable   spillway randread 4K QD32 on io_uring vs the portable backend with 32
#                       threads (psync's way to keep 32 reads in flight)  [>= 1.5x]
set -euo pipefail
cd "$(dirname "$0")/.."

DIR=""
QUICK=0
for a in "$@"; do
    case "$a" in
        --quick) QUICK=1 ;;
        *) DIR="$a" ;;
    esac
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

if [[ $QUICK == 1 ]]; then SIZE_MB=512; RUNTIME=4; else SIZE_MB=2048; RUNTIME=10; fi
cargo build --release -q -p spillway-bench
BENCH=target/release/spillway-bench

# Field of fio-shaped JSON: jobs[last].<side>.<field>
field() { python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['jobs'][-1][sys.argv[2]][sys.argv[3]])" "$@"; }
ratio() { python3 -c "import sys; print(f'{float(sys.argv[1]) / float(sys.argv[2]):.2f}')" "$1" "$2"; }

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

printf '%-20s %16s %16s %8s\n' job fio spillway ratio
report() { # name side field unit scale
    local f s
    f=$(field "$DIR/$1.fio.json" "$2" "$3")
    s=$(field "$DIR/$1.spill.json" "$2" "$3")
    printf '%-20s %16s %16s %8s\n' "$1" "$(python3 -c "print(f'{$f/$5:.1f} $4')")" "$(python3 -c "print(f'{$s/$5:.1f} $4')")" "$(ratio "$s" "$f")"
}

run_fio seqwrite-1M-qd16 write 1M 16
run_spill seqwrite-1M-qd16 --backend uring --direct --rw write --bs 1MiB --iodepth 16 --size "${SIZE_MB}MiB"
report seqwrite-1M-qd16 write bw_bytes MB/s 1e6

run_fio randread-64K-qd16 randread 64k 16 --runtime="$RUNTIME" --time_based
run_spill randread-64K-qd16 --backend uring --direct --rw randread --bs 64KiB --iodepth 16 --size "${SIZE_MB}MiB" \
    --runtime "$RUNTIME" --time-based
report randread-64K-qd16 read bw_bytes MB/s 1e6

run_fio randread-4K-qd32 randread 4k 32 --runtime="$RUNTIME" --time_based
run_spill randread-4K-qd32 --backend uring --direct --rw randread --bs 4KiB --iodepth 32 --size "${SIZE_MB}MiB" \
    --runtime "$RUNTIME" --time-based
report randread-4K-qd32 read iops kIOPS 1e3

run_spill portable-4K-32jobs --backend portable --direct --rw randread --bs 4KiB --numjobs 32 \
    --size "$((SIZE_MB / 32))MiB" --runtime "$RUNTIME" --time-based
u=$(field "$DIR/randread-4K-qd32.spill.json" read iops)
p=$(field "$DIR/portable-4K-32jobs.spill.json" read iops)
printf '%-20s %16s %16s %8s\n' uring-vs-portable "$(python3 -c "print(f'{$p/1e3:.1f} kIOPS')")" \
    "$(python3 -c "print(f'{$u/1e3:.1f} kIOPS')")" "$(ratio "$u" "$p")"
echo "(uring-vs-portable: the 'fio' column is spillway on the portable backend with 32 threads)"
