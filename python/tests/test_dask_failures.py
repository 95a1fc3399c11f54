"""What a plugged dask worker does off the happy path, on real clusters: an input that cannot be
unpickled, a request it refuses, a spill compression spillway has not, large values arriving,
and what the plugin leaves behind in the process and shows to dask's tools."""

from __future__ import annotations

import operator
import socket
import threading

import pytest

distributed = pytest.importorskip("distributed")
np = pytest.importorskip("numpy")

import dask  # noqa: E402
import faulty  # noqa: E402  (worker processes import it by name: they inherit sys.path)
import spillway  # noqa: E402
import spillway.dask  # noqa: E402

MiB = 1 << 20


def _cluster(n_workers=2, **kwargs):
    """A LocalCluster of Nanny workers (1 GiB, dask's default thresholds) on spillway and its plugin,
    turned on as users do: ``preload_nanny=["spillway.dask"]``."""
    kwargs.setdefault("preload_nanny", ["spillway.dask"])
    kwargs.setdefault("memory_limit", "1GiB")
    return distributed.LocalCluster(
        n_workers=n_workers, threads_per_worker=1, dashboard_address=None, **kwargs
    )


def _status(dask_worker):
    return spillway.dask.status(dask_worker)


def _spill(keys, dask_worker=None):
    for key in keys:
        while dask_worker.data.tier(key) != "disk" and dask_worker.data.evict() > 0:
            pass
    return [dask_worker.data.tier(k) for k in keys]


def _metrics(dask_worker):
    return {f"{k[0]} {k[1]}": v for k, v in dask_worker.data.spillway_metrics.items()}


def test_a_task_whose_input_cannot_be_unpickled_errs_with_that_error():
    """A value made on one worker that cannot be unpickled on the other, used by a task there (one
    thread), in-band and by the side channel: the task errs with the unpickling error, as a task
    whose function raises does, and the worker's thread is free for the next task."""
    with _cluster() as cluster, distributed.Client(cluster) as client:
        a, b = sorted(client.scheduler_info()["workers"])
        small = client.submit(faulty.Unloadable, 1000, key="small", workers=[a])
        large = client.submit(faulty.Unloadable, 8 * MiB, key="large", workers=[a])
        distributed.wait([small, large])
        assert client.run(_spill, ["large"], workers=[a])[a] == ["disk"]
        for x in (small, large):
            f = client.submit(faulty.use, x, workers=[b], pure=False)
            with pytest.raises(faulty.CannotUnpickle, match="cannot be unpickled"):
                f.result(timeout=60)
        m = client.run(_metrics, workers=[b])[b]
        assert m.get("receive-memory count", 0) + m.get("receive-disk count", 0) == 1, "by the side channel"
        assert client.submit(operator.add, 1, 2, workers=[b], pure=False).result(timeout=60) == 3


async def _ask(peer, key, dask_worker=None):
    """A get_data request to ``peer``, as a peer makes it."""
    return await dask_worker.rpc(peer).get_data(keys=[key], who=dask_worker.address)


def test_a_refused_request_reads_nothing():
    """A worker at its limit of outgoing transfers answers busy before anything is read from disk
    or moved into memory for the reply; once it has room, the value goes."""
    with _cluster() as cluster, distributed.Client(cluster) as client:
        a, b = sorted(client.scheduler_info()["workers"])
        x = client.submit(np.full, 4 * MiB, 7, dtype="u1", key="x", workers=[a])
        distributed.wait(x)
        assert client.run(_spill, ["x"], workers=[a])[a] == ["disk"]

        def refuse(limit, dask_worker=None):
            dask_worker.transfer_outgoing_count_limit = limit
            return _metrics(dask_worker).get("disk-read count", 0)

        reads = client.run(refuse, 0, workers=[a])[a]
        assert client.run(_ask, a, "x", workers=[b])[b] == {"status": "busy"}
        assert client.run(lambda dask_worker: dask_worker.data.tier("x"), workers=[a])[a] == "disk"
        assert client.run(refuse, 4, workers=[a])[a] == reads, "read for a refused reply"
        assert client.submit(np.sum, x, workers=[b], pure=False).result(timeout=60) == 7 * 4 * MiB


