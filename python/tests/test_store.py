"""``spillway._core.Store``: the engine's three-tier store with a Python codec (``spillway.codec``).

What a Python caller sees of the Rust store: tiers under dask's eviction rules, one deserialize per
materialization whatever the threads, evicted objects that are still alive coming back without a
read, pickling errors raised as they were, dask's metric labels, and no GIL held while waiting."""

from __future__ import annotations

import pickle
import random
import threading

import pytest

from spillway import codec
from spillway._core import SerializeError, Store, _flush_logs

np = pytest.importorskip("numpy")


@pytest.fixture
def make_store(tmp_path):
    stores = []

    def make(target=1 << 30, max_spill=None, **options):
        s = Store(str(tmp_path / f"store{len(stores)}"), target, max_spill, **options)
        stores.append(s)
        return s

    yield make
    for s in stores:
        s.close()


class CountingCodec:
    """``spillway.codec``, counting loads; loads of a value wait for ``gate`` while it is clear."""

    def __init__(self):
        self.loads_calls = 0
        self.gate = threading.Event()
        self.gate.set()
        self.loading = threading.Event()

    def dumps(self, value):
        return codec.dumps(value)

    def loads(self, frames, writeable):
        self.loads_calls += 1
        self.loading.set()
        assert self.gate.wait(timeout=30), "the test never opened the gate"
        return codec.loads(frames, writeable)

    def sizeof(self, value):
        return codec.sizeof(value)


def test_objects_go_straight_to_disk_in_lru_order(make_store):
    s = make_store(target=3000)
    for i in range(4):
        s.put(b"k%d" % i, np.full(100, i, dtype="f8"))  # 800 bytes each (+ the array header)
    assert s.tier(b"k0") == "disk"
    assert [s.tier(b"k%d" % i) for i in (1, 2, 3)] == ["materialized"] * 3
    assert s.memory_bytes <= 3000
    m = s.metrics()
    assert m["serialize", "count"] == 1 and m["disk-write", "count"] == 1
    np.testing.assert_array_equal(s.get(b"k0"), np.full(100, 0.0))
    s.check_accounting()


def test_a_value_read_back_is_writeable_without_a_copy_of_the_read(make_store):
    s = make_store(target=1 << 20)
    s.put(b"a", np.arange(1000))
    s.evict()
    out = s.get(b"a")
    assert out.flags.writeable
    out[0] = 7  # no error: the read's own buffer
    np.testing.assert_array_equal(out[1:], np.arange(1, 1000))


def test_concurrent_gets_of_a_spilled_key_deserialize_it_once(make_store):
    c = CountingCodec()
    s = make_store(target=1 << 20, codec=c)
    s.put(b"a", list(range(1000)))  # no weak references to lists: a get must deserialize
    s.evict()
    assert s.tier(b"a") == "disk"
    c.gate.clear()
    got = []
    errors = []

    def read():
        try:
            got.append(s.get(b"a"))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=read) for _ in range(8)]
    for t in threads:
        t.start()
    assert c.loading.wait(timeout=30)
    # The readers wait in the key's slot without the GIL: this thread runs meanwhile.
    assert sum(range(1000)) == 499500
    c.gate.set()
    for t in threads:
        t.join(timeout=60)
    assert not errors and len(got) == 8
    assert c.loads_calls == 1
    assert all(g is got[0] for g in got), "every reader gets the one object"
    assert s.tier(b"a") == "materialized"
    s.check_accounting()


def test_an_evicted_object_still_alive_comes_back_without_a_read(make_store):
    s = make_store(target=1 << 20)
    a = np.arange(10_000)
    s.put(b"a", a)
    s.evict()
    assert s.tier(b"a") == "disk"
    reads = s.metrics()["disk-read", "count"]
    assert s.get(b"a") is a
    assert s.metrics()["disk-read", "count"] == reads
    assert s.tier(b"a") == "materialized"
    # Nobody else holds it: read back, equal but another object.
    s.evict()
    del a
    out = s.get(b"a")
    np.testing.assert_array_equal(out, np.arange(10_000))
    assert s.metrics()["disk-read", "count"] == reads + 1


def test_a_heavy_value_that_cannot_be_pickled_raises_its_error_and_is_forgotten(make_store):
    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("not today")

        def __sizeof__(self):
            return 10_000

    s = make_store(target=1000)
    s.put(b"k", b"x" * 10)
    with pytest.raises(SerializeError) as raised:
        s.put(b"k", Unpicklable())
    cause = raised.value.__cause__
    assert type(cause) is TypeError, "the codec's own exception, as its cause"
    assert isinstance(cause.__cause__, RuntimeError), "the pickling error, as dask chains it"
    assert "not today" in str(raised.value)
    assert b"k" not in s
    s.check_accounting()


def test_a_light_value_that_cannot_be_pickled_stays_in_memory(make_store):
    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("not today")

        def __sizeof__(self):
            return 600

    s = make_store(target=1000)
    s.put(b"u", Unpicklable())
    s.put(b"v", b"y" * 600)  # evicting "u" fails: it stays, and so does "v"
    assert s.tier(b"u") == "materialized" and s.tier(b"v") == "materialized"
    s.check_accounting()


