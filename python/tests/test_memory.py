"""How a SpillBuffer frees memory under pressure: copies of values read back, and spilling on the
process's RSS (``process_target``)."""

from __future__ import annotations

import gc
import os
import sys

import pytest

import spillway

np = pytest.importorskip("numpy")


def array(n: int, seed: int = 0):
    return np.random.default_rng(seed).integers(0, 255, n, dtype="u1")


def test_a_value_read_back_keeps_its_record_and_is_evicted_again_without_a_write(make_buffer):
    buf = make_buffer(target=1 << 30)
    a = array(100_000)
    buf["a"] = a.copy()
    assert buf.evict() > 0 and buf.tier("a") == "disk"
    assert buf.cumulative_metrics["disk-write", "count"] == 1
    got = buf["a"]
    np.testing.assert_array_equal(got, a)
    assert buf.tier("a") == "object"
    assert buf.spilled_total.memory == 0 and buf.spilled_total.disk > 100_000  # (the copy)
    assert len(buf.log) == 1  # the copy
    del got  # (not in the weak cache then: the next read goes to the log)
    assert buf.evict() > 0 and buf.tier("a") == "disk"
    assert buf.cumulative_metrics["disk-write", "count"] == 1, "evicting it again wrote it again"
    assert buf.spillway_metrics["disk-write-saved", "count"] == 1
    assert buf.spilled_total.disk > 100_000
    np.testing.assert_array_equal(buf["a"], a)
    del buf["a"]
    assert len(buf.log) == 0


def test_a_value_changed_in_place_after_it_was_read_back_is_written_again(make_buffer):
    buf = make_buffer(target=1 << 30)
    buf["a"] = array(100_000)
    assert buf.evict() > 0
    got = buf["a"]
    got[:10] = 7  # a task mutating its input in place
    assert buf.evict() > 0 and buf.tier("a") == "disk"
    assert buf.cumulative_metrics["disk-write", "count"] == 2
    assert buf.spillway_metrics["disk-write-saved", "count"] == 0
    del got
    np.testing.assert_array_equal(buf["a"][:10], 7)
    assert len(buf.log) == 1  # the stale copy was deleted


def test_with_max_spill_a_value_read_back_keeps_no_copy(make_buffer):
    """A copy would count against max_spill (the bytes on disk) for a value in memory."""
    buf = make_buffer(target=1 << 30, max_spill=1 << 30)
    buf["a"] = array(100_000)
    assert buf.evict() > 0
    buf["a"]
    assert len(buf.log) == 0 and buf.log.disk_bytes == 0


def test_process_target_spills_older_keys_when_the_process_is_above_it(make_buffer):
    buf = make_buffer(target=1 << 30, process_target=1)  # any process is above 1 byte
    buf["a"] = array(1 << 20, 1)
    buf["b"] = array(1 << 20, 2)
    assert buf.tier("a") == "disk" and buf.tier("b") == "object"  # never the key just set
    np.testing.assert_array_equal(buf["a"], array(1 << 20, 1))  # read back: "b" goes out instead
    assert buf.tier("b") == "disk" and buf.tier("a") == "object"


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads /proc/self/statm")
def test_objects_the_process_target_evicts_count_as_freed_not_out_of_reach(make_buffer):
    """The store drops an evicted object without the GIL, which frees it only when some thread next
    takes the GIL. The check after an eviction must see that memory freed: learned as out of
    reach, it would stop spilling for RSS that spilling does bring down."""
    n = 40 << 20  # above glibc's largest mmap threshold: freed, its pages leave the RSS at once
    buf = make_buffer(target=1 << 40, process_target=None)
    buf["warm"] = np.ones(n, dtype="u1")  # the first write's buffers, touched before the RSS is read
    assert buf.evict() > 0
    del buf["warm"]
    gc.collect()
    goal = _rss() + 3 * n // 2
    buf._store.process_target = goal
    for i in range(6):
        buf[f"k{i}"] = np.ones(n, dtype="u1")  # the store holds the only reference
    assert buf._store.process_out_of_reach == 0
    assert len(buf.fast) <= 2 and buf.tier("k0") == "disk"
    assert _rss() < goal + n


def test_without_process_target_only_target_counts(make_buffer):
    for process_target in (None, "auto"):  # "auto" outside a dask worker: off
        buf = make_buffer(target=1 << 30, process_target=process_target)
        buf["a"] = array(1 << 20, 1)
        buf["b"] = array(1 << 20, 2)
        assert buf.tier("a") == "object" and buf.tier("b") == "object"
        assert buf._find_worker(force=True) is False  # not a worker's data
        assert buf._store.process_target is None


@pytest.mark.parametrize(
    "fractions",
    [{"target": 0.6, "spill": 0.7}, {"target": False, "spill": 0.7}, {"target": 0.5, "spill": False}],
    ids=["default", "no-target", "no-spill"],
)
def test_auto_thresholds_are_the_workers_as_dask_computes_them(fractions):
    """``data=spillway.worker_data`` alone: the target and the process thresholds come from the
    worker's memory limit and dask's fractions, as dask's worker and memory monitor use them."""
    distributed = pytest.importorskip("distributed")
    import dask

    limit = 1 << 30
    config = {f"distributed.worker.memory.{k}": v for k, v in fractions.items()}
    with (
        dask.config.set(config),
        distributed.LocalCluster(
            n_workers=1,
            processes=False,
            memory_limit=limit,
            dashboard_address=":0",
            data=spillway.worker_data,
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        assert client.submit(lambda: 1).result() == 1
        ((target, goal, trigger),) = client.run(
            lambda dask_worker: (
                dask_worker.data.target,
                dask_worker.data._store.process_target,
                dask_worker.data._store.process_trigger,
            )
        ).values()
    t, s = fractions["target"], fractions["spill"]
    assert target == (int(limit * t) if t else sys.maxsize)
    if s is False:
        assert goal is None and trigger is None  # dask's memory monitor does not spill either
    else:
        # spillway.process-trigger: target (the default): from the target fraction on
        assert goal == trigger == int(limit * (t or s))


def test_a_buffer_nobody_holds_is_collected_with_its_directory(tmp_path):
    buf = spillway.SpillBuffer(str(tmp_path), target=0)
    buf["a"] = array(1000)
    buf["b"] = array(1000)
    del buf["a"]
    directory = buf.directory
    del buf
    gc.collect()
    assert not os.path.exists(directory)
