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
    """caplog capturing the ``spillway`` logger from DEBUG up."""
    caplog.set_level(logging.DEBUG, logger="spillway")
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


class LogWrapper:
    """Base of the tests' wrappers of a SpillBuffer's Log: everything goes to ``inner``, and
    ``get_with_crc`` goes through the wrapper's own ``get`` (the buffer then computes the crc)."""

    def __init__(self, log):
        self.inner = log

    def get(self, key):
        return self.inner.get(key)

    def get_with_crc(self, key):
        return self.get(key), None

    def __len__(self):
        return len(self.inner)

    def __contains__(self, key):
        return key in self.inner

    def __getattr__(self, name):
        return getattr(self.inner, name)


class RecordingLog(LogWrapper):
    """Wraps a SpillBuffer's Log: records the frames ``get`` returned, can make ``put`` fail."""

    def __init__(self, log):
        super().__init__(log)
        self.got = []
        self.put_error = None
        self.puts = 0

    def put(self, key, frames):
        if self.put_error is not None:
            raise self.put_error
        self.puts += 1
        return self.inner.put(key, frames)

    def get(self, key):
        frames = self.inner.get(key)
        self.got.append(frames)
        return frames


@pytest.fixture
def recording():
    """Install a RecordingLog in a buffer: ``rec = recording(buf)``."""

    def install(buf):
        rec = RecordingLog(buf._log)
        buf._log = rec
        return rec

    return install
