"""spillway as a dask worker's data store."""

from __future__ import annotations

import os
import sys

import pytest

import spillway


def test_package_exports():
    assert spillway.__version__ == "0.1.0"
    for name in ("SpillBuffer", "Log", "SpillwayError", "DiskFull", "__version__"):
        assert hasattr(spillway, name)
    assert issubclass(spillway.DiskFull, spillway.SpillwayError)


def test_worker_data_uses_dask_config(tmp_path):
    dask = pytest.importorskip("dask")
    with dask.config.set(
        {"distributed.worker.memory.target": 0.5, "distributed.worker.memory.max-spill": "1 MiB"}
    ):
        buf = spillway.worker_data(str(tmp_path), memory_limit="100 MiB")
    try:
        assert buf.target == 50 * 2**20
        assert buf.max_spill == 2**20
        assert os.path.dirname(buf.directory) == str(tmp_path / "spillway")
    finally:
        buf.close()
    with dask.config.set({"distributed.worker.memory.max-spill": False}):
        buf = spillway.worker_data(str(tmp_path), target=1234, compression="lz4")
    try:
        assert buf.target == 1234 and buf.max_spill is False
    finally:
        buf.close()
    with dask.config.set({"distributed.worker.memory.target": False}):
        buf = spillway.worker_data(str(tmp_path), memory_limit="100 MiB")
    try:
        assert buf.target == sys.maxsize, "no target, as dask's worker sets none"
    finally:
        buf.close()


def test_local_cluster_with_spillway_spills_and_computes():
    """An in-process worker whose data is a SpillBuffer: results match numpy, data was spilled."""
    distributed = pytest.importorskip("distributed")
    da = pytest.importorskip("dask.array")
    np = pytest.importorskip("numpy")

    with (
        distributed.LocalCluster(
            n_workers=1,
            threads_per_worker=2,
            processes=False,
            memory_limit=0,  # no memory monitor: spilling is driven by target only
            dashboard_address=":0",
            data=(spillway.worker_data, {"target": 4 * 2**20}),
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        x = da.random.default_rng(0).random((1000, 1000), chunks=(250, 250))  # 8 MB
        x = x.persist()
        distributed.wait(x)
        (worker,) = cluster.workers.values()
        assert isinstance(worker.data, spillway.SpillBuffer)
        assert len(worker.data.slow) > 0
        assert worker.data.cumulative_metrics["disk-write", "count"] > 0
        total = (x + x.T).sum().compute()
        # The reference is computed outside the cluster (not from data the worker spilled).
        ref = da.random.default_rng(0).random((1000, 1000), chunks=(250, 250)).compute(scheduler="sync")
        assert total == pytest.approx((ref + ref.T).sum())
        spilled = client.run(lambda dask_worker: dask_worker.data.spilled_total)
        assert list(spilled.values())[0].disk > 0
        np.testing.assert_array_equal(x.compute(), ref)


def _kill_me():
    import signal

    os.kill(os.getpid(), signal.SIGKILL)


def test_a_worker_the_nanny_finds_dead_leaves_no_spilled_data_behind():
    """dask's store's files go with a worker its nanny kills (the nanny removes the worker's
    directory, where the store lives): spillway's segment files do too."""
    distributed = pytest.importorskip("distributed")
    import glob
    import time

    with (
        distributed.LocalCluster(
            n_workers=1,
            threads_per_worker=1,
            memory_limit="400MiB",
            dashboard_address=None,
            data=spillway.worker_data,
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        held = client.submit(lambda: b"x" * 1000, key="myspill")
        held.result()  # the future stays held: a released key may be gone before the evict
        client.run(lambda dask_worker: dask_worker.data.evict())
        (files,) = client.run(
            lambda dask_worker: glob.glob(f"{dask_worker.local_directory}/**/*.seg", recursive=True)
        ).values()
        assert files and all(os.path.exists(f) for f in files)
        (old,) = client.scheduler_info()["workers"]
        with pytest.raises(OSError):  # the comm dies with the worker (CommClosedError)
            client.run(_kill_me)
        deadline = time.monotonic() + 60
        while set(client.scheduler_info()["workers"]) in (set(), {old}):
            assert time.monotonic() < deadline, "the nanny did not restart the worker"
            time.sleep(0.1)
        assert not any(os.path.exists(f) for f in files)
