"""How a SpillBuffer frees memory under pressure: copies of values read back, the background writer,
and spilling on the process's RSS (``process_target``)."""

from __future__ import annotations

import gc
import os
import threading

import pytest
from conftest import LogWrapper

import spillway

np = pytest.importorskip("numpy")


def array(n: int, seed: int = 0):
    return np.random.default_rng(seed).integers(0, 255, n, dtype="u1")


class PutThreads(LogWrapper):
    """Wraps a SpillBuffer's Log: records the thread of every ``put``."""

    def __init__(self, log):
        super().__init__(log)
        self.threads = []

    def put(self, key, frames):
        self.threads.append(threading.current_thread())
        return self.inner.put(key, frames)


def test_a_value_read_back_keeps_its_record_and_is_evicted_again_without_a_write(make_buffer):
    buf = make_buffer(target=1 << 30)
    a = array(100_000)
    buf["a"] = a.copy()
    assert buf.evict() > 0 and buf.tier("a") == "disk"
    assert buf.cumulative_metrics["disk-write", "count"] == 1
    got = buf["a"]
    np.testing.assert_array_equal(got, a)
    assert buf.tier("a") == "object" and buf.spilled_total == (0, 0)
    buf._drain()
    assert len(buf.log) == 1  # the copy
    del got  # (not in the weak cache then: the next read goes to the log)
    assert buf.evict() > 0 and buf.tier("a") == "disk"
    assert buf.cumulative_metrics["disk-write", "count"] == 1, "evicting it again wrote it again"
    assert buf.cumulative_metrics["disk-write-saved", "count"] == 1
    assert buf.spilled_total.disk > 100_000
    np.testing.assert_array_equal(buf["a"], a)
    del buf["a"]
    buf._drain()
    assert len(buf.log) == 0


def test_a_value_changed_in_place_after_it_was_read_back_is_written_again(make_buffer):
    buf = make_buffer(target=1 << 30)
    buf["a"] = array(100_000)
    assert buf.evict() > 0
    got = buf["a"]
    got[:10] = 7  # a task mutating its input in place
    assert buf.evict() > 0 and buf.tier("a") == "disk"
    assert buf.cumulative_metrics["disk-write", "count"] == 2
    assert buf.cumulative_metrics["disk-write-saved", "count"] == 0
    del got
    np.testing.assert_array_equal(buf["a"][:10], 7)
    buf._drain()
    assert len(buf.log) == 1  # the stale copy was deleted


def test_with_max_spill_a_value_read_back_keeps_no_copy(make_buffer):
    """A copy would count against max_spill (the bytes on disk) for a value in memory."""
    buf = make_buffer(target=1 << 30, max_spill=1 << 30)
    buf["a"] = array(100_000)
    assert buf.evict() > 0
    buf["a"]
    buf._drain()
    assert len(buf.log) == 0 and buf.log.disk_bytes == 0


def test_the_writer_writes_copies_of_the_oldest_values_so_that_evicting_them_writes_nothing(
    make_buffer,
):
    target = 950_000
    buf = make_buffer(target=target)
    log = buf._log = PutThreads(buf._log)
    buf["first"] = array(100_000, 99)
    assert buf.evict() > 0  # values are being evicted: the writer works
    log.threads.clear()
    for i in range(9):  # 900 KB: within the writer's reserve of target (each weighs 100_000)
        buf[i] = array(100_000, i)
    buf._drain()
    copied = [i for i in range(9) if buf._entries[i].log_key]
    reserve = spillway.buffer.CLEAN_FRACTION * target
    assert copied == list(range(len(copied))) and len(copied) * 100_000 >= reserve, copied
    assert all(buf.tier(i) == "object" for i in range(9))
    assert log.threads and all(t.name == "spillway-writer" for t in log.threads)
    log.threads.clear()

    buf[9] = array(100_000, 9)  # above target: the oldest goes, as a drop
    buf[10] = array(100_000, 10)
    assert buf.tier(0) == "disk" and buf.tier(1) == "disk"
    assert threading.current_thread() not in log.threads
    assert buf.cumulative_metrics["disk-write-saved", "count"] >= 2
    for i in range(11):
        np.testing.assert_array_equal(buf[i], array(100_000, i))


def test_the_writer_stays_idle_while_memory_is_far_below_target_or_nothing_is_evicted(make_buffer):
    buf = make_buffer(target=10_000_000)
    for i in range(5):
        buf[i] = array(100_000, i)
    assert buf.evict() > 0
    buf._drain()
    assert len(buf.log) == 1  # the value evicted, and no copy
    buf = make_buffer(target=950_000)
    for i in range(9):  # within the reserve of target, but nothing was evicted
        buf[i] = array(100_000, i)
    buf._drain()
    assert len(buf.log) == 0


