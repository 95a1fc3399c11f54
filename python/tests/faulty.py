"""Values that go wrong on the way, for the tests of what a worker does then (test_dask_failures.py).

Worker processes import this module by name (a spawned process inherits the parent's ``sys.path``).
"""

from __future__ import annotations

import pickle


class CannotUnpickle(Exception):
    """What unpickling an :class:`Unloadable` raises."""


def _refuse(payload) -> None:
    raise CannotUnpickle(f"this value cannot be unpickled ({len(memoryview(payload))} bytes)")


class Unloadable:
    """A value that pickles (its bytes out of band) and never unpickles: as one whose class the
    receiving process cannot import, or whose data its sender wrote wrong."""

    __slots__ = ("__weakref__", "data")

    def __init__(self, nbytes: int):
        self.data = bytearray(nbytes)

    def __reduce_ex__(self, protocol: int):
        if protocol >= 5:
            return _refuse, (pickle.PickleBuffer(self.data),)
        return _refuse, (bytes(self.data),)

    def __sizeof__(self) -> int:
        return len(self.data) + 64


def use(value) -> int:
    """A task that reads its input."""
    return len(value.data)
