"""Several Python threads: a key read concurrently is unpickled once; mixed operations stay
consistent."""

from __future__ import annotations

import random
import sys
import threading
import time

import pytest

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
    """ "unpickling" if the thread is inside _rebuild, "waiting" if it is inside the store's get
    called from SpillBuffer.__getitem__ (no Python frame above it), else None."""
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
    if names and names[0][0] == "__getitem__":
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
        # The others wait in the key's slot (the store's count of them, not a guess from frames).
        if "unpickling" in states and buf._store._waiters(buf._keys[key]) == N_THREADS - 1:
            states = [_where(t) for t in threads]
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
                    try:
                        buf.evict()
                    except KeyError:
                        pass  # nothing was in memory, as dask's store says it
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
    """The engine's accounting adds up (``check_accounting`` recomputes it from its entries), and the
    buffer's keys are exactly the store's (white box: the key maps)."""
    buf._store.check_accounting()
    in_memory, on_disk = buf._store.keys_by_place()
    stored = set(in_memory) | set(on_disk)
    assert {buf._keys[k] for k in buf} == stored - buf._keys.reserved


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
    # Nothing spilled: the older key is in use, and the new one is not its own set's to spill.
    assert not buf.slow and len(buf.log) == 0
    gate.release.set()
    t.join(60)
    assert not t.is_alive()
    assert out["value"].payload == b"p" * 700
    assert buf["c"] is value
    assert [r.getMessage() for r in caplog_spillway.records if r.name == "distributed.spill"] == []
    assert_consistent(buf)


class Weighs:
    """Holds ``data``; ``sizeof`` says it weighs ``weight`` bytes."""

    def __init__(self, data, weight: int):
        self.data = data
        self.weight = weight

    def __sizeof__(self):
        return self.weight


def test_a_heavy_object_read_from_held_frames_does_not_share_their_memory(make_buffer):
    """Frames held in memory that unpickle to an object heavier than target stay where they are, and
    the object is handed out. It is not built on the frames' memory: a task mutating its input in
    place would otherwise change the value the buffer holds, and what it writes to disk later."""
    np = pytest.importorskip("numpy")
    from spillway import codec

    original = np.arange(1000, dtype="u8")
    frames = codec.dumps(Weighs(original.copy(), 100_000))
    assert len(frames) == 2  # the array is out of band
    frames = [frames[0], bytearray(frames[1])]  # writeable, and the buffer's own
    buf = make_buffer(target=50_000)  # the frames fit, the object does not
    buf.set_serialized("k", frames)
    assert buf.tier("k") == "frames"
    seen = buf["k"]
    assert buf.tier("k") == "frames", "too heavy to keep as an object"
    seen.data[:] = 7  # a task mutating its input in place
    assert (np.frombuffer(frames[1], dtype="u8") == original).all()
    assert buf.evict() > 0 and buf.tier("k") == "disk"
    del seen
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