def test_process_target_spills_older_keys_when_the_process_is_above_it(make_buffer):
    buf = make_buffer(target=1 << 30, process_target=1)  # any process is above 1 byte
    buf["a"] = array(1 << 20, 1)
    buf["b"] = array(1 << 20, 2)
    assert buf.tier("a") == "disk" and buf.tier("b") == "object"  # never the key just set
    np.testing.assert_array_equal(buf["a"], array(1 << 20, 1))  # read back: "b" goes out instead
    assert buf.tier("b") == "disk" and buf.tier("a") == "object"


def test_without_process_target_only_target_counts(make_buffer):
    for process_target in (None, "auto"):  # "auto" outside a dask worker: off
        buf = make_buffer(target=1 << 30, process_target=process_target)
        buf["a"] = array(1 << 20, 1)
        buf["b"] = array(1 << 20, 2)
        assert buf.tier("a") == "object" and buf.tier("b") == "object"
        assert buf._resolve_process_target() is None


def test_process_target_auto_is_the_workers_memory_limit_times_its_target_fraction():
    distributed = pytest.importorskip("distributed")
    with (
        distributed.LocalCluster(
            n_workers=1,
            processes=False,
            memory_limit="1GiB",
            dashboard_address=":0",
            data=(spillway.worker_data, {"memory_limit": "1GiB"}),
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        (goal,) = client.run(
            lambda dask_worker: dask_worker.data._resolve_process_target()
        ).values()
    fraction = distributed.worker_memory.dask.config.get("distributed.worker.memory.target")
    assert goal == int((1 << 30) * fraction)


def test_a_buffer_nobody_holds_is_collected_with_its_writer(tmp_path):
    buf = spillway.SpillBuffer(str(tmp_path), target=0)
    buf["a"] = array(1000)
    del buf["a"]  # a delete for the writer
    writer, directory = buf._writer.thread, buf.directory
    del buf
    gc.collect()
    writer.join(10)
    assert not writer.is_alive() and not os.path.exists(directory)


def test_memory_that_spilling_does_not_give_back_is_not_chased(make_buffer, monkeypatch):
    """An RSS that stays up whatever is spilled (objects freed into the allocator's arenas, values
    referenced elsewhere) is learned as out of reach: spilling stops once it has covered the
    excess, instead of spilling every older value at every set."""
    from spillway import buffer

    monkeypatch.setattr(buffer, "_rss", lambda: 110 << 20)  # never falls
    buf = make_buffer(target=1 << 30, process_target=100 << 20)
    for i in range(20):
        buf[i] = array(1 << 20, i)
    spilled = len(buf.slow)
    assert 10 <= spilled <= 12, spilled  # the 10 MiB excess, once; not 19
    for i in range(20):
        np.testing.assert_array_equal(buf[i], array(1 << 20, i))


class SlowToPickle:
    """A value that pickles far below ``AHEAD_MIN_PICKLE_RATE`` (a list of small tuples), and counts
    the pickles made of it on the buffer's writer thread."""

    writer_pickles = 0

    def __init__(self, seed: int, n: int = 50_000):
        self.items = [(seed, i) for i in range(n)]

    def __reduce__(self):
        if threading.current_thread().name == "spillway-writer":
            SlowToPickle.writer_pickles += 1
        return (_rebuild_slow, (self.items,))

    def __sizeof__(self):
        return 100_000


def _rebuild_slow(items):
    out = SlowToPickle.__new__(SlowToPickle)
    out.items = items
    return out


def test_the_writer_leaves_values_that_pickle_slowly_to_evictions(make_buffer, monkeypatch):
    """The writer learns from one pickle that a type pickles slowly and then skips its values,
    however often it wakes up and scans them (at most one more pickle per ``AHEAD_PROBE_SECONDS``):
    a copy of such a value saves nothing, since evicting it would pickle it again to check it."""
    monkeypatch.setattr(SlowToPickle, "writer_pickles", 0)
    buf = make_buffer(target=950_000)
    buf["first"] = array(100_000, 99)
    assert buf.evict() > 0  # values are being evicted: the writer works
    for i in range(8):  # within the writer's reserve of target
        buf[i] = SlowToPickle(i)
    buf._drain()
    assert SlowToPickle.writer_pickles == 1, "the writer did not learn from its first pickle"
    for round in range(100):  # each set wakes the writer, which scans the same values again
        buf["churn"] = array(1000, round)
        buf._drain()
    assert SlowToPickle.writer_pickles == 1
    assert not any(buf._entries[i].log_key for i in range(8)), "a slow value was written ahead"
    buf[8] = array(100_000, 8)  # above target: the oldest go, each pickled once by the eviction
    buf[9] = array(100_000, 9)
    assert buf.tier(0) == "disk"
    assert buf[0].items == SlowToPickle(0).items
