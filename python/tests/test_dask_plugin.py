"""``spillway.dask``: values move between spillway workers still pickled, on real clusters.

Values are ``counted.Counted`` (``python/bench/counted.py``), a Python type that counts, in each
worker process, how often it is pickled and unpickled: what a worker did to a value shows in those
counts, whatever path moved it.
"""

from __future__ import annotations

import logging
import os
import sys
import urllib.request

import pytest

distributed = pytest.importorskip("distributed")
import dask  # noqa: E402
np = pytest.importorskip("numpy")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "bench"))
import counted  # (worker processes import it by name: they inherit sys.path)

import spillway
import spillway.dask

MiB = 1 << 20


def _cluster(n_workers=2, memory_limit="400MiB", processes=True, **kwargs):
    if not processes:
        # Workers in this process would watch the memory of the whole test process: past 80% of
        # their limit they pause and run nothing (a pytest process that ran the cluster tests
        # before is near that). No memory monitor, then, and the store's target given as a number.
        kwargs.setdefault("data", (spillway.worker_data, {"target": 256 * MiB}))
        memory_limit = 0
    kwargs.setdefault("data", (spillway.worker_data, {"memory_limit": memory_limit}))
    return distributed.LocalCluster(
        n_workers=n_workers,
        threads_per_worker=2,
        processes=processes,
        memory_limit=memory_limit,
        dashboard_address=None,
        **kwargs,
    )


def _counts(client, workers):
    return client.run(counted.counts, workers=workers)


def _spill_all(dask_worker):
    """Evict everything a worker holds in memory (what can be)."""
    while dask_worker.data.fast and dask_worker.data.evict() > 0:
        pass


def _metrics(dask_worker):
    return {f"{k[0]} {k[1]}": v for k, v in dask_worker.data.spillway_metrics.items()}


def _prometheus(client, worker) -> str:
    """The worker's Prometheus endpoint, as a scraper reads it."""
    port = client.run(lambda dask_worker: dask_worker.http_server.port, workers=[worker])[worker]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        return r.read().decode()


def _plugged(dask_worker):
    return getattr(dask_worker.handlers["get_data"], "stock", None) is not None


def _make_on(client, worker, n, nbytes, prefix="v"):
    futures = [
        client.submit(counted.make, i, nbytes, key=f"{prefix}-{i}", workers=[worker])
        for i in range(n)
    ]
    distributed.wait(futures)
    return futures


def test_a_retired_workers_values_move_still_pickled_and_are_unpickled_once_when_used():
    """Most of the sender's values are spilled. Moving them to the other worker (retire_workers, the
    Active Memory Manager's path) unpickles nothing on either side and pickles only the values the
    sender held as objects; two tasks per value on the receiver unpickle each value once."""
    with _cluster() as cluster, distributed.Client(cluster) as client:
        client.register_plugin(spillway.dask.SpillwayPlugin())
        assert all(client.run(_plugged).values())
        sender, receiver = sorted(client.scheduler_info()["workers"])
        n = 96  # 96 MiB: more than the sender's store keeps in memory after the tasks' churn
        values = _make_on(client, sender, n, MiB)
        client.run(
            _spill_all, workers=[sender]
        )
        in_memory = client.run(lambda dask_worker: len(dask_worker.data.fast), workers=[sender])[
            sender
        ]
        before = _counts(client, [sender, receiver])
        client.sync(
            client.scheduler.retire_workers, workers=[sender], close_workers=False, remove=False
        )
        moved = _counts(client, [sender, receiver])
        assert moved[sender][1] - before[sender][1] == 0, "the sender unpickled"
        assert moved[sender][0] - before[sender][0] <= in_memory, (
            "the sender pickled spilled values"
        )
        assert moved[receiver] == before[receiver], "the receiver pickled or unpickled"
        m = client.run(_metrics, workers=[receiver])[receiver]
        assert m["receive-serialized count"] == n and m["unpickle-avoided count"] == n
        s = client.run(_metrics, workers=[sender])[sender]
        assert s["send-serialized count"] >= n - in_memory
        # dask's spill metrics carry dask's activities only, as on a stock worker.
        scraped = _prometheus(client, receiver)
        assert "# TYPE dask_worker_spill_count_total counter" in scraped
        assert 'activity="receive-serialized"' not in scraped

        uses = [
            client.submit(counted.digest, v, key=f"use-{j}-{i}", workers=[receiver], pure=False)
            for i, v in enumerate(values)
            for j in range(2)
        ]
        got = client.gather(uses)
        used = _counts(client, [receiver])[receiver]
        # Once each, but for a value the receiver's memory rules evicted between its two uses (its
        # RSS past the spill threshold), which is pickled out and read back: one more unpickle each.
        evicted = used[0] - moved[receiver][0]
        unpickled = used[1] - moved[receiver][1]
        assert n <= unpickled <= n + evicted, ("each value unpickled once on the receiver", evicted)
        assert got == [counted.digest(counted.make(i, MiB)) for i in range(n) for _ in range(2)]


