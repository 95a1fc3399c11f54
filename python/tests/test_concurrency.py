"""Several Python threads: a key read concurrently is unpickled once; mixed operations stay
consistent."""

from __future__ import annotations

import random
import sys
import threading
import time

import pytest
from conftest import LogWrapper

N_THREADS = 8


class Gate:
    """Counts unpickles of ``Counted`` objects; each unpickle blocks until ``release`` is set."""

    def __init__(self):
        self.count = 0
        self.lock = threading.Lock()
        self.release = threading.Event()
        self.entered = threading.Event()  # set by the first unpickle, before it blocks
        self.fail = False


GATES: dict[int, Gate] = {}


def _rebuild(gate_id: int, payload: bytes) -> Counted:
    gate = GATES[gate_id]
    with gate.lock:
        gate.count += 1
    gate.entered.set()
    assert gate.release.wait(60), "test never released the unpickle"
    if gate.fail:
        raise ValueError("unpickle failed")
    return Counted(gate_id, payload)


class Counted:
    def __init__(self, gate_id: int, payload: bytes):
        self.gate_id = gate_id
        self.payload = payload

    def __reduce__(self):
        return _rebuild, (self.gate_id, self.payload)


def _where(thread: threading.Thread) -> str | None:
    """ "unpickling" if the thread is inside _rebuild, "waiting" if it is blocked in a wait() called
    (directly or not) from SpillBuffer.__getitem__, else None."""
    frame = sys._current_frames().get(thread.ident)
    names = []
    while frame is not None:
        names.append((frame.f_code.co_name, frame.f_code.co_filename))
        frame = frame.f_back
    in_getitem = any(n == "__getitem__" and f.endswith("buffer.py") for n, f in names)
    if not in_getitem:
        return None
    if any(n == "_rebuild" for n, _ in names):
        return "unpickling"
    if names and names[0][0] == "wait":
        return "waiting"
    return None


def read_concurrently(buf, key, gate: Gate):
    """Start N threads that all read ``key``; release the unpickle only once every thread is inside
    ``buf[key]``, either unpickling or waiting. Returns (results, errors)."""
    results = [None] * N_THREADS
    errors = [None] * N_THREADS
    barrier = threading.Barrier(N_THREADS)

    def read(i):
        barrier.wait()
        try:
            results[i] = buf[key]
        except BaseException as e:  # noqa: BLE001
            errors[i] = e

    threads = [threading.Thread(target=read, args=(i,)) for i in range(N_THREADS)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while True:
        states = [_where(t) for t in threads]
        if all(states) and "unpickling" in states:
            break
        assert time.monotonic() < deadline, f"threads never all arrived: {states}"
        time.sleep(0.001)
    gate.release.set()
    for t in threads:
        t.join(60)
    return results, errors, states


@pytest.fixture
def gate():
    g = Gate()
    GATES[id(g)] = g
    yield g
    g.release.set()
    del GATES[id(g)]


@pytest.mark.parametrize("heavy", [False, True], ids=["promoted", "heavy"])
def test_concurrent_get_unpickles_once(make_buffer, gate, heavy):
    buf = make_buffer(target=10 if heavy else 1 << 20)
    buf["x"] = Counted(id(gate), b"p" * 1000)
    if not heavy:
        assert buf.evict() > 0
    assert "x" in buf.slow
    gate.count = 0

    results, errors, states = read_concurrently(buf, "x", gate)
    assert errors == [None] * N_THREADS
    assert gate.count == 1, f"unpickled {gate.count} times"
    assert states.count("unpickling") == 1 and states.count("waiting") == N_THREADS - 1
    assert all(r is results[0] for r in results)
    assert results[0].payload == b"p" * 1000
    assert buf.cumulative_metrics["disk-read", "count"] == 1
    if heavy:
        assert "x" in buf.slow
    else:
        assert "x" in buf.fast and buf["x"] is results[0]


def test_concurrent_get_of_held_frames_unpickles_once(make_buffer, gate):
    src = make_buffer()
    src["x"] = Counted(id(gate), b"q" * 100)
    frames = src.get_serialized("x")
    buf = make_buffer()
    buf.set_serialized("x", frames)
    assert buf.tier("x") == "frames"
    results, errors, _ = read_concurrently(buf, "x", gate)
    assert errors == [None] * N_THREADS and gate.count == 1
    assert all(r is results[0] for r in results)
    assert buf.tier("x") == "object"


def test_failed_unpickle_wakes_waiters_with_the_error_and_keeps_the_data(make_buffer, gate):
    buf = make_buffer()
    buf["x"] = Counted(id(gate), b"r" * 100)
    buf.evict()
    gate.count = 0
    gate.fail = True
    results, errors, _ = read_concurrently(buf, "x", gate)
    assert gate.count == 1
    assert all(isinstance(e, ValueError) for e in errors), errors
    assert results == [None] * N_THREADS
    assert "x" in buf.slow and buf.spilled_total.disk > 0

    gate.fail = False
    assert buf["x"].payload == b"r" * 100  # the data survived
    assert "x" in buf.fast


def test_mixed_operations_from_many_threads(make_buffer):
    """Random set/set_serialized/get/del/evict/get_serialized from 6 threads; every read returns a value that was
    set for that key, and the accounting adds up at the end."""
    buf = make_buffer(target=200_000)
    n_keys = 40

    def value(key, version):
        return (key, version, bytes([version % 256]) * random.Random(version).randrange(1, 30_000))

    errors = []

    def work(seed):
        rng = random.Random(seed)
        try:
            for i in range(400):
                key = rng.randrange(n_keys)
                op = rng.random()
                if op < 0.4:
                    buf[key] = value(key, seed * 10_000 + i)
                elif op < 0.75:
                    try:
                        v = buf[key]
                    except KeyError:
                        continue
                    assert v[0] == key and v[2] == value(key, v[1])[2]
                elif op < 0.85:
                    try:
                        del buf[key]
                    except KeyError:
                        pass
                elif op < 0.9:
                    # Data from a peer: held pickled until a reader unpickles it.
                    from spillway import codec

                    buf.set_serialized(key, codec.dumps(value(key, seed * 10_000 + i)))
                elif op < 0.95:
                    try:
                        frames = buf.get_serialized(key)
                    except KeyError:
                        continue
                    import pickle

                    v = pickle.loads(frames[0], buffers=frames[1:])
                    assert v[0] == key
                else:
                    buf.evict()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(6)]
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # many more thread switches, so many more interleavings
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch_interval)
    assert errors == []
    assert_consistent(buf)
    assert buf.fast.total_weight <= buf.target or buf.evict() == -1
    for key in list(buf):
        assert buf[key][0] == key
    assert_consistent(buf)


