#!/usr/bin/env python3
"""How the shape of the writes that first filled the page cache changes the cost of later reads.

Writes a 64 MiB file (preallocated, as the segment log's are) with buffered `pwrite`s of one size,
then times `pread`s of `--read` bytes at scattered offsets, all from the page cache. On a kernel
whose file system uses large folios (ext4 on Linux 6.16+), the page cache keeps the folio sizes the
first writes chose: small writes leave small folios, and every later read walks more of them.

    python3 bench/page-cache-shape.py [--dir DIR] [--read BYTES]

Used to choose the write-behind budget of spill logs (docs/architecture.md, docs/benchmarks.md).
"""
import argparse
import os
import tempfile
import time

FILE_BYTES = 64 << 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="where to write (default: the temp directory)")
    ap.add_argument("--read", type=int, default=65536, help="bytes per pread (default 65536)")
    ap.add_argument("--reads", type=int, default=8000, help="preads per measurement")
    args = ap.parse_args()
    data = os.urandom(4 << 20)
    span = FILE_BYTES - (2 << 20) - args.read
    # Scattered, 512-aligned offsets (records are 64-aligned; the reads are rounded to 512).
    offsets = [(i * 2_654_435_761) % span // 512 * 512 for i in range(args.reads)]
    shapes = [
        ("4.5 KiB records (4608 B writes)", 4608),
        ("64 KiB records (65664 B writes)", 65536 + 128),
        ("128 KiB writes", 128 << 10),
        ("1 MiB + 100 B writes (unaligned)", (1 << 20) + 100),
        ("2 MiB writes", 2 << 20),
    ]
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        print(f"pread of {args.read} B at {args.reads} scattered offsets of a cached {FILE_BYTES >> 20} MiB file")
        for label, chunk in shapes:
            path = os.path.join(d, f"w{chunk}")
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                os.posix_fallocate(fd, 0, FILE_BYTES)
                pos = 0
                while pos < FILE_BYTES - chunk:
                    os.pwrite(fd, data[:chunk], pos)
                    pos += chunk
                best = float("inf")
                for _ in range(5):
                    t0 = time.perf_counter()
                    for o in offsets:
                        os.pread(fd, args.read, o)
                    best = min(best, time.perf_counter() - t0)
                print(f"  written in {label:34s} {best / len(offsets) * 1e6:6.2f} us per pread")
            finally:
                os.close(fd)
                os.unlink(path)


if __name__ == "__main__":
    main()
