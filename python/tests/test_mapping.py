"""SpillBuffer as a MutableMapping: keys, views, spilling above target, evict, pop, metrics."""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

import pytest

import spillway
from spillway.codec import sizeof as _sizeof

try:
    from dask.sizeof import sizeof
except ImportError:  # pragma: no cover
    sizeof = sys.getsizeof


def blob(n: int, fill: int = 0) -> bytes:
    """A value whose sizeof is n + a small constant."""
    return bytes([fill]) * n


def test_starts_empty_and_is_a_mutable_mapping(make_buffer):
    buf = make_buffer()
    assert isinstance(buf, MutableMapping)
    assert len(buf) == 0
    assert list(buf) == []
    assert not buf.fast and not buf.slow
    assert buf.spilled_total == (0, 0)
    assert len(buf.log) == 0 and buf.log.read_only is None


def test_a_second_buffer_in_the_same_directory_starts_empty(make_buffer):
    a = make_buffer(target=0)
    a["x"] = blob(100)
    assert "x" in a.slow
    b = make_buffer(target=0)
    assert len(b) == 0 and len(b.log) == 0
    assert a.directory != b.directory
    assert a["x"] == blob(100)


def test_close_removes_the_log_directory(make_buffer):
    buf = make_buffer(target=0)
    buf["x"] = blob(100)
    assert os.path.isdir(buf.directory)
    buf.close()
    assert not os.path.exists(buf.directory)
    buf.close()  # idempotent


def test_set_get_del_in_memory(make_buffer):
    buf = make_buffer()
    buf["x"] = 1
    buf[("y", 0)] = [1, 2]
    assert buf["x"] == 1 and buf[("y", 0)] == [1, 2]
    assert set(buf) == {"x", ("y", 0)} and len(buf) == 2
    assert "x" in buf and "z" not in buf
    del buf["x"]
    assert "x" not in buf and len(buf) == 1
    with pytest.raises(KeyError):
        buf["x"]
    with pytest.raises(KeyError):
        del buf["x"]
    buf[("y", 0)] = "replaced"
    assert buf[("y", 0)] == "replaced" and len(buf) == 1


def test_int_and_str_keys_are_distinct_in_memory_and_on_disk(make_buffer):
    buf = make_buffer(target=0)  # everything goes to disk
    buf[1] = blob(100, 1)
    buf["1"] = blob(100, 2)
    buf[b"1"] = blob(100, 3)
    buf[(1,)] = blob(100, 4)
    buf[("1",)] = blob(100, 5)
    assert len(buf) == 5 and len(buf.slow) == 5 and len(buf.log) == 5
    assert buf[1] == blob(100, 1)
    assert buf["1"] == blob(100, 2)
    assert buf[b"1"] == blob(100, 3)
    assert buf[(1,)] == blob(100, 4)
    assert buf[("1",)] == blob(100, 5)
    del buf[1]
    assert "1" in buf and 1 not in buf and buf["1"] == blob(100, 2)

    mem = make_buffer()
    mem[1] = "int"
    mem["1"] = "str"
    assert mem[1] == "int" and mem["1"] == "str" and len(mem) == 2


def test_equal_numbers_are_one_key_as_in_a_dict(make_buffer):
    buf = make_buffer(target=0)
    buf[1] = blob(10, 1)
    buf[1.0] = blob(10, 2)
    assert len(buf) == 1 and len(buf.log) == 1
    assert buf[1] == blob(10, 2) and buf[True] == blob(10, 2)


def test_tuple_keys(make_buffer):
    buf = make_buffer(target=0)
    keys = [("x", 0, 0), ("x", 0, 1), ("x", (0, 1)), (("x", 0), 1), ("x-1234", 1, 2, 3), ()]
    for i, k in enumerate(keys):
        buf[k] = blob(50, i)
    assert set(buf.slow) == set(keys)
    for i, k in enumerate(keys):
        assert buf[k] == blob(50, i)