@pytest.mark.parametrize("compression", ["zstd", "zlib", "snappy"])
def test_every_spill_compression_dask_accepts_starts_workers_on_spillway(compression):
    """dask's ``spill-compression`` names compressors spillway has not: its workers start, on
    spillway's store with the plugin, and compress what they spill (with lz4), by the nanny's
    preload and by the worker's."""
    with dask.config.set({"distributed.worker.memory.spill-compression": compression}):
        for how in ({"preload_nanny": ["spillway.dask"]}, {"preload": ["spillway.dask"]}):
            with _cluster(**how) as cluster, distributed.Client(cluster) as client:
                status = list(client.run(_status).values())
                assert [(s["store"], s["plugin"]) for s in status] == [(True, True)] * 2, how
                assert set(
                    client.run(lambda dask_worker: dask_worker.data._store.compression).values()
                ) == {"lz4"}
                a, b = sorted(client.scheduler_info()["workers"])
                x = client.submit(np.full, 4 * MiB, 1, dtype="u1", workers=[a])
                distributed.wait(x)
                client.run(_spill, [x.key], workers=[a])
                assert client.submit(np.sum, x, workers=[b]).result(timeout=60) == 4 * MiB


def _watch_conversions(dask_worker):
    """Record the thread each received batch of values is converted on (``_convert_all``)."""
    import spillway.dask as sd

    seen = dask_worker._spillway_conversions = []
    convert = sd._convert_all

    def watched(values, deserializers):
        nbytes = sum(sd.codec.frame_bytes(v.frames) for v in values.values())
        # (a worker's event loop runs in its process's main thread)
        seen.append((nbytes, threading.current_thread() is threading.main_thread()))
        return convert(values, deserializers)

    sd._convert_all = watched


@pytest.mark.parametrize("offload", ["10MiB", "False"])
def test_large_received_values_are_merged_off_the_event_loop(offload, monkeypatch):
    """Received values above dask's offload threshold are decompressed and merged in dask's offload
    thread, as dask's comm deserializes a large message; small ones on the event loop, as dask's;
    and with ``distributed.comm.offload: False``, every one on the loop, as dask then does. (Set
    in the environment: dask reads it when the worker process imports distributed.)"""
    threshold = dask.utils.parse_bytes("10MiB")
    monkeypatch.setenv("DASK_DISTRIBUTED__COMM__OFFLOAD", offload)
    with _cluster() as cluster, distributed.Client(cluster) as client:
        a, b = sorted(client.scheduler_info()["workers"])
        client.run(_watch_conversions, workers=[b])
        small = client.submit(np.full, MiB, 1, dtype="u1", workers=[a])
        large = client.submit(np.full, threshold + MiB, 1, dtype="u1", workers=[a])
        distributed.wait([small, large])
        for x in (small, large):
            client.submit(np.sum, x, workers=[b], pure=False).result(timeout=60)
        seen = client.run(lambda dask_worker: dask_worker._spillway_conversions, workers=[b])[b]
        offloaded = offload != "False"
        assert [(n > threshold, on_loop) for n, on_loop in seen] == [(False, True), (True, not offloaded)]