def test_a_stock_client_gathers_real_objects_from_spillway_workers():
    """``client.gather`` (and a client in the same process as the workers) never sees frames."""
    for processes in (True, False):
        with _cluster(processes=processes) as cluster, distributed.Client(cluster) as client:
            client.register_plugin(spillway.dask.SpillwayPlugin())
            (worker,) = sorted(client.scheduler_info()["workers"])[:1]
            values = _make_on(client, worker, 8, MiB)
            client.run(_spill_all)
            got = client.gather(values)
            assert all(type(v) is counted.Counted for v in got)
            assert got == [counted.make(i, MiB) for i in range(8)]


def test_a_mixed_cluster_of_a_spillway_and_a_stock_worker():
    """Values cross between a spillway worker with the plugin and a stock worker (dask's own
    store) both ways, numpy arrays from spillway's fast path included: right results, and the
    spillway worker keeps nothing it got from the stock one as frames (dask serialized it)."""
    from distributed import Nanny, Scheduler, SpecCluster

    spec = {
        "spillway": {
            "cls": Nanny,
            "options": {
                "nthreads": 1,
                "memory_limit": "400MiB",
                "data": (spillway.worker_data, {"memory_limit": "400MiB"}),
            },
        },
        "stock": {"cls": Nanny, "options": {"nthreads": 1, "memory_limit": "400MiB"}},
    }
    scheduler = {"cls": Scheduler, "options": {"dashboard_address": None}}
    with (
        SpecCluster(workers=spec, scheduler=scheduler) as cluster,
        distributed.Client(cluster) as client,
    ):
        client.register_plugin(spillway.dask.SpillwayPlugin())
        plugged = client.run(_plugged)
        info = client.scheduler_info()["workers"]
        addr = {ws["name"]: a for a, ws in info.items()}
        assert plugged == {addr["spillway"]: True, addr["stock"]: False}

        arrays = [
            client.submit(np.full, (256, 256), i, key=f"a-{i}", workers=[addr["spillway"]])
            for i in range(8)
        ]
        mine = _make_on(client, addr["spillway"], 8, 64 << 10, prefix="s")
        theirs = _make_on(client, addr["stock"], 8, 64 << 10, prefix="o")
        distributed.wait(arrays)
        client.run(
            _spill_all,
            workers=[addr["spillway"]],
        )
        # The stock worker takes the spillway worker's spilled arrays (their frames are spillway's
        # numpy fast path: it gets numpy's own pickle of them, on the same buffers) and objects
        # (plain pickle frames, sent as they are); the spillway worker takes the stock worker's
        # objects (deserialized as stock).
        sums = [client.submit(np.sum, a, workers=[addr["stock"]], pure=False) for a in arrays]
        to_stock = [
            client.submit(counted.digest, o, workers=[addr["stock"]], pure=False) for o in mine
        ]
        to_me = [
            client.submit(counted.digest, o, workers=[addr["spillway"]], pure=False) for o in theirs
        ]
        expected = [counted.digest(counted.make(i, 64 << 10)) for i in range(8)]
        assert client.gather(sums) == [i * 256 * 256 for i in range(8)]
        assert client.gather(to_stock) == expected and client.gather(to_me) == expected
        m = client.run(_metrics, workers=[addr["spillway"]])[addr["spillway"]]
        assert m.get("receive-serialized count", 0) == 0
        assert m.get("send-serialized count", 0) == 16  # arrays and objects, never unpickled