def test_serialized_frames_stay_serialized_until_asked_for(make_store):
    s = make_store(target=1 << 20)
    frames = codec.dumps({"x": np.arange(10)})
    s.put_serialized(b"f", frames)
    assert s.tier(b"f") == "serialized"
    assert s.memory_bytes == codec.frame_bytes(frames)
    out = s.get_serialized(b"f")
    assert [bytes(f) for f in out] == [bytes(f) for f in frames]
    assert all(memoryview(f).readonly for f in out), "the store keeps these: read-only"
    assert s.tier(b"f") == "serialized"
    value = s.get(b"f")
    np.testing.assert_array_equal(value["x"], np.arange(10))
    assert value["x"].flags.writeable, "copied from the kept frames (writeable=True)"
    assert s.tier(b"f") == "materialized"
    # get_serialized of an object pickles it; plain pickle reads the frames.
    got = s.get_serialized(b"f")
    assert pickle.loads(got[0], buffers=got[1:])["x"].tolist() == list(range(10))


def test_frames_are_held_without_a_copy(make_store):
    s = make_store(target=1 << 20)
    # A bytearray exported to the store cannot be resized (the store's view pins it).
    held = bytearray(100)
    s.put_serialized(b"g", [held])
    with pytest.raises(BufferError):
        held.extend(b"more")
    s.remove(b"g")
    held.extend(b"more")  # released with the entry


def test_metrics_use_dask_labels(make_store):
    s = make_store(target=1000)
    s.put(b"a", b"x" * 900)
    s.put(b"b", b"y" * 900)
    s.get(b"a")
    m = s.metrics()
    for label in ("serialize", "deserialize", "disk-write", "disk-read"):
        for unit in ("count", "bytes", "seconds"):
            assert (label, unit) in m
    assert m["disk-write", "count"] >= 1 and m["disk-read", "count"] >= 1
    assert m["disk-write", "seconds"] > 0


def test_closed_store_refuses_calls(make_store):
    s = make_store()
    s.put(b"a", 1)
    s.close()
    s.close()
    with pytest.raises(ValueError, match="closed"):
        s.get(b"a")


def test_threads_putting_getting_and_removing_keep_values_and_accounting(make_store):
    s = make_store(target=64 << 10)
    expected = {}
    lock = threading.Lock()
    errors = []

    def work(seed):
        rng = random.Random(seed)
        try:
            for _ in range(400):
                k = b"k%d" % rng.randrange(40)
                op = rng.random()
                if op < 0.5:
                    v = np.full(rng.randrange(1, 2000), seed, dtype="u1")
                    with lock:
                        s.put(k, v)
                        expected[k] = v
                elif op < 0.9:
                    with lock:
                        want = expected.get(k)
                    try:
                        got = s.get(k) if want is not None else None
                    except KeyError:  # removed by another thread since
                        got = None
                    if got is not None:
                        assert got.dtype == np.uint8 and len(set(got.tolist())) == 1
                else:
                    with lock:
                        s.remove(k)
                        expected.pop(k, None)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    for k, v in expected.items():
        np.testing.assert_array_equal(s.get(k), v)
    assert len(s) == len(expected)
    s.check_accounting()


def test_engine_messages_reach_python_logging_under_spillway(make_store, caplog_spillway):
    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("not today")

        def __sizeof__(self):
            return 600

    s = make_store(target=1000)
    s.put(b"u", Unpicklable())
    s.put(b"v", b"y" * 600)
    # Emitted by a thread of their own (the engine logs under its lock, where no Python may run).
    assert _flush_logs()
    failed = [
        r
        for r in caplog_spillway.records
        if "Failed to serialize" in r.getMessage() and r.name.startswith("distributed.spillway.")
    ]
    assert len(failed) == 1, caplog_spillway.text
    assert failed[0].name.startswith("distributed.spillway.") and failed[0].levelname == "ERROR"
    assert "not today" in failed[0].getMessage()


def test_a_store_collected_without_close_lets_go_of_its_directory(tmp_path):
    import gc

    s = Store(str(tmp_path / "s"), 1000)
    s.put(b"a", b"x" * 2000)
    del s
    gc.collect()
    # Closed when collected (without the GIL): its directory can be opened again at once.
    s = Store(str(tmp_path / "s"), 1000)
    assert len(s) == 0, "a spill store starts empty"
    s.close()


def test_a_disk_error_keeps_values_in_memory_and_is_logged(make_store, caplog_spillway):
    s = make_store(target=3000, backend="sim")
    s._inject_fault("write", 0, "eio", sticky=True)
    values = {b"k%d" % i: np.full(100, i, dtype="f8") for i in range(6)}
    for k, v in values.items():
        s.put(k, v)  # never raises: the spill fails, the values stay
    assert all(s.tier(k) == "materialized" for k in values)
    for k, v in values.items():
        np.testing.assert_array_equal(s.get(k), v)
    assert _flush_logs()
    failed = [r for r in caplog_spillway.records if "Spill to disk failed" in r.getMessage()]
    assert len(failed) == 1, "reported, at most once per 10 s"
    assert failed[0].levelname == "ERROR"
    s.check_accounting()


def test_peek_and_evict_bytes(make_store):
    s = make_store(target=1 << 20)
    for i in range(5):
        s.put(b"k%d" % i, bytes([i]) * 1000)
    w = s.memory_bytes // 5
    assert s.evict_bytes(2 * w + 1) == 3 * w  # LRU first, until that much has left
    assert [s.tier(b"k%d" % i) for i in range(5)] == ["disk"] * 3 + ["materialized"] * 2
    assert s.peek(b"k0") == bytes([0]) * 1000
    assert s.tier(b"k0") == "disk", "a peek brings nothing back"
    with pytest.raises(KeyError):
        s.peek(b"nope")
