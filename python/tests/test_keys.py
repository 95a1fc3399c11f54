"""encode_key: deterministic bytes for dask keys, injective up to dict equality."""

from __future__ import annotations

import itertools

import pytest

import spillway
from spillway import encode_key

KEYS = [
    1,
    "1",
    b"1",
    1.5,
    -1,
    0,
    "",
    b"",
    None,
    (),
    (1,),
    ("1",),
    (1, "1"),
    ("1", 1),
    ("x", 0, 0),
    ("x", 0, 1),
    ("x", (0, 1)),
    (("x", 0), 1),
    ("x", ("0", 1)),
    "s1:a",
    "t1:",
    "i1;",
    "x-0123456789abcdef",
    ("x-0123456789abcdef", 3, 4),
    "é",
    "\ud800",
    2**70,
    -(2**70),
    float("inf"),
    float("-inf"),
    0.1,
    1 + 2j,
    ((),),
    ((), ()),
    "a" * 10_000,
    "a" * 10_001,
]


def test_distinct_dict_keys_encode_differently():
    encoded = {}
    for key in KEYS:
        b = encode_key(key)
        assert isinstance(b, bytes)
        assert b not in encoded, f"{key!r} and {encoded[b]!r} collide"
        encoded[b] = key


def test_equal_dict_keys_encode_alike():
    assert encode_key(1) == encode_key(1.0) == encode_key(True) == encode_key(1 + 0j)
    assert encode_key(0) == encode_key(-0.0) == encode_key(False)
    assert encode_key(("a", 1)) == encode_key(("a", 1.0))
    np = pytest.importorskip("numpy")
    assert encode_key(np.int64(7)) == encode_key(7)
    assert encode_key(np.float64(0.5)) == encode_key(0.5)
    assert encode_key(("x", np.int32(3))) == encode_key(("x", 3))


def test_encoding_is_deterministic_and_bounded():
    for key in KEYS:
        assert encode_key(key) == encode_key(key)
    assert len(encode_key("a" * 100_000)) <= spillway.keys.MAX_ENCODED_KEY_BYTES + 64
    assert encode_key("a" * 100_000) != encode_key("a" * 100_001)


def test_known_encodings():
    """The format is documented; pin it."""
    assert encode_key("ab") == b"s2:ab"
    assert encode_key(("x", 1)) == b"t2:s1:xi1;"
    assert encode_key(b"\x00") == b"b1:\x00"
    assert encode_key(None) == b"n"
    assert encode_key(0.5) == b"f0x1.0000000000000p-1;"


def test_every_pair_of_keys_can_live_in_one_buffer(make_buffer):
    buf = make_buffer(target=0)
    for i, key in enumerate(KEYS):
        buf[key] = i
    assert len(buf) == len(KEYS) == len(buf.log)
    for i, key in enumerate(KEYS):
        assert buf[key] == i
    assert set(buf) == set(KEYS)


def test_keys_returns_the_original_objects(make_buffer):
    buf = make_buffer(target=0)
    keys = [("x", 1), "y", 3]
    for k in keys:
        buf[k] = k
    got = list(buf.keys())
    assert sorted(map(repr, got)) == sorted(map(repr, keys))
    assert all(type(g) in (tuple, str, int) for g in got)


@pytest.mark.parametrize("a,b", list(itertools.combinations([1, "1", b"1", (1,), 1.5], 2)))
def test_pairs_of_lookalike_keys_do_not_clobber_each_other(make_buffer, a, b):
    buf = make_buffer(target=0)
    buf[a] = "a"
    buf[b] = "b"
    assert buf[a] == "a" and buf[b] == "b"
    del buf[a]
    assert buf[b] == "b" and a not in buf
