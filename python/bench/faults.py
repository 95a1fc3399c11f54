"""The fault run: spilled values moving between workers (by the side channel and in-band) while a
worker is killed with SIGKILL, links drop packets and one goes down for a moment, on dask's store
and on spillway + plugin, alternating, in one invocation. Each run's results are compared with
the ones computed without a cluster, and every phase has a deadline: a task left hanging fails the
run instead of stalling it.

Workers are ``dask worker`` processes under their nannies, each in a network namespace of its own
on a 1 Gbit/s link (``netns.py``: the cluster harness's honest network). This kernel has no
``netem``: packets are dropped by an nftables rule in each worker's namespace (a random share of
every TCP packet in and out), and a link flap sets a worker's link down and up again. Needs root,
``ip``, ``tc`` and ``nft``.

    sudo python python/bench/faults.py --runs 3          # docs/benchmarks.md, "The fault run"

Per run: ``values`` values of ``value_mib`` MiB made on worker 0 and spilled there (their store's
target is a few values), then read by tasks pinned to the other workers (each value moves once,
on disk at the sender: over ``side-channel-min-bytes`` it goes by the side channel on spillway),
and small values moved in-band the same way; in the middle of the moves, worker 0's process is
killed (its nanny restarts it; dask recomputes what was lost) and a receiver's link flaps.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
import counted  # noqa: E402
import netns  # noqa: E402

# The `dask worker` processes import `counted` by name too.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_HERE, os.environ.get("PYTHONPATH")]))

MiB = 1 << 20


def _nft(ns: str, *args: str) -> None:
    subprocess.run(["ip", "netns", "exec", ns, "nft", *args], check=True, capture_output=True)


def drop_packets(n: int, per_mille: int) -> None:
    """Drop ``per_mille`` / 1000 of the TCP packets into and out of each worker's namespace."""
    for i in range(n):
        ns = netns._ns(i)
        _nft(ns, "add", "table", "inet", "faults")
        for hook in ("input", "output"):
            _nft(ns, "add", "chain", "inet", "faults", hook,
                 f"{{ type filter hook {hook} priority 0 ; }}")
            _nft(ns, "add", "rule", "inet", "faults", hook, "meta", "l4proto", "tcp",
                 "numgen", "random", "mod", "1000", "<", str(per_mille), "drop")


def flap(i: int, seconds: float) -> None:
    """Worker ``i``'s link down for ``seconds``, then up again."""
    host = f"spwb-h{i}"
    subprocess.run(["ip", "link", "set", host, "down"], check=True)
    time.sleep(seconds)
    subprocess.run(["ip", "link", "set", host, "up"], check=True)


def _spill_all(dask_worker):
    n = 0
    while dask_worker.data.fast and dask_worker.data.evict() > 0:
        n += 1
    return n


_SIDE_LABELS = ("receive-memory", "receive-disk", "receive-side-failed", "receive-serialized")


def _side_counts(dask_worker) -> dict:
    """How many values this worker received by the side channel (into memory, to disk), fetches of
    it that failed, and values received in-band still pickled."""
    m = dask_worker.data.spillway_metrics
    return {label: m.get((label, "count"), 0) for label in _SIDE_LABELS}


def one_run(store: str, args, rng: random.Random, directory: str) -> dict:
    """One run on ``store``: completed or not, results identical or not, faults injected, times."""
    import distributed

    faults = {"sigkill": 0, "flaps": 0, "drop_per_mille": args.drop_per_mille}
    out = {"store": store, "faults": faults, "completed": False, "identical": False}
    start = time.monotonic()
    with netns.NetCluster(args.workers, args.memory_limit, store, "1gbit", directory,
                          threads=2) as cluster, distributed.Client(cluster.scheduler_address,
                                                                     timeout=60) as client:
        drop_packets(args.workers, args.drop_per_mille)
        addresses = sorted(client.scheduler_info()["workers"],
                           key=lambda a: client.scheduler_info()["workers"][a]["name"])
        sender, receivers = addresses[0], addresses[1:]
        big = [client.submit(counted.make, i, args.value_mib * MiB, key=f"big-{i}",
                             workers=[sender], allow_other_workers=True)
               for i in range(args.values)]
        small = [client.submit(counted.make, 1000 + i, 256 << 10, key=f"small-{i}",
                               workers=[sender], allow_other_workers=True)
                 for i in range(args.values)]
        distributed.wait(big + small, timeout=args.deadline)
        client.run(_spill_all, workers=[sender])
        moves = [client.submit(counted.digest, v, key=f"use-{v.key}", workers=[receivers[j % len(receivers)]],
                               allow_other_workers=True, pure=False)
                 for j, v in enumerate(big + small)]

        def inject():
            time.sleep(rng.uniform(0.05, 0.6))
            pid = cluster.workers["0"].pid
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                faults["sigkill"] += 1
            time.sleep(rng.uniform(0.1, 0.5))
            flap(1 + rng.randrange(len(receivers)), args.flap_seconds)
            faults["flaps"] += 1

        injector = threading.Thread(target=inject)
        injector.start()
        try:
            distributed.wait(moves, timeout=args.deadline)
            got = client.gather(moves)
            out["completed"] = True
        except Exception as e:  # a deadline passed, or a task erred: this run failed
            out["error"] = f"{type(e).__name__}: {e}"[:300]
            got = None
        finally:
            injector.join()
        expected = [counted.digest(counted.make(i, args.value_mib * MiB)) for i in range(args.values)]
        expected += [counted.digest(counted.make(1000 + i, 256 << 10)) for i in range(args.values)]
        out["identical"] = got == expected
        out["restarts"] = cluster.kills()
        if store != "dask":
            m = client.run(_side_counts, workers=receivers)
            out["side"] = {k: sum(x.get(k, 0) for x in m.values()) for k in _SIDE_LABELS}
        out["seconds"] = round(time.monotonic() - start, 1)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3, help="runs per store (alternated)")
    p.add_argument("--stores", default="dask,spillway+plugin")
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--memory-limit", type=int, default=600 * MiB)
    p.add_argument("--values", type=int, default=24)
    p.add_argument("--value-mib", type=int, default=8)
    p.add_argument("--drop-per-mille", type=int, default=10, help="packets dropped, per 1000")
    p.add_argument("--flap-seconds", type=float, default=2.0)
    p.add_argument("--deadline", type=float, default=300.0, help="seconds a phase may take")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the runs here")
    args = p.parse_args()
    rng = random.Random(args.seed)
    runs = []
    for _ in range(args.runs):
        for store in args.stores.split(","):
            with tempfile.TemporaryDirectory() as d:
                r = one_run(store, args, rng, d)
            print(json.dumps(r), flush=True)
            runs.append(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)
    print("\n| store | runs | completed | identical | SIGKILLs | link flaps | packets dropped | restarts (memory) | median s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for store in args.stores.split(","):
        rs = [r for r in runs if r["store"] == store]
        secs = sorted(r["seconds"] for r in rs)
        print(f"| {store} | {len(rs)} | {sum(r['completed'] for r in rs)} | "
              f"{sum(r['identical'] for r in rs)} | {sum(r['faults']['sigkill'] for r in rs)} | "
              f"{sum(r['faults']['flaps'] for r in rs)} | {args.drop_per_mille / 10:.1f}% | "
              f"{sum(r['restarts'] for r in rs)} | {secs[len(secs) // 2]} |")


if __name__ == "__main__":
    main()
