"""A value that records, in its process, the thread each of its pickles and unpickles ran on.
Worker processes import this module by name (they inherit the tests' ``sys.path``)."""

from __future__ import annotations

import threading

#: (event, key, thread name, whether the thread is the process's main thread): "pickle" or
#: "unpickle", in the order they happened in this process.
EVENTS: list = []


def _note(event: str, key: str) -> None:
    t = threading.current_thread()
    EVENTS.append((event, key, t.name, t is threading.main_thread()))


class Tracked:
    """``nbytes`` of payload under ``key``; ``sizeof`` is the payload's length."""

    def __init__(self, key: str, nbytes: int):
        self.key = key
        self.payload = bytearray(nbytes)

    def __reduce__(self):
        _note("pickle", self.key)
        return _rebuild, (self.key, bytes(self.payload))

    def __sizeof__(self):
        return len(self.payload)


def _rebuild(key: str, payload: bytes) -> Tracked:
    _note("unpickle", key)
    t = Tracked.__new__(Tracked)
    t.key, t.payload = key, bytearray(payload)
    return t


def make(key: str, nbytes: int) -> Tracked:
    return Tracked(key, nbytes)


def total(*values: Tracked) -> int:
    return sum(len(v.payload) for v in values)


def events(dask_worker=None) -> list:
    return list(EVENTS)