def assert_consistent(buf):
    """The bookkeeping agrees with the entries and with the log (white box)."""
    buf._drain()
    with buf._lock:
        entries = buf._entries
        in_memory = {k for k, e in entries.items() if e.tier.value != "disk"}
        on_disk = {k: e for k, e in entries.items() if e.tier.value == "disk"}
        assert set(buf._lru) == in_memory
        assert set(buf._heavy) <= in_memory
        assert buf._memory_weight == sum(entries[k].weight for k in in_memory)
        assert buf._evicting_weight == 0 and buf._reserved_disk == 0
        assert not any(e.evicting or e.loading is not None for e in entries.values())
        assert buf.spilled_total.memory == sum(e.weight for e in on_disk.values())
        assert buf.spilled_total.disk == sum(e.disk_bytes for e in on_disk.values())
        # Records: the values on disk, and the copies of values in memory (read back from disk, or
        # written ahead by the background writer).
        copies = {k: e for k, e in entries.items() if e.tier.value != "disk" and e.log_key}
        assert all(e.crc is not None for e in copies.values())
        assert not any(e.cleaning for e in entries.values())
        recorded = [*on_disk.values(), *copies.values()]
        assert buf.log.disk_bytes == sum(e.disk_bytes for e in recorded)
        assert sorted(buf.log.keys()) == sorted(e.log_key for e in recorded)


