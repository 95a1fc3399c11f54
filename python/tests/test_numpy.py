"""numpy arrays: out-of-band frames, no extra copies, writeable results, weak-reference identity."""

from __future__ import annotations

import gc
import pickle
import weakref

import pytest

np = pytest.importorskip("numpy")


def base_of(arr):
    """The object that owns an array's memory: the end of its ``.base`` chain, or the exporter
    behind it if that is a memoryview."""
    base = arr
    while isinstance(base, np.ndarray):
        base = base.base
    return base.obj if isinstance(base, memoryview) else base


def owner(frame):
    """The object that owns a frame's memory."""
    return frame.obj if isinstance(frame, memoryview) else frame


def test_array_is_stored_as_header_plus_out_of_band_buffer(make_buffer):
    buf = make_buffer(target=0)
    arr = np.arange(1 << 16, dtype="u8")
    buf["a"] = arr
    frames = buf.get_serialized("a")
    assert len(frames) == 2
    assert memoryview(frames[0]).nbytes < 1000  # the pickle header only
    assert memoryview(frames[1]).nbytes == arr.nbytes
    assert bytes(frames[1]) == arr.tobytes()
    assert buf.spilled_total.disk == arr.nbytes + memoryview(frames[0]).nbytes


def test_many_buffers_are_many_frames_not_joined(make_buffer):
    buf = make_buffer(target=0)
    value = {"a": np.ones(1000), "b": np.zeros(2000, dtype="i4"), "c": "text"}
    buf["v"] = value
    frames = buf.get_serialized("v")
    assert sorted(memoryview(f).nbytes for f in frames[1:]) == [8000, 8000]
    out = buf["v"]
    np.testing.assert_array_equal(out["a"], value["a"])
    np.testing.assert_array_equal(out["b"], value["b"])
    assert out["c"] == "text"


@pytest.mark.parametrize("writeable", [True, False])
def test_read_back_is_built_on_the_read_buffer_without_a_copy(make_buffer, writeable):
    """A value read back from disk is built on the buffer the read filled (one per read, nothing
    else holds it): writeable, and no copy, whatever ``writeable`` says."""
    buf = make_buffer(target=0, writeable=writeable)
    buf["a"] = np.arange(100_000, dtype="f8").reshape(250, 400)
    out = buf["a"]
    assert buf.cumulative_metrics["disk-read", "count"] == 1
    assert type(owner(base_of(out))).__name__ == "Frame", "the engine's read buffer itself"
    assert out.flags.writeable
    np.testing.assert_array_equal(out, np.arange(100_000, dtype="f8").reshape(250, 400))
    out[0, 0] = 42.0  # does not touch what is on disk
    del out
    gc.collect()
    assert buf["a"][0, 0] == 0.0


@pytest.mark.parametrize("writeable", [True, False])
def test_frames_held_in_memory_are_copied_only_for_writeable_objects(make_buffer, writeable):
    """Frames the store keeps are handed to the unpickler read-only: with ``writeable`` the array
    is built on a copy (it must not be able to change what the store holds), without, on them."""
    src = make_buffer(target=0)
    src["a"] = np.arange(1000, dtype="i8")
    frames = [bytes(src.get_serialized("a")[0]), bytearray(src.get_serialized("a")[1])]
    buf = make_buffer(writeable=writeable)
    buf.set_serialized("a", frames)
    out = buf["a"]
    assert np.shares_memory(out, np.frombuffer(frames[1], dtype=np.uint8)) != writeable
    assert out.flags.writeable == writeable
    np.testing.assert_array_equal(out, np.arange(1000))


ARRAYS = {
    "c": lambda: np.arange(12, dtype="f4").reshape(3, 4),
    "fortran": lambda: np.asfortranarray(np.arange(12, dtype="i2").reshape(3, 4)),
    "strided": lambda: np.arange(100)[::3],  # not contiguous: pickled in band
    "0d": lambda: np.array(3.5),
    "empty": lambda: np.zeros(0),
    "structured": lambda: np.array([(1, 2.0), (3, 4.0)], dtype=[("a", "i4"), ("b", "f8")]),
    "object": lambda: np.array(["a", None, 1], dtype=object),
    "big-endian": lambda: np.arange(10, dtype=">u4"),
    "datetime": lambda: np.array(["2020-01-01", "2021-06-30"], dtype="M8[ns]"),
    "timedelta-fortran": lambda: np.asfortranarray(np.arange(6, dtype="m8[s]").reshape(2, 3)),
    "unicode": lambda: np.array(["ab", "c"]),
    "fortran-3d": lambda: np.asfortranarray(np.arange(24, dtype="u1").reshape(2, 3, 4)),
}