def test_preload_turns_the_plugin_on():
    with (
        _cluster(n_workers=1, preload=["spillway.dask"]) as cluster,
        distributed.Client(cluster) as c,
    ):
        assert list(c.run(_plugged).values()) == [True]


def test_a_worker_whose_data_is_not_a_spillbuffer_stays_stock(caplog):
    caplog.set_level(logging.WARNING, logger="spillway.dask")
    with (
        _cluster(n_workers=1, processes=False, data=dict) as cluster,
        distributed.Client(cluster) as c,
    ):
        c.register_plugin(spillway.dask.SpillwayPlugin())
        assert list(c.run(_plugged).values()) == [False]
    assert any("not a spillway.SpillBuffer" in r.getMessage() for r in caplog.records)


def test_a_send_whose_preparation_fails_goes_the_stock_way(monkeypatch):
    refused = []

    def refuse(*args, **kwargs):
        refused.append(args[1])
        raise RuntimeError("preparation failed")

    monkeypatch.setattr(spillway.dask, "_serialized_values", refuse)
    # Workers in this process (so that they see the patch) that talk over TCP, as separate
    # processes do: in-process comms go the stock way without preparing anything.
    with (
        _cluster(processes=False, protocol="tcp://", host="127.0.0.1") as cluster,
        distributed.Client(cluster) as client,
    ):
        client.register_plugin(spillway.dask.SpillwayPlugin())
        a, b = sorted(client.scheduler_info()["workers"])
        values = _make_on(client, a, 4, 64 << 10)
        crcs = [client.submit(counted.digest, v, workers=[b], pure=False) for v in values]
        assert client.gather(crcs) == [counted.digest(counted.make(i, 64 << 10)) for i in range(4)]
        assert refused, "the plugged sender never prepared a send"
        m = client.run(_metrics, workers=[b])[b]
        assert m.get("receive-serialized count", 0) == 0  # dask pickled them its own way


def test_large_scattered_values_stay_pickled_until_a_task_uses_them():
    """``client.scatter(..., broadcast=True)``: the large values a client sends each worker
    directly (the scheduler's ``update_data``) and the copies the workers then make of each other's
    are all kept pickled on arrival; a task on each worker unpickles each value once there. Small
    ones are unpickled on arrival, as dask does (their size as the scheduler records it is dask's
    ``sizeof`` of the object)."""
    threshold = dask.utils.parse_bytes(dask.config.get("distributed.comm.offload"))
    with _cluster(n_workers=3, memory_limit="800MiB") as cluster, distributed.Client(cluster) as client:
        client.register_plugin(spillway.dask.SpillwayPlugin())
        workers = sorted(client.scheduler_info()["workers"])
        before = _counts(client, workers)
        values = [counted.make(i, threshold + MiB) for i in range(4)]
        futures = client.scatter(values, broadcast=True)
        assert all(len(holders) == 3 for holders in client.who_has(futures).values())
        after = _counts(client, workers)
        assert {w: after[w][1] - before[w][1] for w in workers} == dict.fromkeys(workers, 0)
        m = client.run(_metrics)
        assert sum(x.get("receive-scattered count", 0) for x in m.values()) == 4
        digests = [
            client.submit(counted.digest, f, workers=[w], pure=False) for w in workers for f in futures
        ]
        assert client.gather(digests) == [counted.digest(v) for _ in workers for v in values]
        used = _counts(client, workers)
        assert {w: used[w][1] - after[w][1] for w in workers} == dict.fromkeys(workers, 4)

        small = client.scatter([counted.make(9, 1000)], broadcast=True)
        assert client.run(counted.counts, workers=workers) != used, "small values unpickle on arrival"
        nbytes = client.run_on_scheduler(lambda dask_scheduler, k=small[0].key: dask_scheduler.tasks[k].nbytes)
        assert nbytes == dask.sizeof.sizeof(counted.make(9, 1000))