class BlockingPut:
    """Wraps a SpillBuffer's Log: the first ``put`` signals ``entered``, waits for ``release``."""

    def __init__(self, log):
        self.inner = log
        self.entered = threading.Event()
        self.release = threading.Event()
        self.blocked = False

    def put(self, key, frames):
        if not self.blocked:
            self.blocked = True
            self.entered.set()
            assert self.release.wait(60), "test never released the write"
        return self.inner.put(key, frames)

    def __len__(self):
        return len(self.inner)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_an_object_read_again_while_its_frames_are_spilled_is_spilled_once(make_buffer):
    """Frames that unpickle to an object heavier than target are spilled by their first reader. A
    second reader, served from the weak cache while that write is in flight, does not mark the key
    for spilling again: the first reader would then pickle the key's (by then empty) value into a
    second record and raise KeyError, or, after ``evict()``, every later eviction would raise
    KeyError."""
    from spillway import codec

    obj = list(range(100_000))
    frames = codec.dumps(obj)
    light, heavy = codec.frame_bytes(frames), codec.sizeof(obj)
    assert light < heavy, (light, heavy)
    buf = make_buffer(target=(light + heavy) // 2)  # the frames fit, the object does not
    log = BlockingPut(buf._log)
    buf._log = log
    buf.set_serialized("k", frames)
    assert buf.tier("k") == "frames"
    first = {}

    def owner():
        try:
            first["value"] = buf["k"]
        except BaseException as e:  # noqa: BLE001
            first["value"] = e

    t = threading.Thread(target=owner)
    t.start()
    # The owner unpickled the frames, found the object too heavy, and is writing them to disk.
    assert log.entered.wait(60)
    assert buf["k"] == obj  # from the weak cache, while the write is in flight
    log.release.set()
    t.join(60)
    assert not t.is_alive()
    assert first["value"] == obj
    assert buf.tier("k") == "disk"
    buf._drain()
    assert len(buf.log) == 1, "spilled once"
    assert_consistent(buf)
    assert buf.evict() == -1  # nothing left in memory, and no error
    del buf["k"]
    buf["x"] = b"small"
    assert buf.evict() > 0
    assert_consistent(buf)


class BlockingGet(LogWrapper):
    """Wraps a SpillBuffer's Log: the first ``get`` signals ``entered`` and waits for ``release``
    before reading."""

    def __init__(self, log):
        super().__init__(log)
        self.entered = threading.Event()
        self.release = threading.Event()
        self.blocked = False

    def get(self, key):
        if not self.blocked:
            self.blocked = True
            self.entered.set()
            assert self.release.wait(60), "test never released the read"
        return self.inner.get(key)


def _in_thread(fn):
    """Run ``fn`` in a thread; returns (thread, result dict with "value" or "error")."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    return t, out


@pytest.mark.parametrize("how", ["get_serialized", "peek"])
def test_a_read_from_disk_racing_a_promotion_finds_the_key_where_it_went(make_buffer, how):
    """A reader of a spilled key (``get_serialized``, a peer's path; ``items()``) whose record is
    deleted under it, because another thread brought the key back into memory, reads it from
    memory instead of raising KeyError for a key that is there (or, for a large record, reporting
    it as damaged)."""
    import pickle

    buf = make_buffer(target=1 << 20)
    value = ("v", bytes(300_000))
    buf["k"] = value
    assert buf.evict() > 0 and buf.tier("k") == "disk"
    log = BlockingGet(buf._log)
    buf._log = log
    if how == "get_serialized":

        def read():
            frames = buf.get_serialized("k")
            return pickle.loads(frames[0], buffers=frames[1:])

        t, out = _in_thread(read)
    else:
        t, out = _in_thread(lambda: buf.slow["k"])
    assert log.entered.wait(60)
    assert buf["k"] == value  # read, promoted, its record deleted
    assert buf.tier("k") == "object"
    log.release.set()
    t.join(60)
    assert not t.is_alive()
    assert out.get("value") == value, out
    assert_consistent(buf)


def test_a_get_racing_a_set_of_the_same_key_returns_a_value(make_buffer):
    """A reader of a spilled key whose record is deleted under it because the key was set again
    returns the new value (waiters of the same read too), not KeyError."""
    buf = make_buffer(target=1 << 20)
    buf["k"] = ("old", bytes(300_000))
    assert buf.evict() > 0 and buf.tier("k") == "disk"
    log = BlockingGet(buf._log)
    buf._log = log
    t, out = _in_thread(lambda: buf["k"])
    assert log.entered.wait(60)
    buf["k"] = ("new", b"")
    buf._drain()  # the background writer deleted the old record
    log.release.set()
    t.join(60)
    assert not t.is_alive()
    assert out.get("value") == ("new", b""), out
    assert_consistent(buf)


class _Refuses:
    """A light value that cannot be pickled."""

    def __init__(self, payload: bytes):
        self.payload = payload

    def __reduce__(self):
        raise TypeError("this object refuses to be pickled")

    def __sizeof__(self):
        return object.__sizeof__(self) + len(self.payload)


@pytest.mark.parametrize("picklable", [True, False], ids=["picklable", "unpicklable"])
def test_a_light_key_set_while_the_older_keys_are_busy_is_not_spilled_by_its_own_set(
    make_buffer, gate, caplog_spillway, picklable
):
    """The only older key in memory is being unpickled (it cannot be spilled meanwhile) when a
    light key pushes memory above target. As in dask (zict.LRU spills the LRU head, never the key
    just set unless it is heavier than target), the new key stays in memory: spilled by its own
    set, it would, if it could not be pickled, be forgotten with a PickleError that dask raises
    only for values heavier than target."""
    from spillway import codec

    buf = make_buffer(target=1000)
    buf.set_serialized("a", codec.dumps(Counted(id(gate), b"p" * 700)))
    assert buf.tier("a") == "frames" and 700 < buf.fast.total_weight < 1000
    t, out = _in_thread(lambda: buf["a"])
    assert gate.entered.wait(60)  # "a" is being unpickled
    value = bytes(400) if picklable else _Refuses(b"y" * 400)
    weight = codec.sizeof(value)
    assert weight < buf.target < buf.fast.total_weight + weight
    buf["c"] = value
    assert buf.tier("c") == "object" and buf["c"] is value
    buf._drain()
    # Nothing spilled. (The background writer may have written copies: their values stay in memory.)
    assert not buf.slow and set(buf.log.keys()) <= {e.log_key for e in buf._entries.values()}
    gate.release.set()
    t.join(60)
    assert not t.is_alive()
    assert out["value"].payload == b"p" * 700
    assert buf["c"] is value
    assert [r.getMessage() for r in caplog_spillway.records if r.name == "spillway"] == []
    assert_consistent(buf)


@pytest.mark.parametrize("how", ["del", "get"])
def test_a_key_dropped_or_read_while_being_spilled_stops_counting_as_leaving_memory(
    make_buffer, how
):
    """While a key is being written to disk its weight counts as leaving memory. If it is deleted,
    or unpickled back into an object, meanwhile, it no longer is (the write is thrown away): were
    its weight to keep counting until the write returned, the sets made meanwhile would spill too
    little, and nothing would spill the rest afterwards."""
    from spillway import codec

    buf = make_buffer(target=1000)
    if how == "del":
        buf["a"] = bytes(600)
    else:
        buf.set_serialized("a", codec.dumps(bytes(600)))
    log = BlockingPut(buf._log)
    buf._log = log
    t, out = _in_thread(buf.evict)
    assert log.entered.wait(60)  # "a" is being written
    if how == "del":
        del buf["a"]
    else:
        assert buf["a"] == bytes(600) and buf.tier("a") == "object"
    buf["b"] = bytes(600)
    buf["c"] = bytes(600)
    if how == "del":
        # At once, not only when the write returns (which can take long). (An unpickled key is
        # still being written, so it cannot be spilled anew until then.)
        assert buf.fast.total_weight <= buf.target, (buf.fast.total_weight, list(buf.fast))
    log.release.set()
    t.join(60)
    assert not t.is_alive() and "error" not in out, out
    assert buf.fast.total_weight <= buf.target, (buf.fast.total_weight, list(buf.fast))
    assert_consistent(buf)


class BlockingDelete:
    """Wraps a SpillBuffer's Log: the first ``delete`` signals ``entered``, waits for ``release``."""

    def __init__(self, log):
        self.inner = log
        self.entered = threading.Event()
        self.release = threading.Event()
        self.blocked = False

    def delete(self, key):
        if not self.blocked:
            self.blocked = True
            self.entered.set()
            assert self.release.wait(60), "test never released the delete"
        return self.inner.delete(key)

    def __len__(self):
        return len(self.inner)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("how", ["del", "set", "clear", "get", "lost-race"])
def test_deleting_a_record_does_not_block_other_keys(make_buffer, how):
    """Deleting a record from the log (which may punch holes and unlink segment files) runs on the
    buffer's background writer: neither the caller nor a read of another key in memory waits for
    it. Deletes come from ``del``, a set replacing a spilled key, ``clear()``, a read bringing a
    key back into memory and an eviction whose write lost a race with a ``del``. (A read deletes
    the record only where it keeps no copy of it: with ``max_spill`` set.)"""
    buf = make_buffer(target=1 << 20, max_spill=(1 << 30) if how == "get" else False)
    buf["x"] = ("x", bytes(1000))
    if how != "lost-race":
        assert buf.evict() > 0 and buf.tier("x") == "disk"
    buf["y"] = ("y", b"")
    log = BlockingDelete(BlockingPut(buf._log))
    buf._log = log
    if how == "lost-race":
        log.inner.blocked = False  # the eviction of "x" blocks in put, then in delete
        buf._lru.move_to_end("y")
        t, out = _in_thread(buf.evict)
        assert log.inner.entered.wait(60)
        del buf["x"]  # while it is being written: the write is thrown away
        log.inner.release.set()
    else:
        log.inner.blocked = True  # puts do not block
        op = {
            "del": lambda: buf.__delitem__("x"),
            "set": lambda: buf.__setitem__("x", ("x2", b"")),
            "clear": buf.clear,
            "get": lambda: buf["x"],
        }[how]
        t, out = _in_thread(op)
    try:
        assert log.entered.wait(60)  # the delete of the record of "x" is under way
        t.join(10)
        assert not t.is_alive(), "the caller waited for a disk delete"
        reader, got = _in_thread(lambda: buf["y"])
        reader.join(10)
        assert not reader.is_alive(), "a read of a key in memory waited for a disk delete"
        if how == "clear":
            assert isinstance(got.get("error"), KeyError), got
        else:
            assert got.get("value") == ("y", b""), got
    finally:
        log.release.set()
        log.inner.release.set()
        t.join(60)
    assert not t.is_alive() and "error" not in out, out
    assert_consistent(buf)


class Weighs:
    """Holds ``data``; ``sizeof`` says it weighs ``weight`` bytes."""

    def __init__(self, data, weight: int):
        self.data = data
        self.weight = weight

    def __sizeof__(self):
        return self.weight


def test_a_heavy_object_read_from_held_frames_does_not_share_their_memory(make_buffer):
    """Frames held in memory that unpickle to an object heavier than target are spilled, and the
    object is handed out. It is not built on the writeable frames themselves: such an object, handed
    out (to the other readers, through the weak cache) before or while those frames are written,
    would let a task mutating its input in place change (or tear) the record being written."""
    import gc

    np = pytest.importorskip("numpy")
    from spillway import codec

    original = np.arange(1000, dtype="u8")
    frames = codec.dumps(Weighs(original.copy(), 100_000))
    assert len(frames) == 2  # the array is out of band
    frames = [frames[0], bytearray(frames[1])]  # writeable, and the buffer's own
    buf = make_buffer(target=50_000)  # the frames fit, the object does not
    buf.set_serialized("k", frames)
    assert buf.tier("k") == "frames"
    log = BlockingPut(buf._log)
    buf._log = log
    t, out = _in_thread(lambda: buf["k"])
    assert log.entered.wait(60)  # the first reader found the object too heavy: writing its frames
    seen = buf["k"]
    seen.data[:] = 7  # a task mutating its input in place
    log.release.set()
    t.join(60)
    assert not t.is_alive() and "error" not in out, out
    buf._drain()
    assert buf.tier("k") == "disk" and len(buf.log) == 1
    del seen
    out.clear()
    gc.collect()
    assert buf._weak.get("k") is None  # what is read next comes from disk
    assert (buf["k"].data == original).all()
    assert_consistent(buf)


def test_a_peeked_object_does_not_share_the_memory_of_frames_held_in_memory(make_buffer):
    """``fast[k]`` (and ``items()``, ``values()``) build the object of frames held in memory
    without moving them, not on the frames' writeable memory: built on it, an in-place change by
    the caller would reach the stored value, and later its record."""
    np = pytest.importorskip("numpy")
    from spillway import codec

    original = np.arange(1000, dtype="u8")
    frames = codec.dumps(original.copy())
    assert len(frames) == 2  # the array is out of band
    buf = make_buffer(target=1 << 20)
    buf.set_serialized("k", [frames[0], bytearray(frames[1])])  # writeable, and the buffer's own
    assert buf.tier("k") == "frames"
    peeked = buf.fast["k"]
    peeked[:] = 7
    assert buf.tier("k") == "frames"
    assert (buf["k"] == original).all()
    assert_consistent(buf)
