#!/usr/bin/env python
"""spillway.SpillBuffer against dask's own store (distributed.spill.SpillBuffer).

1. Micro-benchmark, in this process: for each value size, set N numpy arrays into a buffer whose
   target is 0 (so every value is spilled), then read them all back; ops/s and MB/s of both
   stores and the ratio spillway/dask, against the issue's targets. After an unmeasured warm-up
   pass, --loops rounds (default 2) alternate which store runs first; each store's best counts.
2. Cluster run: a LocalCluster of 2 worker processes, memory-limited so that they spill, persists
   a few GB of random dask.array data and reduces it, once with dask's default store and once
   with ``data=(spillway.worker_data, ...)``; checks that the results are identical and reports
   wall time, bytes spilled and peak worker RSS.

    python python/bench/dask_bench.py              # full run (a few minutes)
    python python/bench/dask_bench.py --quick      # short run
    python python/bench/dask_bench.py --json out.json --skip-cluster

Exit status: 1 if the two stores' results differ or a read-back value is wrong; targets that are
missed are reported, not fatal.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import resource
import shutil
import sys
import tempfile
from time import perf_counter

import numpy as np

import spillway

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

#: (size, operation) -> minimum ratio spillway/dask, from the issue.
TARGETS = {
    (4 * KiB, "spill"): 10.0,
    (4 * KiB, "unspill"): 5.0,
    (64 * KiB, "spill"): 10.0,
    (64 * KiB, "unspill"): 5.0,
    (16 * MiB, "spill"): 1.5,
    (16 * MiB, "unspill"): 1.0,
}


def parse_size(text: str) -> int:
    units = {
        "": 1,
        "B": 1,
        "K": KiB,
        "KB": KiB,
        "KIB": KiB,
        "M": MiB,
        "MB": MiB,
        "MIB": MiB,
        "G": GiB,
        "GB": GiB,
        "GIB": GiB,
    }
    t = text.strip().upper()
    digits = t.rstrip("KMGIB")
    return int(float(digits) * units[t[len(digits) :]])


def fmt_size(n: float) -> str:
    for unit, f in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= f:
            return f"{n / f:.{0 if n % f == 0 else 1}f} {unit}"
    return f"{n:.0f} B"


# --------------------------------------------------------------------------------------------------
# Micro-benchmark


class _RustStore:
    """The engine's Store (``spillway._core.Store``, dask's eviction rules, ``spillway.codec``)
    behind the few mapping calls the micro-benchmark makes: what ``SpillBuffer`` becomes as a thin
    adapter over it."""

    def __init__(self, directory: str, args):
        self.store = spillway._core.Store(
            directory, 0, compression=args.compression, backend=args.backend
        )

    def __setitem__(self, key, value) -> None:
        self.store.put(spillway.encode_key(key), value)

    def __getitem__(self, key):
        return self.store.get(spillway.encode_key(key))

    @property
    def slow(self) -> list:
        return [k for k in self.store.keys() if self.store.tier(k) == "disk"]

    def close(self) -> None:
        self.store.close()


def load_baseline(path: str):
    """The module of another build's ``buffer.py`` (``git show REV:python/spillway/buffer.py >
    FILE``), run against this build's ``spillway._core``, as ``spillway_baseline``."""
    import importlib.util

    module = sys.modules.get("spillway_baseline")
    if module is None:
        spec = importlib.util.spec_from_file_location("spillway_baseline", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["spillway_baseline"] = module
        spec.loader.exec_module(module)
    return module


def make_store(kind: str, directory: str, args):
    if kind == "store":
        return _RustStore(directory, args)
    if kind == "baseline":
        buffer = load_baseline(args.baseline).SpillBuffer
        return buffer(directory, 0, compression=args.compression, backend=args.backend)
    if kind == "dask":
        import dask
        from distributed.spill import SpillBuffer

        with dask.config.set({"distributed.worker.memory.spill-compression": False}):
            return SpillBuffer(directory, target=0)
    return spillway.SpillBuffer(directory, 0, compression=args.compression, backend=args.backend)


def make_values(size: int, n: int) -> list:
    """n distinct incompressible arrays of ``size`` bytes (each stamped with its index)."""
    base = np.frombuffer(np.random.default_rng(size).bytes(size), dtype=np.uint8)
    values = []
    for i in range(n):
        v = base.copy()
        v[:8] = np.frombuffer(i.to_bytes(8, "little"), dtype=np.uint8)
        values.append(v)
    return values


def stamp(v) -> int:
    return int.from_bytes(bytes(v[:8]), "little")


def micro_one(kind: str, size: int, n: int, args) -> dict:
    """Set n values of ``size`` bytes (all spilled), drop our references, read them all back.

    Every dirty page of the system is written back (``os.sync``, untimed) before the spill, so that
    it does not pay for the writeback of what the phase before it wrote (left to chance, the kernel
    throttles whichever writer comes next); and before the unspill with ``--written-back``."""
    directory = tempfile.mkdtemp(prefix=f"bench-{kind}-", dir=args.dir)
    store = make_store(kind, directory, args)
    try:
        values = make_values(size, n)
        gc.collect()
        os.sync()  # dirty pages written back first (untimed)
        t0 = perf_counter()
        for i, v in enumerate(values):
            store[i] = v
        spill_s = perf_counter() - t0
        del values, v  # nothing alive elsewhere: reads go to disk, not to a weak-reference cache
        gc.collect()
        if len(store.slow) != n:
            raise AssertionError(f"{kind}: {len(store.slow)} of {n} values spilled")

        if args.written_back:
            os.sync()
        t0 = perf_counter()
        for i in range(n):
            out = store[i]
        unspill_s = perf_counter() - t0
        del out
        ok = all(stamp(store[i]) == i and store[i].nbytes == size for i in {0, n // 2, n - 1})
        return {"spill_s": spill_s, "unspill_s": unspill_s, "ok": ok}
    finally:
        if kind != "dask":
            store.close()
        shutil.rmtree(directory, ignore_errors=True)


def micro_floor(size: int, n: int, args) -> dict:
    """What any store that writes each value into the page cache once and reads it back once can
    reach: one ``os.pwrite`` of each value's buffer at its offset in a new preallocated file (new
    page-cache pages, as a store's appends get), then one ``os.pread`` per value (random order)
    wrapped by ``numpy.frombuffer``. No pickling, no file per key, no bookkeeping, no checksum. Best
    of two passes, each on a file of its own."""
    directory = tempfile.mkdtemp(prefix="bench-floor-", dir=args.dir)
    try:
        values = make_values(size, n)
        order = list(range(n))
        random.Random(7).shuffle(order)
        best = {"spill_s": float("inf"), "unspill_s": float("inf"), "ok": True}
        for p in range(2):
            path = os.path.join(directory, f"floor-{p}")
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                os.posix_fallocate(fd, 0, n * size)
                gc.collect()
                os.sync()  # as in micro_one
                t0 = perf_counter()
                for i, v in enumerate(values):
                    os.pwrite(fd, v, i * size)
                best["spill_s"] = min(best["spill_s"], perf_counter() - t0)
                if args.written_back:
                    os.sync()
                t0 = perf_counter()
                for i in order:
                    out = np.frombuffer(os.pread(fd, size, i * size), dtype=np.uint8)
                best["unspill_s"] = min(best["unspill_s"], perf_counter() - t0)
                best["ok"] = best["ok"] and stamp(out) == order[-1]
            finally:
                os.close(fd)
                os.unlink(path)
        return best
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def run_micro(args) -> list[dict]:
    try:
        import distributed.spill  # noqa: F401

        kinds = ["dask", "spillway"]
    except ImportError:
        print("distributed is not installed: spillway only, no ratios")
        kinds = ["spillway"]
    if args.baseline:
        kinds.append("baseline")
    if args.with_store:
        kinds.append("store")
    rows = []
    for size in args.sizes:
        n = max(args.min_values, args.bytes_per_size // size)
        # On a VM the first pass over fresh memory (page cache, buffers) is several times slower than
        # later ones: the host backs guest pages on first touch. So one unmeasured warm-up pass runs
        # first, then --loops rounds alternate which store goes first, and each store's best round
        # per phase counts.
        micro_one(kinds[0], size, n, args)
        res: dict = {}
        for round_ in range(max(1, args.loops)):
            order = kinds[round_ % len(kinds) :] + kinds[: round_ % len(kinds)]
            for kind in order:
                r = micro_one(kind, size, n, args)
                best = res.setdefault(kind, r)
                best["spill_s"] = min(best["spill_s"], r["spill_s"])
                best["unspill_s"] = min(best["unspill_s"], r["unspill_s"])
                best["ok"] = best["ok"] and r["ok"]
        if "dask" in kinds:
            res["floor"] = micro_floor(size, n, args)
        for op in ("spill", "unspill"):
            row = {"size": size, "n": n, "op": op}
            for kind in kinds:
                s = res[kind][f"{op}_s"]
                row[f"{kind}_ops"] = n / s
                row[f"{kind}_MBps"] = n * size / s / 1e6
                row[f"{kind}_ok"] = res[kind]["ok"]
            if "dask" in kinds:
                row["ratio"] = row["spillway_ops"] / row["dask_ops"]
                row["target"] = TARGETS.get((size, op))
                row["floor_ops"] = n / res["floor"][f"{op}_s"]
                row["floor_ratio"] = row["floor_ops"] / row["dask_ops"]
            if "store" in kinds:
                row["store_vs_spillway"] = row["store_ops"] / row["spillway_ops"]
            if "baseline" in kinds:
                row["spillway_vs_baseline"] = row["spillway_ops"] / row["baseline_ops"]
            rows.append(row)
    return rows


def print_micro(rows: list[dict], written_back: bool = False) -> None:
    print(
        "\nMicro-benchmark: set N numpy values with target=0 (all spilled), then get them all back "
        "(best of the measured rounds, after a warm-up)"
        + ("; every dirty page written back before reading back" if written_back else "")
    )
    has_dask = "dask_ops" in rows[0]
    head = f"{'size':>8} {'N':>7} {'op':>8} "
    if has_dask:
        head += f"{'dask ops/s':>11} {'MB/s':>7} "
    head += f"{'spillway ops/s':>14} {'MB/s':>7}"
    if has_dask:
        head += f" {'ratio':>7} {'target':>7} {'floor':>7}"
    has_store = "store_ops" in rows[0]
    if has_store:
        head += f" {'Store ops/s':>12} {'/buffer':>8}"
    has_baseline = "baseline_ops" in rows[0]
    if has_baseline:
        head += f" {'baseline ops/s':>14} {'new/base':>8}"
    print(head)
    for r in rows:
        line = f"{fmt_size(r['size']):>8} {r['n']:>7} {r['op']:>8} "
        if has_dask:
            line += f"{r['dask_ops']:>11,.0f} {r['dask_MBps']:>7,.0f} "
        line += f"{r['spillway_ops']:>14,.0f} {r['spillway_MBps']:>7,.0f}"
        if has_dask:
            t = r["target"]
            verdict = "" if t is None else (" ok" if r["ratio"] >= t else " MISSED")
            line += f" {r['ratio']:>6.2f}x {'-' if t is None else f'{t:g}x':>7}{verdict:<7} {r['floor_ratio']:>6.2f}x"
        if has_store:
            line += f" {r['store_ops']:>12,.0f} {r['store_vs_spillway']:>7.2f}x"
        if has_baseline:
            line += f" {r['baseline_ops']:>14,.0f} {r['spillway_vs_baseline']:>7.2f}x"
        print(line)
    if has_dask:
        print(
            "floor: one os.pwrite per value into one preallocated file, then one os.pread per value "
            "(no pickling, bookkeeping or checksum): the most any store that copies each value into "
            "the page cache and back out once can reach, as a ratio against dask"
        )


# --------------------------------------------------------------------------------------------------
# Cluster run


def _worker_stats(dask_worker) -> dict:
    """Runs in each worker process (client.run)."""
    import psutil

    data = dask_worker.data
    metrics = getattr(data, "cumulative_metrics", {})
    spilled = getattr(data, "spilled_total", (0, 0))
    return {
        "store": f"{type(data).__module__}.{type(data).__name__}",
        # ru_maxrss is the peak RSS (VmHWM) of this worker process, in KiB on Linux
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "rss": psutil.Process().memory_info().rss,
        "spilled_now_memory": int(spilled[0]),
        "spilled_now_disk": int(spilled[1]),
        "disk_write_bytes": int(metrics.get(("disk-write", "bytes"), 0)),
        "disk_write_count": int(metrics.get(("disk-write", "count"), 0)),
        "disk_read_bytes": int(metrics.get(("disk-read", "bytes"), 0)),
        "disk_read_count": int(metrics.get(("disk-read", "count"), 0)),
        # seconds per activity, as each store measures them (dask's and spillway's use the same keys)
        "seconds": {k[0]: float(v) for k, v in metrics.items() if len(k) == 2 and k[1] == "seconds"},
    }


def run_cluster(store: str, args) -> dict:
    import dask
    import dask.array as da
    from distributed import Client, LocalCluster, wait

    kwargs = dict(
        n_workers=2,
        threads_per_worker=args.threads,
        processes=True,
        memory_limit=args.memory_limit,
        dashboard_address=":0",
        local_directory=args.dir,
    )
    if store == "spillway":
        kwargs["data"] = (
            spillway.worker_data,
            {
                "memory_limit": args.memory_limit,
                "compression": args.compression,
                "backend": args.backend,
            },
        )
    n, c = args.array_side, args.chunk_side
    with LocalCluster(**kwargs) as cluster, Client(cluster) as client:
        t0 = perf_counter()
        x = da.random.default_rng(42).random((n, n), chunks=(c, c))
        x = x.persist()
        wait(x)
        persisted = perf_counter() - t0
        total, col_mean = dask.compute(x.sum(), (x + x.T).mean(axis=0))
        wall = perf_counter() - t0
        workers = list(client.run(_worker_stats).values())
    return {
        "store": store,
        "wall_s": wall,
        "persist_s": persisted,
        "total": float(total),
        "col_mean": col_mean,
        "workers": workers,
    }


def print_cluster(runs: list[dict], args, identical: bool) -> None:
    n = args.array_side
    print(
        f"\nLocalCluster: 2 worker processes x {args.threads} threads, memory_limit "
        f"{fmt_size(args.memory_limit)} each; {n}x{n} float64 ({fmt_size(8 * n * n)}) persisted, "
        f"then sum() and (x + x.T).mean(axis=0)"
    )
    print(
        f"{'store':>9} {'wall s':>7} {'persist s':>9} {'spilled (written)':>18} "
        f"{'read back':>10} {'on disk at end':>15} {'peak worker RSS':>16}"
    )
    for r in runs:
        ws = r["workers"]
        print(
            f"{r['store']:>9} {r['wall_s']:>7.1f} {r['persist_s']:>9.1f} "
            f"{fmt_size(sum(w['disk_write_bytes'] for w in ws)):>18} "
            f"{fmt_size(sum(w['disk_read_bytes'] for w in ws)):>10} "
            f"{fmt_size(sum(w['spilled_now_disk'] for w in ws)):>15} "
            f"{fmt_size(max(w['peak_rss'] for w in ws)):>16}"
        )
    for r in runs:
        stores = sorted({w["store"] for w in r["workers"]})
        print(f"  {r['store']}: workers' data = {', '.join(stores)}")
    print(f"results identical: {'yes' if identical else 'NO'} (sum = {runs[0]['total']!r})")


# --------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="short run (smaller sizes and data)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON ('-' for stdout)")
    p.add_argument("--skip-micro", action="store_true")
    p.add_argument("--skip-cluster", action="store_true")
    p.add_argument(
        "--sizes",
        default="4KiB,64KiB,1MiB,16MiB",
        help="value sizes of the micro-benchmark (default %(default)s)",
    )
    p.add_argument(
        "--bytes-per-size",
        type=parse_size,
        default=None,
        help="bytes moved per size (default 256MiB, 32MiB with --quick)",
    )
    p.add_argument(
        "--min-values",
        type=int,
        default=None,
        help="values per size at least (default 64, 4 with --quick): 256 MiB is only 16 values of "
        "16 MiB, a round short enough for one VM hiccup to decide it",
    )
    p.add_argument(
        "--memory-limit",
        type=parse_size,
        default=None,
        help="per worker (default 1.5GiB, 600MiB with --quick)",
    )
    p.add_argument(
        "--array-side",
        type=int,
        default=None,
        help="side of the square array (default 20000 = 3.2 GB, 10000 with --quick)",
    )
    p.add_argument("--chunk-side", type=int, default=1000)
    p.add_argument(
        "--written-back",
        action="store_true",
        help="micro-benchmark: write every dirty page back (sync) before reading back, as a worker's "
        "spilled data is once the kernel's writeback has caught up; without it the values read back "
        "are still dirty and have no disk blocks yet, which makes dask's unlink nearly free",
    )
    p.add_argument("--threads", type=int, default=1, help="threads per worker")
    p.add_argument(
        "--baseline",
        metavar="FILE",
        help="another build's buffer.py (git show REV:python/spillway/buffer.py > FILE), measured in "
        "the same rounds as a ratio: this build's SpillBuffer over it",
    )
    p.add_argument(
        "--with-store",
        action="store_true",
        help="also the engine's Store through its binding (spillway._core.Store), as a ratio to SpillBuffer",
    )
    p.add_argument("--loops", type=int, default=2, help="measured micro-benchmark rounds per size (best counts)")
    p.add_argument("--backend", default="auto", help="spillway backend: auto, uring, portable")
    p.add_argument("--compression", default="none", help="spillway compression: none, lz4")
    p.add_argument("--dir", default=None, help="where to spill (default: the temp directory)")
    args = p.parse_args(argv)
    args.sizes = [parse_size(s) for s in args.sizes.split(",")]
    if args.min_values is None:
        args.min_values = 4 if args.quick else 64
    if args.bytes_per_size is None:
        args.bytes_per_size = 32 * MiB if args.quick else 256 * MiB
    if args.memory_limit is None:
        args.memory_limit = 600 * MiB if args.quick else int(1.5 * GiB)
    if args.array_side is None:
        args.array_side = 10000 if args.quick else 20000

    print(
        f"spillway {spillway.__version__}, python {sys.version.split()[0]}, numpy {np.__version__}"
    )
    out: dict = {"args": {k: v for k, v in vars(args).items()}}
    status = 0

    if not args.skip_micro:
        rows = run_micro(args)
        print_micro(rows, args.written_back)
        out["micro"] = rows
        if not all(v for r in rows for k, v in r.items() if k.endswith("_ok")):
            print("A value read back was wrong")
            status = 1

    if not args.skip_cluster:
        runs = [run_cluster(store, args) for store in ("default", "spillway")]
        a, b = runs
        identical = a["total"] == b["total"] and np.array_equal(a["col_mean"], b["col_mean"])
        print_cluster(runs, args, identical)
        for r in runs:
            r["col_mean_checksum"] = float(np.sum(r.pop("col_mean")))
        out["cluster"] = {"runs": runs, "identical": identical}
        if not identical:
            status = 1

    if args.json:
        text = json.dumps(out, indent=2)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