def test_fast_slow_memory_disk_views(make_buffer):
    buf = make_buffer(target=0)
    buf["a"] = blob(10)
    buf.target = 1 << 30
    buf["b"] = blob(10)
    assert set(buf.fast) == set(buf.memory) == {"b"}
    assert set(buf.slow) == set(buf.disk) == {"a"}
    assert len(buf.fast) == 1 and len(buf.slow) == 1
    assert "b" in buf.fast and "a" not in buf.fast
    assert "a" in buf.slow and "b" not in buf.slow
    assert buf.fast["b"] == blob(10) and buf.slow["a"] == blob(10)
    with pytest.raises(KeyError):
        buf.fast["a"]
    with pytest.raises(KeyError):
        buf.slow["b"]
    # reading through the views neither moves keys nor reorders the LRU
    assert set(buf.slow) == {"a"}
    assert buf.fast.total_weight == sizeof(blob(10))
    assert buf.tier("a") == "disk" and buf.tier("b") == "object"


def test_items_and_values_do_not_move_keys(make_buffer):
    buf = make_buffer(target=100)
    buf["heavy"] = blob(1000)
    buf["light"] = blob(10)
    assert dict(buf.items()) == {"heavy": blob(1000), "light": blob(10)}
    assert sorted(buf.values()) == sorted([blob(1000), blob(10)])
    assert set(buf.slow) == {"heavy"} and set(buf.fast) == {"light"}


def test_lru_spilling_above_target(make_buffer):
    w = sizeof(blob(100))
    buf = make_buffer(target=3 * w)
    for k in "abc":
        buf[k] = blob(100)
    assert set(buf.fast) == {"a", "b", "c"} and not buf.slow
    buf["d"] = blob(100)  # 4w > 3w: the least recently used goes
    assert set(buf.fast) == {"b", "c", "d"} and set(buf.slow) == {"a"}
    buf["b"]  # b is now the most recently used
    buf["e"] = blob(100)
    assert set(buf.fast) == {"b", "d", "e"} and set(buf.slow) == {"a", "c"}
    assert buf["a"] == blob(100)  # back in memory; pushes out the LRU (d)
    assert set(buf.fast) == {"b", "e", "a"} and set(buf.slow) == {"c", "d"}
    # c and d on disk, and the copy a keeps of what was read back
    assert buf.spilled_total == (2 * w, 3 * len(buf.get_serialized("c")[0]))


def test_exactly_at_target_does_not_spill(make_buffer):
    w = sizeof(blob(100))
    buf = make_buffer(target=2 * w)
    buf["a"] = blob(100)
    buf["b"] = blob(100)
    assert set(buf.fast) == {"a", "b"}


def test_value_larger_than_target_goes_straight_to_disk_and_is_served_from_there(make_buffer):
    buf = make_buffer(target=1000)
    buf["small"] = blob(10)
    buf["big"] = blob(5000)
    assert set(buf.slow) == {"big"} and set(buf.fast) == {"small"}
    assert buf.cumulative_metrics["disk-write", "count"] == 1
    assert buf["big"] == blob(5000)
    assert set(buf.slow) == {"big"} and set(buf.fast) == {"small"}  # not promoted
    assert buf.cumulative_metrics["disk-read", "count"] == 1
    assert buf.spilled_total.memory == sizeof(blob(5000))


def test_spilled_total_tracks_disk(make_buffer):
    buf = make_buffer(target=0)
    buf["a"] = blob(1000)
    buf["b"] = blob(2000)
    total = buf.spilled_total
    assert total.memory == sizeof(blob(1000)) + sizeof(blob(2000))
    assert total.disk == buf.log.disk_bytes > 3000
    del buf["a"]
    assert buf.spilled_total.memory == sizeof(blob(2000))
    b_disk = buf.spilled_total.disk
    assert b_disk == buf.log.disk_bytes
    buf.target = 1 << 30
    buf["b"]  # read back into memory, its record kept as a copy: on disk still, in memory too
    assert buf.spilled_total == (0, b_disk) and len(buf.log) == 1 and buf.log.disk_bytes == b_disk
    del buf["b"]
    assert buf.log.disk_bytes == 0 and len(buf.log) == 0


def test_evict(make_buffer):
    buf = make_buffer()
    with pytest.raises(KeyError):
        buf.evict()  # nothing in memory: as dask
    buf["a"] = blob(100)
    buf["b"] = blob(200)
    buf["a"]
    assert buf.evict() == sizeof(blob(200))  # least recently used
    assert set(buf.slow) == {"b"}
    assert buf.evict() == sizeof(blob(100))
    with pytest.raises(KeyError):
        buf.evict()
    assert set(buf.slow) == {"a", "b"} and buf["a"] == blob(100)


