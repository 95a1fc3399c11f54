"""dask's spill-buffer contract, run on both stores in the same test run.

Every scenario here drives ``distributed.spill.SpillBuffer`` and ``spillway.SpillBuffer`` through
the same public API (the mapping, ``fast``/``memory``, ``slow``/``disk``, ``spilled_total``,
``evict()``, ``cumulative_metrics``, the messages dask's logger ``distributed.spill`` carries and
their rate limits, the weak-reference cache, ``max_spill``, disk errors) and records what a caller
sees. The two records must be equal; where dask's behaviour is the point, it is also asserted
outright. A change of either store's behaviour shows here as a failure.

Sizes are chosen away from the limits a store's own serialization format would move (dask frames
its pickles with a msgpack header; spillway stores the pickle frames alone).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import re
import subprocess
import uuid

import pytest

spill = pytest.importorskip("distributed.spill")
np = pytest.importorskip("numpy")

from dask.sizeof import sizeof  # noqa: E402
from distributed.utils import RateLimiterFilter  # noqa: E402

import spillway  # noqa: E402

STORES = ("dask", "spillway")


@pytest.fixture
def make(tmp_path):
    """``make(store, target, max_spill=False, directory=None)``: a buffer of either store."""
    made = []

    def make(store: str, target: int, max_spill=False, directory=None):
        d = str(directory or tmp_path / store)
        os.makedirs(d, exist_ok=True)
        if store == "dask":
            buf = spill.SpillBuffer(d, target=target, max_spill=max_spill)
        else:
            buf = spillway.SpillBuffer(d, target=target, max_spill=max_spill)
            made.append(buf)
        return buf

    yield make
    for buf in made:
        buf.close()


@contextlib.contextmanager
def spill_log():
    """What ``distributed.spill`` logs meanwhile (dask's ``captured_logger``), rate limits reset
    first as dask's tests reset them."""
    RateLimiterFilter.reset_timer("distributed.spill")
    from distributed.utils_test import captured_logger

    with captured_logger("distributed.spill", level=logging.INFO) as sio:
        yield sio


def state(buf) -> tuple:
    """What a caller sees of a buffer: keys in memory in iteration order with their values'
    identity-free reprs, keys on disk in iteration order, the mapping's order, weights."""
    return (
        list(buf.fast),
        list(buf.slow),
        list(buf),
        len(buf),
        len(buf.fast),
        len(buf.slow),
        bool(buf.fast),
        buf.fast.total_weight,
        buf.spilled_total.memory,
        {k: sizeof(v) for k, v in buf.fast.items()},
    )


def both(make, scenario, *args, **kwargs):
    """Run ``scenario(buf, *args)`` on each store; assert that both saw the same; return it."""
    seen = {store: scenario(make(store, *args, **kwargs)) for store in STORES}
    assert seen["spillway"] == seen["dask"]
    return seen["dask"]


# --------------------------------------------------------------------------------------------------
# The mapping, LRU order and tiers


def lru_walk(buf) -> list:
    trace = [state(buf)]
    a, b, c, d = "a" * 100, "b" * 99, "c" * 98, "d" * 97
    buf["a"] = a
    trace.append(state(buf))
    trace.append(buf["a"] == a)
    buf["b"] = b
    trace.append(state(buf))
    buf["c"] = c  # evicts a
    trace.append(state(buf))
    trace.append(buf["a"] == a)  # a back, b out
    trace.append(state(buf))
    buf["d"] = d
    trace.append(state(buf))
    del buf["a"]
    trace.append(state(buf))
    with pytest.raises(KeyError):
        buf["a"]
    del buf["b"]
    trace.append(state(buf))
    buf["c"] = c * 2  # a spilled key set again: memory, most recent
    trace.append(state(buf))
    buf["e"] = "e" * 500  # heavier than target: straight to disk
    trace.append(state(buf))
    buf["d"] = "d" * 500  # a spilled key replaced by a heavy one: disk
    trace.append(state(buf))
    for k, v in buf.fast.items():
        trace.append(buf[k] is v)
    return trace


def test_lru_walk(make):
    trace = both(make, lru_walk, 300)
    assert trace[-2][:2] == (["c"], ["e", "d"])


def reads_reorder_eviction_not_iteration(buf) -> list:
    for k in "abcd":
        buf[k] = bytes(200)
    buf["a"]
    buf["c"]
    trace = [state(buf)]
    buf["e"] = bytes(300)  # evicts the least recently used: b then d
    trace.append(state(buf))
    trace.append(buf.evict())
    trace.append(state(buf))
    buf["b"]  # back from disk: enters memory last
    trace.append(state(buf))
    return trace


def test_reads_reorder_eviction_not_iteration(make):
    trace = both(make, reads_reorder_eviction_not_iteration, 1000)
    # dask: fast iterates in the order keys entered memory; reads only move them in the LRU
    assert trace[1][0] == ["a", "c", "d", "e"]
    assert trace[3][0] == ["a", "c", "e"]


def int_and_str_keys(buf) -> list:
    buf[1] = 10
    buf["1"] = 20
    trace = [set(buf.keys()), dict(buf), bool(buf.slow)]
    buf.evict()
    buf.evict()
    trace += [bool(buf.fast), set(buf.keys()), dict(buf), state(buf)]
    return trace


def test_int_and_str_keys(make):
    trace = both(make, int_and_str_keys, 100_000)
    assert trace[0] == {1, "1"}


def test_views_and_pop(make):
    for store in STORES:
        buf = make(store, 100)
        assert buf.memory is buf.fast
        assert buf.disk is buf.slow
        with pytest.raises(NotImplementedError):
            buf.pop("x", None)


def test_evict_with_nothing_in_memory(make):
    raised = {}
    for store in STORES:
        buf = make(store, 100)
        with pytest.raises(KeyError) as e:
            buf.evict()
        raised[store] = str(e.value)
    assert raised["spillway"] == raised["dask"]


def evict_returns_weight(buf) -> list:
    a = "a" * 100
    buf["a"] = a
    return [buf.evict(), state(buf), buf["a"] == a, state(buf)]


def test_evict_returns_the_weight(make):
    trace = both(make, evict_returns_weight, 300)
    assert trace[0] == sizeof("a" * 100)


def update_in_memory_and_on_disk(buf) -> list:
    buf["x"] = "x" * 100
    buf["y"] = "y" * 100
    buf["x"] = "X" * 150  # update in memory: re-enters last
    trace = [state(buf)]
    buf.evict()
    buf["y"] = "Y" * 120  # update of a spilled key
    trace.append(state(buf))
    buf["z"] = "z" * 100
    trace += [state(buf), buf["x"], buf["y"], state(buf)]
    return trace


def test_updates(make):
    both(make, update_in_memory_and_on_disk, 350)


def numpy_values(buf) -> list:
    rng = np.random.default_rng(0)
    arrays = {f"a{i}": rng.random(1000) for i in range(6)}
    arrays["ro"] = np.frombuffer(rng.random(1000).tobytes())  # read-only
    arrays["f"] = np.asfortranarray(rng.random((40, 25)))
    arrays["obj"] = np.array(["x", 1, None], dtype=object)
    for k, v in arrays.items():
        buf[k] = v
    trace = [state(buf)]
    for k, v in arrays.items():
        got = buf[k]
        trace.append(
            (
                k,
                type(got).__name__,
                got.dtype.str,
                got.shape,
                got.flags.writeable,
                got.flags.c_contiguous,
                got.flags.f_contiguous,
                got.tolist() == v.tolist(),
            )
        )
    return trace


def test_numpy_values_come_back_as_dask_gives_them(make):
    trace = both(make, numpy_values, 20_000)
    assert any(t[0] == "ro" and t[4] is False for t in trace[1:])


# --------------------------------------------------------------------------------------------------
# The weak-reference cache


class NoWeakRef:
    """Reports a size; no weak references; a new ``id`` each time it is unpickled."""

    __slots__ = ("id", "size")

    def __init__(self, size):
        self.size = size
        self.id = uuid.uuid4()

    def __sizeof__(self):
        return self.size

    def __reduce__(self):
        return (type(self), (self.size,))


class SupportsWeakRef(NoWeakRef):
    __slots__ = ("__weakref__",)


def weakref_cache(buf, cls, size) -> list:
    x = cls(size)
    buf["x"] = x
    if size < 100:
        buf["y"] = cls(60)  # spills x
    trace = ["x" in buf.slow, buf["x"] is x]
    id_x = x.id
    del x
    gc.collect()
    if size < 100:
        buf["y"]
    trace.append("x" in buf.slow)
    x2 = buf["x"]
    trace.append(x2.id != id_x)
    if size < 100:
        buf["y"]
    trace += ["x" in buf.slow, buf["x"] is x2]
    if "x" in buf.slow:
        trace.append(buf.slow["x"] is x2)
    return trace


@pytest.mark.parametrize("cls", [SupportsWeakRef, NoWeakRef])
@pytest.mark.parametrize("size", [60, 110])
def test_weakref_cache(make, cls, size):
    trace = {store: weakref_cache(make(store, 100), cls, size) for store in STORES}
    assert trace["spillway"] == trace["dask"]
    assert trace["dask"][1] == (cls is SupportsWeakRef)


# --------------------------------------------------------------------------------------------------
# max_spill and its message


def max_spill(buf) -> list:
    kib = 1000
    a, b, c, e = "a" * 250 * kib, "b" * 100 * kib, "c" * 99 * kib, "e" * 98 * kib
    trace = []
    with spill_log() as log:
        buf["a"] = a  # heavier than target, under max_spill: disk
        buf["b"] = b
        buf["c"] = c  # b + c under target
    trace += [state(buf), log.getvalue()]
    with spill_log() as log:
        buf["e"] = e  # b goes to disk
    trace += [state(buf), log.getvalue()]
    with spill_log() as log:
        buf["d"] = "d" * 250 * kib  # heavier than target, no room on disk: memory; nor for c
    trace += [state(buf), log.getvalue(), buf.fast["d"] is buf["d"]]
    with spill_log() as log:
        buf["a"] = "a" * 900 * kib  # a spilled key replaced by one heavier than max_spill
    trace += [state(buf), log.getvalue()]
    return trace


def test_max_spill(make):
    trace = both(make, max_spill, 200_000, 400_000)
    assert trace[1] == trace[3] == ""
    assert trace[5] == "Spill file on disk reached capacity; keeping data in memory\n"
    assert trace[4][:2] == (["c", "e", "d"], ["a", "b"])
    assert trace[8] == trace[5]


def test_max_spill_message_is_rate_limited(make):
    seen = {}
    for store in STORES:
        buf = make(store, 100, 400)
        buf["a"] = "a" * 200  # on disk
        RateLimiterFilter.reset_timer("distributed.spill")
        from distributed.utils_test import captured_logger

        with captured_logger("distributed.spill") as log:
            buf["b"] = "b" * 200  # no room: logged
            buf["c"] = "c" * 200  # no room: within 10 s, not logged
        seen[store] = (log.getvalue(), state(buf))
    assert seen["spillway"] == seen["dask"]
    assert seen["dask"][0].count("reached capacity") == 1


# --------------------------------------------------------------------------------------------------
# Values that fail to pickle


class CustomError(Exception):
    pass


class Bad:
    def __init__(self, size):
        self.size = size

    def __getstate__(self):
        raise CustomError()

    def __sizeof__(self):
        return self.size


def fail_to_pickle(buf) -> list:
    trace = []
    with spill_log() as log:
        with pytest.raises(TypeError) as e:
            buf["a"] = Bad(201)  # heavier than target: the set fails, the key is forgotten
    err = e.value
    trace += [
        str(err),
        type(err.__cause__).__name__,
        re.sub("0x[0-9a-f]+", "0x?", str(err.__cause__)),
        type(err.__cause__.__cause__).__name__,
        log.getvalue(),
        state(buf),
    ]
    bad = Bad(100)
    buf["b"] = bad
    trace.append(state(buf))
    with spill_log() as log:
        buf["c"] = "c" * 100  # b would be spilled: cannot, stays, logged with its traceback
    text = log.getvalue()
    trace += [
        "Failed to pickle 'b'" in text,
        "Traceback" in text,
        "CustomError" in text,
        state(buf),
    ]
    with spill_log() as log:
        trace.append(buf.evict())  # b again: -1, logged once per key only
    trace += [log.getvalue(), state(buf), sorted(buf.logged_pickle_errors, key=repr)]
    del buf["b"]
    trace.append(sorted(buf.logged_pickle_errors, key=repr))
    return trace


def test_fail_to_pickle(make):
    trace = both(make, fail_to_pickle, 200, 600)
    assert trace[0] == "Failed to pickle 'a'"
    assert trace[3] == "CustomError"
    assert trace[4] == ""  # the worker logs the task's error; the store stays silent
    assert trace[7:10] == [True, True, True]


def test_fail_to_pickle_on_evict(make):
    def scenario(buf):
        buf["a"] = "a" * 100
        trace = [buf.evict(), state(buf)]
        buf["bad"] = Bad(100)
        with spill_log() as log:
            trace.append(buf.evict())
        return trace + ["Failed to pickle" in log.getvalue(), state(buf)]

    trace = both(make, scenario, 300)
    assert trace[2] == -1 and trace[3] is True


# --------------------------------------------------------------------------------------------------
# Disk errors


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of 8 MiB (needs the right to mount; skipped otherwise), filled at will with
    ``fill()``/``free()``."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    filler = mnt / "filler"

    class Disk:
        path = mnt

        def fill(self):
            with open(filler, "ab", buffering=0) as f:
                for size in (64 << 10, 512, 1):
                    with contextlib.suppress(OSError):
                        while True:
                            f.write(b"\0" * size)

        def free(self):
            filler.unlink(missing_ok=True)

    yield Disk()
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def disk_full(buf, disk) -> list:
    # Values of several pages: none fits in what is left of a page already written.
    kib = 1000
    a, b, c, d = "a" * 20 * kib, "b" * 10 * kib, "c" * 21 * kib, "d" * 11 * kib
    buf["a"] = a  # disk
    buf["b"] = b
    trace = [state(buf)]
    disk.fill()
    with spill_log() as log:
        buf["c"] = c  # heavier than target: cannot be written, stays in memory
    trace += [state(buf), "Spill to disk failed; keeping data in memory" in log.getvalue()]
    del buf["c"]
    trace.append(state(buf))
    with spill_log() as log:
        buf["d"] = d  # evicts b: fails, b stays
    trace += [state(buf), "Spill to disk failed" in log.getvalue()]
    disk.free()
    buf["e"] = "e" * 15 * kib  # room again: spilling resumes
    trace.append(state(buf))
    trace += [buf["a"] == a, buf["b"] == b, buf["d"] == d, state(buf)]
    return trace


def test_reading_back_while_the_disk_is_full(make, small_disk):
    """A read back whose eviction of other keys meets a full disk returns the value, raises
    nothing and loses nothing; spilling resumes once there is room. (Which keys end up on disk
    depends on where each store's bytes lie: dask frees the file of the key read back before it
    writes the evicted one; spillway keeps the record as the value's copy, and a log frees space
    by segments, so on a full disk the evicted key stays in memory and "Spill to disk failed"
    says so.)"""
    for store in STORES:
        small_disk.free()
        buf = make(store, 20_000, directory=small_disk.path / store)
        buf["a"] = "a" * 15_000
        buf["b"] = "b" * 15_000  # a goes to disk
        small_disk.fill()
        with spill_log() as log:
            assert buf["a"] == "a" * 15_000  # b has to go
        assert set(buf) == {"a", "b"}
        if "b" in buf.fast:
            assert "Spill to disk failed" in log.getvalue()
        small_disk.free()
        buf["c"] = "c" * 15_000
        assert (buf["a"], buf["b"], buf["c"]) == ("a" * 15_000, "b" * 15_000, "c" * 15_000)
        assert len(buf.slow) == 2, store


# --------------------------------------------------------------------------------------------------
# Metrics


def metrics(buf) -> list:
    a = "a" * 20_000
    c = os.urandom(30_000)
    d = "d" * 40_000
    buf["a"] = a
    buf["b"] = "b"
    del buf["b"]
    _ = buf["a"]  # from memory
    buf["c"] = c  # a goes to disk
    buf.evict()  # c goes to disk
    buf["d"] = d  # heavier than target: disk
    _ = buf["c"]  # read back, kept
    _ = buf["d"]  # read back, served from disk
    m = buf.cumulative_metrics
    counts = {k: v for k, v in m.items() if k[1] == "count"}
    return [
        state(buf),
        sorted(k for k in m if k[0] not in ("compress", "decompress")),
        counts,
        m["memory-read", "bytes"],
        all(v > 0 for v in m.values()),
    ]


def test_cumulative_metrics(make):
    trace = both(make, metrics, 35_000)
    assert trace[2] == {
        ("disk-read", "count"): 2,
        ("disk-write", "count"): 3,
        ("memory-read", "count"): 1,
    }
    assert trace[3] == sizeof("a" * 20_000)


# --------------------------------------------------------------------------------------------------
# dask's serialization families


class OnlyDaskSerializes:
    """dask serializes it with the family registered below (as it does h5py datasets, netCDF4
    variables or a user's types); pickled, it loses its payload (as a handle on an open file
    would)."""

    def __init__(self, payload: bytes):
        self.payload = payload

    def __reduce__(self):
        return OnlyDaskSerializes, (b"",)

    def __sizeof__(self):
        return 100 + len(self.payload)

    def __eq__(self, other):
        return type(other) is OnlyDaskSerializes and other.payload == self.payload


@pytest.fixture(scope="module")
def dask_family():
    from distributed.protocol import dask_deserialize, dask_serialize

    @dask_serialize.register(OnlyDaskSerializes)
    def _ser(x):
        return {"n": len(x.payload)}, [x.payload]

    @dask_deserialize.register(OnlyDaskSerializes)
    def _de(header, frames):
        assert len(frames[0]) == header["n"]
        return OnlyDaskSerializes(bytes(frames[0]))

    yield
    # (dispatch tables have no unregister; the type is this module's own)


def families(buf) -> list:
    one = OnlyDaskSerializes(os.urandom(5000))
    several = [OnlyDaskSerializes(os.urandom(300)) for _ in range(3)]
    buf["one"] = one  # heavier than target: straight to disk
    buf["several"] = several
    buf["x"] = "x" * 4000  # pushes "several" out
    trace = [state(buf), buf["one"] == one]
    del one
    gc.collect()
    trace += [buf["one"] == buf.slow["one"], buf["several"] == several, state(buf)]
    return trace


def test_values_of_dask_serialization_families_spill_as_dask_spills_them(make, dask_family):
    trace = both(make, families, 4500)
    assert trace[0][1] == ["one", "several"]
