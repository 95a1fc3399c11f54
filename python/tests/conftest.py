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
