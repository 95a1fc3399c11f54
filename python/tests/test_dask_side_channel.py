"""``spillway.dask``'s side channel: large spilled values go to plugged peers by the spillway
transfer server, on real clusters (Nanny processes, real memory limits).

Values are ``counted.Counted`` (``python/bench/counted.py``), which count, in each worker process,
how often they are pickled and unpickled.
"""

from __future__ import annotations

import os
import sys

import pytest

distributed = pytest.importorskip("distributed")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "bench"))
import counted  # (worker processes import it by name: they inherit sys.path)
import side_channel_blocked

import spillway
import spillway.dask

MiB = 1 << 20


def _cluster(n_workers=2, memory_limit="400MiB", **kwargs):
    kwargs.setdefault("data", (spillway.worker_data, {"memory_limit": memory_limit}))
    return distributed.LocalCluster(
        n_workers=n_workers,
        threads_per_worker=2,
        memory_limit=memory_limit,
        dashboard_address=None,
        **kwargs,
    )


def _metrics(dask_worker):
    return {f"{k[0]} {k[1]}": v for k, v in dask_worker.data.spillway_metrics.items()}


def _spill_all(dask_worker):
    while dask_worker.data.fast and dask_worker.data.evict() > 0:
        pass
    return len(dask_worker.data.slow)


def _make_on(client, worker, n, nbytes):
    futures = [
        client.submit(counted.make, i, nbytes, key=f"v-{i}", workers=[worker]) for i in range(n)
    ]
    distributed.wait(futures)
    return futures


def _retire(client, worker):
    client.sync(client.scheduler.retire_workers, workers=[worker], close_workers=False, remove=False)


def _pids(client):
    """Each worker's process id: a worker that died and was restarted by its nanny has another."""
    return client.run(os.getpid)


def test_spilled_values_move_by_the_side_channel_into_memory_and_to_disk():
    """A retired worker's spilled values of 8 MiB go to the other worker by the side channel,
    unpickled by neither. The receiver keeps those that fit under its target in memory and writes
    the rest straight to its log; every value reads back as it was, unpickled once."""
    with _cluster() as cluster, distributed.Client(cluster) as client:
        client.register_plugin(spillway.dask.SpillwayPlugin())
        sender, receiver = sorted(client.scheduler_info()["workers"])
        pids = _pids(client)
        n = 40  # 320 MiB: more than the receiver's target (240 MiB) holds
        values = _make_on(client, sender, n, 8 * MiB)
        assert client.run(_spill_all, workers=[sender])[sender] == n
        before = client.run(counted.counts)
        _retire(client, sender)
        after = client.run(counted.counts)
        assert after == before, "a worker pickled or unpickled a value as it moved"
        s = client.run(_metrics, workers=[sender])[sender]
        r = client.run(_metrics, workers=[receiver])[receiver]
        assert s["send-side count"] == n
        memory, disk = r.get("receive-memory count", 0), r.get("receive-disk count", 0)
        assert memory + disk == n and memory > 0 and disk > 0, r
        assert r["receive-serialized count"] == n
        held = client.run(
            lambda dask_worker: (len(dask_worker.data.fast), len(dask_worker.data.slow)),
            workers=[receiver],
        )[receiver]
        assert held[1] >= disk and sum(held) == n
        assert client.run(lambda dask_worker: spillway.dask._plugs[dask_worker].side[0].live_grants) == {
            sender: 0,
            receiver: 0,
        }, "every ticket was redeemed or revoked"

        got = client.gather(
            [client.submit(counted.digest, v, workers=[receiver], pure=False) for v in values]
        )
        assert got == [counted.digest(counted.make(i, 8 * MiB)) for i in range(n)]
        used = client.run(counted.counts, workers=[receiver])[receiver]
        assert used[1] - after[receiver][1] == n, "each value unpickled once on the receiver"
        assert _pids(client) == pids, "a worker was restarted"


class _ForgedTickets:
    """A transfer server that hands out tickets it never made: every fetch of one is refused."""

    def __init__(self, server):
        self.server = server
        self.address = server.address

    def grant(self, log, key, peer=None):
        return os.urandom(24) if key in log else None

    def revoke(self, ticket):
        return False

    def close(self):
        self.server.close()


def _break_side_channel(dask_worker):
    plug = spillway.dask._plugs[dask_worker]
    server, min_bytes = plug.side
    plug.side = (_ForgedTickets(server), min_bytes)


def test_a_failed_side_fetch_falls_back_in_band():
    """With the sender's tickets refused by its own server, the first side fetch fails and the
    values are asked for again in-band: everything arrives, intact, and no worker or task is
    marked failed. The sender's side channel is not tried again for a while: the reply's other
    references and the later requests go in-band at once."""
    with _cluster() as cluster, distributed.Client(cluster) as client:
        client.register_plugin(spillway.dask.SpillwayPlugin())
        sender, receiver = sorted(client.scheduler_info()["workers"])
        pids = _pids(client)
        n = 6
        values = _make_on(client, sender, n, 8 * MiB)
        client.run(_spill_all, workers=[sender])
        client.run(_break_side_channel, workers=[sender])
        got = client.gather(
            [client.submit(counted.digest, v, workers=[receiver], pure=False) for v in values]
        )
        assert got == [counted.digest(counted.make(i, 8 * MiB)) for i in range(n)]
        r = client.run(_metrics, workers=[receiver])[receiver]
        assert r.get("receive-memory count", 0) + r.get("receive-disk count", 0) == 0
        assert r["receive-serialized count"] == n, "the values came in-band, still pickled"
        s = client.run(_metrics, workers=[sender])[sender]
        # Granted: the references of the first reply only (one fetch failed, the rest went
        # in-band without trying); each granted value was then sent again in-band.
        assert 1 <= s["send-side count"] < n
        assert s["send-serialized count"] == n + s["send-side count"]
        blocked = client.run(
            lambda dask_worker, peer=sender: spillway.dask._unreachable.blocked(peer),
            workers=[receiver],
        )[receiver]
        assert blocked, "the receiver does not remember that the side channel failed"
        assert _pids(client) == pids, "a worker was restarted"


