"""spillway's (de)serialization and disk time in dask's own fine performance metrics, under the
activity that caused it (what dask's dashboard shows on its fine performance metrics page): a
sender's reads for a peer under ``get-data``, a receiver's writes of values arriving by the side
channel under ``gather-dep``, a task's reads and unpickling of its inputs under ``execute``, with
dask's labels only."""

from __future__ import annotations

import os
import sys
import time

import pytest

distributed = pytest.importorskip("distributed")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "bench"))
import counted  # noqa: E402

import spillway  # noqa: E402
import spillway.dask  # noqa: E402

MiB = 1 << 20

#: The labels a worker's fine metrics may carry for spillway's work: dask's.
DASK_LABELS = {"disk-read", "disk-write", "serialize", "deserialize", "memory-read"}


def _spill_all(dask_worker):
    while dask_worker.data.fast and dask_worker.data.evict() > 0:
        pass


def _digests(dask_worker):
    return {k: v for k, v in dask_worker.digests_total.items() if isinstance(k, tuple)}


def _seconds(digests: dict, context: str, label: str) -> float:
    return sum(
        v for k, v in digests.items() if k[0] == context and k[-2:] == (label, "seconds")
    )


def test_spillways_work_shows_in_dasks_fine_metrics_under_its_activity(plugged_cluster):
    def worker(target):
        return {"data": (spillway.worker_data, {"target": target})}

    # The receiver's small target sends values arriving by the side channel straight to disk.
    spec = {"sender": worker(256 * MiB), "receiver": worker(4 * MiB)}
    with plugged_cluster(spec) as (client, addr):
        sender, receiver = addr["sender"], addr["receiver"]
        big = [client.submit(counted.make, i, 8 * MiB, key=f"big-{i}", workers=[sender]) for i in range(4)]
        small = [client.submit(counted.make, i, MiB, key=f"small-{i}", workers=[sender]) for i in range(8)]
        distributed.wait(big + small)
        client.run(_spill_all, workers=[sender])
        on_receiver = [
            client.submit(counted.digest, v, workers=[receiver], pure=False) for v in big + small
        ]
        expected = [counted.digest(counted.make(i, 8 * MiB)) for i in range(4)]
        expected += [counted.digest(counted.make(i, MiB)) for i in range(8)]
        assert client.gather(on_receiver) == expected
        # (After: the sender's own tasks would bring the small values back into memory, and its
        # peer would be sent them from there, with no read.)
        client.run(_spill_all, workers=[sender])
        on_sender = [client.submit(counted.digest, v, workers=[sender], pure=False) for v in small]
        assert client.gather(on_sender) == expected[4:]

        s = client.run(_digests, workers=[sender])[sender]
        r = client.run(_digests, workers=[receiver])[receiver]
        m = client.run(lambda dask_worker: dict(dask_worker.data.spillway_metrics), workers=[receiver])[receiver]
        assert m[("receive-disk", "count")] > 0, "nothing went to the receiver's disk on arrival"
        # The sender read spilled values for its peer: get-data.
        assert _seconds(s, "get-data", "disk-read") > 0
        # The receiver wrote values arriving by the side channel straight to disk: gather-dep.
        assert _seconds(r, "gather-dep", "disk-write") > 0
        # Tasks read their inputs from disk and unpickled them: execute.
        assert _seconds(r, "execute", "disk-read") > 0 and _seconds(r, "execute", "deserialize") > 0
        assert _seconds(s, "execute", "disk-read") > 0
        # Under dask's labels only: none of spillway's own counters reach dask's metrics.
        for digests in (s, r):
            for k in digests:
                if k[0] in ("get-data", "gather-dep") and k[-1] in ("seconds", "count", "bytes"):
                    label = k[-2]
                    assert not label.startswith(("send-", "receive-", "unpickle", "pickle-")), k
        # The scheduler aggregates them (from the workers' heartbeats) for the dashboard's fine
        # performance metrics page.
        wanted = {("gather-dep", "disk-write"), ("get-data", "disk-read"), ("execute", "deserialize")}
        deadline = time.monotonic() + 30
        while True:
            sched = client.run_on_scheduler(
                lambda dask_scheduler: list(dask_scheduler.cumulative_worker_metrics)
            )
            seen = {(k[0], k[-2]) for k in sched if isinstance(k, tuple) and k[-1] == "seconds"}
            if wanted <= seen or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert wanted <= seen, sorted(seen)
