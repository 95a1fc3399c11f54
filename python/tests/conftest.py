"""Shared fixtures for the spillway Python tests (they run against the built ``spillway._core``)."""

from __future__ import annotations

import logging

import pytest

import spillway
from spillway.buffer import reset_log_rate_limits


@pytest.fixture(autouse=True)
def _fresh_log_rate_limits():
    """Rate-limited warnings from an earlier test must not hide this test's."""
    reset_log_rate_limits()
    yield
    reset_log_rate_limits()


@pytest.fixture
def caplog_spillway(caplog):
    """caplog capturing spillway's loggers from DEBUG up: dask's ``distributed.spill``, where the
    buffer logs dask's messages, and ``distributed.spillway``, where everything else goes."""
    caplog.set_level(logging.DEBUG, logger="distributed.spill")
    caplog.set_level(logging.DEBUG, logger="distributed.spillway")
    return caplog


@pytest.fixture
def make_buffer(tmp_path):
    """Factory of SpillBuffers in the test's temporary directory; all closed at teardown."""
    buffers = []

    def make(target=1 << 30, max_spill=False, **options):
        buf = spillway.SpillBuffer(str(tmp_path / "spill"), target, max_spill, **options)
        buffers.append(buf)
        return buf

    yield make
    for buf in buffers:
        buf.close()


@pytest.fixture
def plugged_cluster():
    """``with plugged_cluster(workers) as (client, addr):`` a ``SpecCluster`` of Nanny workers, one
    per ``{name: options}`` (``nthreads=1``, ``memory_limit="1GiB"`` unless given), with
    :class:`spillway.dask.SpillwayPlugin` registered on all of them; ``addr`` maps each name to its
    worker's address."""
    import contextlib

    distributed = pytest.importorskip("distributed")
    import spillway.dask

    @contextlib.contextmanager
    def start(workers: dict):
        spec = {
            name: {
                "cls": distributed.Nanny,
                "options": {"nthreads": 1, "memory_limit": "1GiB", **options},
            }
            for name, options in workers.items()
        }
        scheduler = {"cls": distributed.Scheduler, "options": {"dashboard_address": None}}
        with (
            distributed.SpecCluster(workers=spec, scheduler=scheduler) as cluster,
            distributed.Client(cluster) as client,
        ):
            client.register_plugin(spillway.dask.SpillwayPlugin())
            addr = {ws["name"]: a for a, ws in client.scheduler_info()["workers"].items()}
            yield client, addr

    return start
