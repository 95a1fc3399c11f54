"""A payload that counts, in each process, how often it is pickled and unpickled.

The honest instrument for deserialize on demand: what a worker does with a value shows in the
counts of the value's own ``__reduce_ex__`` and rebuild function, whatever store or path moved it.
Its bytes go out of band (pickle protocol 5), as a numpy array's would; it is not numpy, so no
serializer family of dask's handles it: dask pickles it like any Python object.

Worker processes import this module by name (a spawned process inherits the parent's
``sys.path``), so the counters are the worker's own.
"""

from __future__ import annotations

import pickle
import sys
import threading

_lock = threading.Lock()
#: (pickles, unpickles) in this process.
_counts = [0, 0]


class Counted:
    """``data`` (a bytearray) with counted pickling."""

    __slots__ = ("__weakref__", "data")

    def __init__(self, data: bytearray):
        self.data = data

    def __reduce_ex__(self, protocol: int):
        with _lock:
            _counts[0] += 1
        if protocol >= 5:
            return _rebuild, (pickle.PickleBuffer(self.data),)
        return _rebuild, (bytes(self.data),)

    def __sizeof__(self) -> int:
        return object.__sizeof__(self) + sys.getsizeof(self.data)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Counted) and self.data == other.data

    __hash__ = None


def _rebuild(data) -> Counted:
    with _lock:
        _counts[1] += 1
    return Counted(data if isinstance(data, bytearray) else bytearray(data))


def make(seed: int, nbytes: int) -> Counted:
    """A value of ``nbytes`` bytes that depends only on ``seed``."""
    block = seed.to_bytes(8, "little") * 512  # 4 KiB
    return Counted(bytearray((block * (nbytes // len(block) + 1))[:nbytes]))


def digest(value: Counted) -> int:
    """What a task computes from a value (the same wherever it runs)."""
    import zlib

    return zlib.crc32(value.data)


def counts(dask_worker=None) -> tuple:
    """(pickles, unpickles) so far in this process (``client.run(counts)``)."""
    with _lock:
        return tuple(_counts)
