#!/usr/bin/env python
"""The cost of a get of a value held as frames in memory (what a worker with ``spillway.dask``
holds for a value a peer sent, until a task asks for it), against ``pickle.loads`` of the same
frames: per value size, the median over ``--values`` values, for ``writeable`` on (dask's arrays
must be writeable: a read-only frame is copied once) and off.

    python python/bench/held_get.py                 # 4 KiB, 1 MiB and 4 MiB float64 arrays
    python python/bench/held_get.py --sizes 4194304 --values 256
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import tempfile
import time

import numpy as np

import spillway


def frames_of(a: np.ndarray) -> list:
    """Pickle-5 frames as dask's comm delivers them: writeable memoryviews of its own buffers."""
    bufs: list = []
    header = pickle.dumps(a, protocol=5, buffer_callback=bufs.append)
    return [header] + [memoryview(bytearray(b.raw())) for b in bufs]


def measure(nbytes: int, values: int, writeable: bool) -> tuple:
    a = np.random.default_rng(0).random(nbytes // 8)
    buf = spillway.SpillBuffer(tempfile.mkdtemp(), target=1 << 40, writeable=writeable)
    got, loads = [], []
    try:
        for i in range(values):
            buf.set_serialized(i, frames_of(a))
            t0 = time.perf_counter()
            v = buf[i]
            got.append(time.perf_counter() - t0)
            assert v.shape == a.shape and (v.flags.writeable or not writeable)
            fr = frames_of(a)
            t0 = time.perf_counter()
            pickle.loads(fr[0], buffers=fr[1:])
            loads.append(time.perf_counter() - t0)
            del buf[i]
    finally:
        buf.close()
    return statistics.median(got), statistics.median(loads)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="4096,1048576,4194304", help="comma-separated value sizes (bytes)")
    p.add_argument("--values", type=int, default=128)
    args = p.parse_args(argv)
    print("bytes | writeable | get of held frames (ms) | pickle.loads (ms)")
    for n in (int(x) for x in args.sizes.split(",")):
        for writeable in (True, False):
            g, l = measure(n, args.values, writeable)
            print(f"{n} | {writeable} | {g * 1e3:.3f} | {l * 1e3:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