def test_uninstall_puts_back_what_the_plugin_replaced():
    """Another library's wrapper of ``execute`` installed before the plugin is the worker's again
    after it; ``distributed.worker.get_data_from_worker`` is dask's again once no worker of the
    process is plugged."""
    stock = distributed.worker.get_data_from_worker
    with (
        distributed.LocalCluster(
            n_workers=1,
            processes=False,
            protocol="tcp://",
            dashboard_address=None,
            memory_limit=0,
            data=(spillway.worker_data, {"target": 64 * MiB}),
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        [worker] = cluster.workers.values()

        async def theirs(key, *, stimulus_id):
            return await type(worker).execute(worker, key, stimulus_id=stimulus_id)

        worker.execute = theirs
        assert spillway.dask.install(worker)
        assert distributed.worker.get_data_from_worker is spillway.dask.get_data_from_worker
        assert worker.execute is not theirs
        assert client.submit(operator.add, 1, 2).result(timeout=30) == 3
        spillway.dask.uninstall(worker)
        assert worker.execute is theirs
        assert getattr(worker.handlers["get_data"], "plug_of", None) is None
        assert distributed.worker.get_data_from_worker is stock
        assert client.submit(operator.add, 2, 2).result(timeout=30) == 4


def _free_ports(n):
    """``n`` consecutive ports nothing listens on now (the first of them)."""
    for first in range(41000, 60000, 97):
        socks = []
        try:
            for p in range(first, first + n):
                s = socket.socket()
                s.bind(("127.0.0.1", p))
                socks.append(s)
            return first
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    pytest.skip("no free range of ports")


def test_the_side_channel_port_can_be_set():
    """``spillway.side-channel-port``: a port or a range, the first free one of it; a worker that
    finds none free has no side channel (logged), and sends its values in-band."""
    first = _free_ports(3)
    with dask.config.set({"spillway.side-channel-port": f"{first}:{first + 2}"}):
        with _cluster() as cluster, distributed.Client(cluster) as client:
            ports = sorted(s["side_channel"][1] for s in client.run(_status).values())
            assert len(set(ports)) == 2 and all(first <= p <= first + 2 for p in ports)
    taken = socket.socket()
    taken.bind(("127.0.0.1", first))
    taken.listen()
    try:
        with dask.config.set({"spillway.side-channel-port": first}):
            with _cluster() as cluster, distributed.Client(cluster) as client:
                status = list(client.run(_status).values())
                assert [(s["plugin"], s["side_channel"]) for s in status] == [(True, None)] * 2
                logs = client.get_worker_logs()
                assert all(any("no side channel" in m for _, m in log) for log in logs.values())
    finally:
        taken.close()
    with pytest.raises(ValueError, match="side-channel-port"):
        spillway.dask.Settings.from_config(side_channel_port="high")


def test_importing_spillway_starts_no_thread(tmp_path):
    """A client or scheduler that imports spillway gets no thread of spillway's; the first store
    starts the one that carries the engine's log records to Python's logging."""
    import subprocess
    import sys

    code = (
        "import os, spillway, spillway.dask\n"
        "def names():\n"
        "    d = f'/proc/{os.getpid()}/task'\n"
        "    return sorted(open(f'{d}/{t}/comm').read().strip() for t in os.listdir(d))\n"
        "print('spillway-log' in names())\n"
        f"b = spillway.SpillBuffer({str(tmp_path)!r}, 1 << 20)\n"
        "print('spillway-log' in names())\n"
        "b.close()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"]


def test_flush_logs_refuses_nan():
    with pytest.raises(ValueError, match="nan"):
        spillway._core._flush_logs(float("nan"))
    assert spillway._core._flush_logs(0.0) in (True, False)


def test_the_bandwidth_by_type_names_the_values_types():
    """dask's dashboard shows the bandwidth of transfers by the type of the values moved: the
    values' own types, as on a stock worker, not the frames spillway kept them as."""
    with _cluster() as cluster, distributed.Client(cluster) as client:
        a, b = sorted(client.scheduler_info()["workers"])
        xs = [client.submit(np.full, 4 * MiB, i, dtype="u1", workers=[a]) for i in range(3)]
        distributed.wait(xs)
        client.run(_spill, [x.key for x in xs[:2]], workers=[a])
        for x in xs:
            client.submit(np.sum, x, workers=[b], pure=False).result(timeout=60)
        types = client.run(
            lambda dask_worker: sorted(dask.utils.typename(t) for t in dask_worker.bandwidth_types),
            workers=[b],
        )[b]
        assert types == ["numpy.ndarray"]


def test_a_side_reference_this_version_cannot_read_comes_in_band():
    """A side-channel reference of another shape (another spillway version's) is asked for again
    in-band, never an error in the middle of reading a reply."""
    import asyncio
    import types

    from distributed.protocol import Serialized

    plug = types.SimpleNamespace(types={}, settings=spillway.dask.Settings.from_config())
    header = {"serializer": "pickle", spillway.dask.SENT_BY: True, spillway.dask.SIDE: ["host", 1]}
    msg = {"status": "OK", "data": {"k": Serialized(header, [])}}
    asyncio.run(spillway.dask._fetch_references(plug, None, msg, "tcp://127.0.0.1:1"))
    assert msg["data"]["k"] is spillway.dask._IN_BAND

