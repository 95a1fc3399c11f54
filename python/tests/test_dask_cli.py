"""spillway on workers started as most dask users start them: real ``dask scheduler`` and ``dask
worker`` processes, turned on with dask's own CLI flags (``--preload-nanny``, ``--preload``) or
dask's own config (``distributed.nanny.preload`` in the environment), set with ``DASK_SPILLWAY__``
variables."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time

import pytest

distributed = pytest.importorskip("distributed")
np = pytest.importorskip("numpy")

import spillway  # noqa: E402
import spillway.dask  # noqa: E402

MiB = 1 << 20


@contextlib.contextmanager
def dask_cluster(tmp_path, worker_args=(), env=None, n_workers=2):
    """A ``dask scheduler`` and ``n_workers`` ``dask worker`` processes (each under its nanny
    unless ``--no-nanny``), on 127.0.0.1; yields a connected client."""
    sched_file = tmp_path / "scheduler.json"
    penv = dict(os.environ, **(env or {}))
    # The package under test (target/python in CI) for the processes too.
    penv["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
             "--port", "0", "--dashboard-address", ":0", "--scheduler-file", str(sched_file)],
            env=penv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
    ]
    try:
        deadline = time.monotonic() + 60
        while not sched_file.exists() or not sched_file.read_text().strip():
            assert time.monotonic() < deadline, "the scheduler did not start"
            assert procs[0].poll() is None, procs[0].stderr.read()
            time.sleep(0.1)
        address = json.loads(sched_file.read_text())["address"]
        for i in range(n_workers):
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "distributed.cli.dask_worker", address,
                     "--host", "127.0.0.1", "--nthreads", "1", "--memory-limit", "1GiB",
                     "--local-directory", str(tmp_path / f"w{i}"), *worker_args],
                    env=penv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                )
            )
        with distributed.Client(address, timeout=60) as client:
            client.wait_for_workers(n_workers, timeout=60)
            yield client
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in reversed(procs):
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(30)


def _what_runs(dask_worker):
    data = dask_worker.data
    return {
        "data": f"{type(data).__module__}.{type(data).__name__}",
        "plugin": getattr(dask_worker.handlers["get_data"], "stock", None) is not None,
        "target": getattr(data, "target", None),
    }


def _workload(client):
    """Arrays spilled on one worker (by the store's target), moved to the other and used there:
    the results must be right."""
    a, b = sorted(client.scheduler_info()["workers"])
    xs = [client.submit(np.full, MiB, i, dtype="u1", key=f"x-{i}", workers=[a]) for i in range(8)]
    distributed.wait(xs)
    client.run(lambda dask_worker: [dask_worker.data.evict() for _ in range(4)], workers=[a])
    sums = [client.submit(np.sum, x, key=f"s-{i}", workers=[b]) for i, x in enumerate(xs)]
    assert client.gather(sums) == [i * MiB for i in range(8)]


EXPECTED = {"data": "spillway.buffer.SpillBuffer", "plugin": True, "target": int(0.6 * (1 << 30))}


def test_preload_nanny_runs_every_worker_on_spillway_with_the_plugin(tmp_path):
    with dask_cluster(tmp_path, ["--preload-nanny", "spillway.dask"]) as client:
        assert list(client.run(_what_runs).values()) == [EXPECTED] * 2
        _workload(client)


def test_dask_config_alone_turns_it_on(tmp_path):
    """``distributed.worker.preload`` (``dask worker`` passes its own, empty, list of nanny
    preloads, so it reads only the worker's from dask's config)."""
    env = {"DASK_DISTRIBUTED__WORKER__PRELOAD": '["spillway.dask"]'}
    with dask_cluster(tmp_path, env=env) as client:
        assert list(client.run(_what_runs).values()) == [EXPECTED] * 2
        _workload(client)


def test_a_local_cluster_takes_the_nanny_preload_from_dask_config():
    import dask

    with (
        dask.config.set({"distributed.nanny.preload": ["spillway.dask"]}),
        distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, memory_limit="1GiB", dashboard_address=None
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        assert list(client.run(_what_runs).values()) == [EXPECTED] * 2
        _workload(client)


def test_a_worker_preload_swaps_dasks_store_for_spillways(tmp_path):
    for args in (["--preload", "spillway.dask"], ["--no-nanny", "--preload", "spillway.dask"]):
        with dask_cluster(tmp_path, args, n_workers=2) as client:
            assert list(client.run(_what_runs).values()) == [EXPECTED] * 2, args
            _workload(client)


def test_config_variables_choose_what_runs(tmp_path):
    env = {"DASK_SPILLWAY__PLUGIN": "False", "DASK_SPILLWAY__SEGMENT_BYTES": "8MiB"}
    with dask_cluster(tmp_path, ["--preload-nanny", "spillway.dask"], env=env) as client:
        assert list(client.run(_what_runs).values()) == [{**EXPECTED, "plugin": False}] * 2
        _workload(client)
    env = {"DASK_SPILLWAY__DATA": "False"}
    with dask_cluster(tmp_path, ["--preload", "spillway.dask"], env=env) as client:
        runs = list(client.run(_what_runs).values())
        assert [r["data"] for r in runs] == ["distributed.spill.SpillBuffer"] * 2
        assert [r["plugin"] for r in runs] == [False] * 2  # (the plugin needs spillway's store)


def test_a_preload_that_cannot_do_its_work_leaves_the_server_stock(caplog):
    """It never stops a worker from starting: what it cannot do is logged."""
    import logging

    caplog.set_level(logging.WARNING, logger="distributed.spillway")

    class Odd:
        address = "tcp://127.0.0.1:1"

    spillway.dask.dask_setup(Odd())  # neither a nanny nor a worker
    assert "neither a nanny nor a worker" in caplog.text

    caplog.clear()
    broken = object.__new__(distributed.Worker)  # a worker whose internals are not there
    spillway.dask.dask_setup(broken)
    assert "keeps its data" in caplog.text and "spillway.dask is off" in caplog.text