@pytest.mark.parametrize("kind", list(ARRAYS))
def test_arrays_round_trip(make_buffer, kind):
    arr = ARRAYS[kind]()  # made here: no other reference, so no weak-cache shortcut
    expected = pickle.loads(pickle.dumps(arr, protocol=5))  # what plain pickle gives
    buf = make_buffer(target=0)
    buf["a"] = arr
    if arr.nbytes == 0:  # sizeof 0 is not above a target of 0
        assert buf.evict() == 0
    assert "a" in buf.slow
    del arr
    out = buf["a"]
    assert buf.cumulative_metrics["disk-read", "count"] == 1
    assert out.dtype == expected.dtype and out.shape == expected.shape
    assert out.flags.f_contiguous == expected.flags.f_contiguous
    assert out.flags.c_contiguous == expected.flags.c_contiguous
    if out.dtype == object:
        assert out.tolist() == expected.tolist()
    else:
        np.testing.assert_array_equal(out, expected)


def test_array_frames_are_plain_pickle_with_one_header_per_kind(make_buffer, monkeypatch):
    from spillway import codec as module

    # Start from empty caches: the first array of a kind is pickled, the next ones reuse its header.
    monkeypatch.setattr(module, "_array_headers", {})
    monkeypatch.setattr(module, "_array_specs", {})
    buf = make_buffer(target=0)
    for i in range(3):
        buf[i] = np.full((4, 5), i, dtype="f8")
    headers = [bytes(buf.get_serialized(i)[0]) for i in range(3)]
    assert headers[0] == headers[1] == headers[2]
    assert len(module._array_headers) == 1
    # The reused header is what pickling gives from scratch.
    fresh = pickle.dumps(
        module._PlainArray(np.full((4, 5), 1.0)), protocol=5, buffer_callback=[].append
    )
    assert fresh == headers[0]
    # And the frames are ordinary pickle: plain pickle.loads (no spillway shortcut) reads them.
    frames = buf.get_serialized(2)
    np.testing.assert_array_equal(pickle.loads(frames[0], buffers=frames[1:]), np.full((4, 5), 2.0))
    # Another shape is another kind.
    buf["other"] = np.zeros((5, 4))
    assert len(module._array_headers) == 2


def test_array_header_cache_is_bounded(make_buffer, monkeypatch):
    from spillway import codec as module

    monkeypatch.setattr(module, "_ARRAY_HEADERS_MAX", 4)
    monkeypatch.setattr(module, "_array_headers", {})
    monkeypatch.setattr(module, "_array_specs", {})
    buf = make_buffer(target=0)
    for n in range(1, 11):
        buf[n] = np.arange(n, dtype="i4")
        assert len(module._array_headers) <= 4 and len(module._array_specs) <= 4
    for n in range(1, 11):
        np.testing.assert_array_equal(buf[n], np.arange(n, dtype="i4"))


def reads(buf):
    return buf.cumulative_metrics["disk-read", "count"]


def test_spilled_object_still_alive_is_returned_itself(make_buffer):
    buf = make_buffer(target=1 << 20)
    arr = np.arange(1000)
    buf["a"] = arr
    assert buf.evict() > 0 and "a" in buf.slow
    assert buf["a"] is arr  # from the store's weak reference, not from disk
    assert reads(buf) == 0
    assert "a" in buf.fast  # and brought back into memory as dask does


def test_heavy_object_still_alive_is_returned_itself_and_stays_on_disk(make_buffer):
    buf = make_buffer(target=100)
    arr = np.arange(1000)
    buf["a"] = arr
    assert buf["a"] is arr and buf["a"] is arr
    assert reads(buf) == 0 and "a" in buf.slow


def test_spilled_object_no_longer_alive_is_read_from_disk(make_buffer):
    buf = make_buffer(target=1 << 20)
    arr = np.arange(1000)
    ref = weakref.ref(arr)
    buf["a"] = arr
    assert buf.evict() > 0
    del arr
    gc.collect()
    assert ref() is None  # the buffer holds no strong reference to a spilled object
    out = buf["a"]
    assert reads(buf) == 1
    np.testing.assert_array_equal(out, np.arange(1000))
    assert buf["a"] is out  # back in memory


def test_types_without_weak_references_are_read_back_equal(make_buffer):
    buf = make_buffer(target=10)
    value = (1, "two", 3.0, b"x" * 100)
    buf["t"] = value
    assert "t" in buf.slow
    assert buf["t"] == value


def test_deleted_or_replaced_key_is_not_served_from_the_weak_cache(make_buffer):
    buf = make_buffer(target=100)
    arr = np.arange(1000)
    buf["a"] = arr
    del buf["a"]
    with pytest.raises(KeyError):
        buf["a"]
    buf["a"] = np.zeros(1000)
    assert buf["a"] is not arr and (buf["a"] == 0).all()
