"""What a blocked side-channel port costs a transfer: 10 spilled 8 MiB values moved between two
plugged workers (``LocalCluster``, Nanny processes), with the side channel working, with its port
blocked (a firewall that drops packets, dask's ports open), and with it off, alternating::

    python3 python/bench/side_channel_blocked.py [--rounds 3] [--values 10]

The blocked case should cost one connect timeout (``spillway.side-channel-connect-timeout``, 2 s)
more than in-band, whatever the number of values.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import counted  # noqa: E402

MiB = 1 << 20


def blackhole_side_channel(dask_worker) -> None:
    """Make this worker's side-channel references name a port that never answers: a listening
    socket whose queue is full, so that connections to it hang as behind a firewall that drops
    packets."""
    import socket

    import spillway.dask

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(0)
    port = sock.getsockname()[1]
    queued = []
    for _ in range(3):
        c = socket.socket()
        c.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            c.connect(("127.0.0.1", port))
        queued.append(c)
    spillway.dask._blackhole = (sock, queued)  # kept open for the worker's life
    spillway.dask._advertised = lambda server: ("127.0.0.1", port)


def _spill_all(dask_worker):
    while dask_worker.data.fast and dask_worker.data.evict() > 0:
        pass


def one(case: str, n: int) -> float:
    """Seconds to move ``n`` spilled 8 MiB values to the other worker, in ``case``."""
    import distributed

    import spillway
    import spillway.dask

    with (
        distributed.LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            memory_limit="1GiB",
            dashboard_address=None,
            data=spillway.worker_data,
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        client.register_plugin(spillway.dask.SpillwayPlugin(side_channel=case != "off"))
        sender, receiver = sorted(client.scheduler_info()["workers"])
        values = [
            client.submit(counted.make, i, 8 * MiB, key=f"v-{i}", workers=[sender])
            for i in range(n)
        ]
        distributed.wait(values)
        client.run(_spill_all, workers=[sender])
        if case == "blocked":
            client.run(blackhole_side_channel, workers=[sender])
        t = time.perf_counter()
        digests = client.gather(
            [client.submit(counted.digest, v, workers=[receiver], pure=False) for v in values]
        )
        took = time.perf_counter() - t
        assert digests == [counted.digest(counted.make(i, 8 * MiB)) for i in range(n)]
        return took


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--values", type=int, default=10)
    args = p.parse_args()
    cases = ["side-channel", "blocked", "off"]
    times: dict = {c: [] for c in cases}
    for r in range(args.rounds):
        for case in cases if r % 2 == 0 else reversed(cases):
            times[case].append(one(case, args.values))
            print(f"round {r} {case}: {times[case][-1]:.2f} s", flush=True)
    med = {c: statistics.median(t) for c, t in times.items()}
    for c in cases:
        print(f"{c}: median {med[c]:.2f} s ({', '.join(f'{x:.2f}' for x in times[c])})")
    print(f"blocked - off: {med['blocked'] - med['off']:+.2f} s for {args.values} values")
    return 0


if __name__ == "__main__":
    sys.exit(main())