def test_pop_raises_not_implemented(make_buffer):
    buf = make_buffer()
    buf["x"] = 1
    with pytest.raises(NotImplementedError, match="Please use `del` instead"):
        buf.pop("x", None)
    assert buf["x"] == 1


def test_clear_forgets_everything_without_reading(make_buffer):
    buf = make_buffer(target=100)
    buf["a"] = blob(1000)
    buf["b"] = 1
    reads = buf.cumulative_metrics["disk-read", "count"]
    buf.clear()
    assert len(buf) == 0 and len(buf.log) == 0
    assert buf.cumulative_metrics["disk-read", "count"] == reads == 0


def test_weights_are_dask_sizeof(make_buffer):
    buf = make_buffer()
    values = {"s": "x" * 1000, "l": list(range(100)), "d": {"a": blob(300)}, "b": blob(5000)}
    for k, v in values.items():
        buf[k] = v
    assert buf.fast.total_weight == sum(sizeof(v) for v in values.values())
    assert _sizeof(values["b"]) == sizeof(values["b"])


def test_cumulative_metrics_use_dask_labels(make_buffer):
    buf = make_buffer(target=100)
    buf["a"] = blob(1000)
    buf["b"] = 1
    buf["b"]
    buf["a"]
    m = buf.cumulative_metrics
    assert m["disk-write", "count"] == 1
    assert m["disk-write", "bytes"] == sum(len(f) for f in buf.get_serialized("a")) > 1000
    assert m["disk-write", "seconds"] > 0
    assert m["disk-read", "count"] == 1
    assert m["disk-read", "bytes"] == m["disk-write", "bytes"]
    assert m["disk-read", "seconds"] > 0
    assert m["serialize", "seconds"] > 0
    assert m["deserialize", "seconds"] > 0
    assert m["memory-read", "count"] == 1
    assert m["memory-read", "bytes"] == sizeof(1)
    assert {label for label, _ in m} == {
        "disk-write",
        "disk-read",
        "serialize",
        "deserialize",
        "memory-read",
    }
    assert {unit for _, unit in m} <= {"count", "bytes", "seconds"}
    # What dask's store never reports is in spillway_metrics only.
    assert ("serialize", "count") not in m and ("memory-read", "seconds") not in m
    assert buf.spillway_metrics["serialize", "count"] == 1
    assert buf.spillway_metrics["disk-write", "count"] == 1


def test_repr(make_buffer):
    buf = make_buffer(target=0)
    buf["a"] = blob(10)
    assert "1 on disk" in repr(buf)


def test_sizeof_failure_weighs_one_megabyte_and_warns(make_buffer, caplog_spillway):
    class NoSize:
        def __sizeof__(self):
            raise RuntimeError("no size")

    if sizeof is sys.getsizeof:
        pytest.skip("needs dask.sizeof")
    buf = make_buffer()
    buf["x"] = NoSize()
    assert buf.fast.total_weight == spillway.codec.SIZEOF_FALLBACK_BYTES
    assert any("Sizeof calculation" in r.getMessage() for r in caplog_spillway.records)


def test_metrics_reach_distributed_context_meter(make_buffer):
    metrics = pytest.importorskip("distributed.metrics")
    seen = []
    buf = make_buffer(target=0)  # made after distributed.metrics was imported
    with metrics.context_meter.add_callback(lambda label, value, unit: seen.append((label, unit))):
        buf["a"] = blob(1000)
        buf["a"]
    assert ("disk-write", "bytes") in seen and ("disk-read", "count") in seen
    assert ("serialize", "seconds") in seen and ("deserialize", "seconds") in seen


@pytest.mark.parametrize("compression", ["none", "lz4"])
@pytest.mark.parametrize("backend", ["auto", "portable"])
def test_log_options(make_buffer, compression, backend):
    buf = make_buffer(target=0, compression=compression, backend=backend)
    assert buf.log.backend in ("uring", "portable")
    if backend == "portable":
        assert buf.log.backend == "portable"
    value = {"text": "abc" * 10_000, "blob": blob(100_000)}
    buf["v"] = value
    assert "v" in buf.slow
    assert buf.spilled_total.disk > 130_000  # payload bytes, before compression
    assert buf["v"] == value


def test_bad_log_options_leave_nothing_behind(tmp_path):
    with pytest.raises((ValueError, spillway.SpillwayError)):
        spillway.SpillBuffer(str(tmp_path), 0, compression="zip")
    assert os.listdir(tmp_path) == []