def test_small_values_and_a_plugin_without_the_side_channel_go_in_band():
    with _cluster() as cluster, distributed.Client(cluster) as client:
        client.register_plugin(spillway.dask.SpillwayPlugin(side_channel_min_bytes=16 * MiB))
        sender, receiver = sorted(client.scheduler_info()["workers"])
        values = _make_on(client, sender, 4, 8 * MiB)
        client.run(_spill_all, workers=[sender])
        _retire(client, sender)
        s = client.run(_metrics, workers=[sender])[sender]
        assert s.get("send-side count", 0) == 0 and s["send-serialized count"] == 4
        assert client.gather(
            [client.submit(counted.digest, v, workers=[receiver], pure=False) for v in values]
        ) == [counted.digest(counted.make(i, 8 * MiB)) for i in range(4)]

    with _cluster() as cluster, distributed.Client(cluster) as client:
        client.register_plugin(spillway.dask.SpillwayPlugin(side_channel=False))
        assert not any(client.run(lambda dask_worker: spillway.dask.status(dask_worker)["side_channel"] is not None).values())


def test_the_side_channel_is_off_where_it_cannot_run():
    """In-process workers (inproc://) and clusters that require encryption send in-band."""
    with (
        distributed.LocalCluster(
            n_workers=1,
            processes=False,
            memory_limit=0,
            dashboard_address=None,
            data=(spillway.worker_data, {"target": 64 * MiB}),
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        client.register_plugin(spillway.dask.SpillwayPlugin())
        w = next(iter(cluster.workers.values()))
        assert spillway.dask.status(w)["plugin"]
        assert spillway.dask.status(w)["side_channel"] is None
        assert "inproc" in spillway.dask._side_channel_off(w)

    class Encrypted:
        address = "tcp://127.0.0.1:1234"
        security = distributed.Security(require_encryption=False)

    assert spillway.dask._side_channel_off(Encrypted) == ""
    Encrypted.security.require_encryption = True
    assert "encryption" in spillway.dask._side_channel_off(Encrypted)


def test_a_side_channel_port_that_never_answers_costs_one_connect_timeout_per_peer():
    """A firewall that drops the side channel's packets (its port blocked, dask's open): the first
    fetch waits out the connect timeout (2 s by default), and the peer's values, those of the
    same reply included, come in-band from then on without another attempt."""
    with _cluster() as cluster, distributed.Client(cluster) as client:
        client.register_plugin(spillway.dask.SpillwayPlugin())
        sender, receiver = sorted(client.scheduler_info()["workers"])
        n = 10
        values = _make_on(client, sender, n, 8 * MiB)
        client.run(_spill_all, workers=[sender])
        client.run(side_channel_blocked.blackhole_side_channel, workers=[sender])
        got = client.gather(
            [client.submit(counted.digest, v, workers=[receiver], pure=False) for v in values]
        )
        assert got == [counted.digest(counted.make(i, 8 * MiB)) for i in range(n)]
        r = client.run(_metrics, workers=[receiver])[receiver]
        assert r["receive-side-failed count"] == 1, "one attempt, then in-band"
        assert r["receive-serialized count"] == n


def test_a_tls_cluster_moves_spilled_values_in_band_still_pickled():
    """A real TLS cluster (``Security.temporary()``: dask requires encryption): the side channel,
    which does not encrypt, is off, and spilled values move between plugged workers in-band under
    dask's TLS, still pickled, with the right results."""
    from distributed import Security

    security = Security.temporary()
    with (
        distributed.LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            memory_limit="400MiB",
            protocol="tls://",
            security=security,
            dashboard_address=None,
            data=spillway.worker_data,
        ) as cluster,
        distributed.Client(cluster, security=security) as client,
    ):
        client.register_plugin(spillway.dask.SpillwayPlugin())
        sender, receiver = sorted(client.scheduler_info()["workers"])
        assert sender.startswith("tls://")
        assert client.run(lambda dask_worker: spillway.dask.status(dask_worker)["side_channel"] is not None) == {
            sender: False,
            receiver: False,
        }
        n = 6
        values = _make_on(client, sender, n, 8 * MiB)
        client.run(_spill_all, workers=[sender])
        got = client.gather(
            [client.submit(counted.digest, v, workers=[receiver], pure=False) for v in values]
        )
        assert got == [counted.digest(counted.make(i, 8 * MiB)) for i in range(n)]
        r = client.run(_metrics, workers=[receiver])[receiver]
        assert r["receive-serialized count"] == n, "in-band, still pickled"
        assert r.get("receive-memory count", 0) + r.get("receive-disk count", 0) == 0
