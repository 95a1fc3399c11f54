"""get_serialized / set_serialized: data that only passes through is never unpickled."""

from __future__ import annotations

import pickle

import pytest

UNPICKLES = []


def _rebuild(payload):
    UNPICKLES.append(payload)
    return Tracked(payload)


class Tracked:
    def __init__(self, payload):
        self.payload = payload

    def __reduce__(self):
        return _rebuild, (self.payload,)

    def __eq__(self, other):
        return isinstance(other, Tracked) and other.payload == self.payload


@pytest.fixture(autouse=True)
def _clear():
    UNPICKLES.clear()


def loads(frames):
    return pickle.loads(frames[0], buffers=frames[1:])


@pytest.mark.parametrize("where", ["object", "disk", "frames"])
def test_get_serialized_does_not_change_the_tier(make_buffer, where):
    buf = make_buffer()
    if where == "frames":
        buf.set_serialized("k", [pickle.dumps(Tracked(b"abc"), protocol=5)])
    else:
        buf["k"] = Tracked(b"abc")
        if where == "disk":
            buf.evict()
    UNPICKLES.clear()
    frames = buf.get_serialized("k")
    assert buf.tier("k") == where
    assert UNPICKLES == []
    assert all(isinstance(memoryview(f), memoryview) for f in frames)
    assert loads(frames) == Tracked(b"abc")
    assert buf.tier("k") == where


def test_get_serialized_of_missing_key(make_buffer):
    with pytest.raises(KeyError):
        make_buffer().get_serialized("nope")


def test_get_serialized_of_unpicklable_object_raises_and_keeps_it(make_buffer):
    class Bad:
        def __reduce__(self):
            raise RuntimeError("no")

    buf = make_buffer()
    bad = Bad()
    buf["b"] = bad
    with pytest.raises(TypeError, match="Failed to pickle 'b'"):
        buf.get_serialized("b")
    assert buf["b"] is bad


def test_set_serialized_holds_frames_until_getitem_unpickles_once(make_buffer):
    src = make_buffer()
    src["k"] = Tracked(b"x" * 100)
    frames = src.get_serialized("k")
    UNPICKLES.clear()

    buf = make_buffer()
    buf.set_serialized("k", frames)
    assert UNPICKLES == []
    assert buf.tier("k") == "frames" and "k" in buf.fast
    assert buf.fast.total_weight == sum(memoryview(f).nbytes for f in frames)
    assert buf.get_serialized("k") == frames  # passing through again: the same frames
    assert UNPICKLES == []

    v = buf["k"]
    assert v == Tracked(b"x" * 100) and len(UNPICKLES) == 1
    assert buf.tier("k") == "object"
    assert buf["k"] is v and len(UNPICKLES) == 1


def test_set_serialized_frames_are_spilled_without_unpickling(make_buffer):
    frames = [pickle.dumps(Tracked(b"y" * 1000), protocol=5)]
    buf = make_buffer(target=1500)
    buf.set_serialized("a", frames)
    buf.set_serialized("b", frames)  # 2 x ~1050 B > 1500: "a" goes to disk as it is
    assert set(buf.slow) == {"a"} and set(buf.fast) == {"b"}
    assert "serialize" not in {label for label, _ in buf.cumulative_metrics}
    assert UNPICKLES == []
    assert bytes(buf.get_serialized("a")[0]) == frames[0]
    assert buf["a"] == Tracked(b"y" * 1000) and len(UNPICKLES) == 1


def test_set_serialized_heavier_than_target_goes_to_disk(make_buffer):
    buf = make_buffer(target=100)
    buf.set_serialized("a", [pickle.dumps(b"z" * 1000, protocol=5)])
    assert buf.tier("a") == "disk"
    assert buf["a"] == b"z" * 1000
    assert buf.tier("a") == "disk"  # heavy: served from disk


def test_serialized_in_memory_false_sends_frames_to_disk(make_buffer):
    buf = make_buffer(serialized_in_memory=False)
    buf["obj"] = 1
    buf.set_serialized("a", [pickle.dumps(Tracked(b"w"), protocol=5)])
    assert buf.tier("a") == "disk" and buf.tier("obj") == "object"
    assert buf["a"] == Tracked(b"w")
    assert buf.tier("a") == "object"  # light: back in memory once unpickled


def test_set_serialized_replaces_a_value(make_buffer):
    buf = make_buffer(target=0)
    buf["k"] = b"old" * 100
    assert buf.tier("k") == "disk"
    buf.set_serialized("k", [pickle.dumps(b"new", protocol=5)])
    assert len(buf.log) == 1  # the old record is gone (the new one is heavy too)
    assert buf["k"] == b"new"


def test_set_serialized_validates_frames(make_buffer):
    buf = make_buffer()
    with pytest.raises(ValueError):
        buf.set_serialized("k", [])
    with pytest.raises(TypeError):
        buf.set_serialized("k", ["not a buffer"])
    assert "k" not in buf


def test_round_trip_between_two_buffers_through_disk(make_buffer):
    np = pytest.importorskip("numpy")
    a = make_buffer(target=0)
    b = make_buffer(target=0)
    arr = np.arange(100_000, dtype="f8").reshape(100, 1000)
    a["x"] = {"array": arr, "meta": ("m", 1)}
    b.set_serialized("x", a.get_serialized("x"))
    out = b["x"]
    np.testing.assert_array_equal(out["array"], arr)
    assert out["meta"] == ("m", 1)


def test_set_serialized_accepts_any_contiguous_buffer(make_buffer):
    np = pytest.importorskip("numpy")
    src = make_buffer(target=0)
    src["a"] = np.arange(64, dtype="f8").reshape(8, 8)
    header, payload = src.get_serialized("a")
    as_floats = np.frombuffer(payload, dtype="f8").reshape(8, 8)  # a 2-D float frame
    fortran = np.asfortranarray(as_floats.T)  # F-contiguous, same bytes
    for frame in (as_floats, memoryview(as_floats), fortran):
        buf = make_buffer(target=0)
        buf.set_serialized("a", [header, frame])
        assert buf.tier("a") == "disk"
        np.testing.assert_array_equal(buf["a"], np.arange(64, dtype="f8").reshape(8, 8))
    with pytest.raises(ValueError, match="contiguous"):
        make_buffer().set_serialized("a", [header, as_floats[:, ::2]])
