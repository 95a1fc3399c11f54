"""Counts, in a worker process, the values it serializes and deserializes, whatever store or path
does it: dask's serializer families (``distributed.protocol.serialize.families``: dask's
``SpillBuffer`` and dask's comms go through them) and spillway's codec (``spillway.codec.dumps`` and
``loads``: spillway's store, and the plugin when it builds an object from frames it kept). A call
made inside another counted call (spillway's codec handing a dataframe to dask's family) counts
once: the count is of values, not of layers.

A dask preload (``distributed.worker.preload``, ``dask worker --preload``): it installs the counters
as it is imported, which a worker does before it builds its store, so the store's codec is the
counted one. ``counts()`` returns ``(serializations, deserializations)`` so far in this process.
"""

from __future__ import annotations

import functools
import importlib
import threading

_local = threading.local()
_lock = threading.Lock()
#: [serializations, deserializations] in this process.
_counts = [0, 0]


def _counted(fn, slot: int):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if getattr(_local, "inside", False):
            return fn(*args, **kwargs)
        _local.inside = True
        try:
            return fn(*args, **kwargs)
        finally:
            _local.inside = False
            with _lock:
                _counts[slot] += 1

    wrapper.__serial_counted__ = True
    return wrapper


def install() -> None:
    """Wrap dask's families and spillway's codec (once per process)."""
    # (The module: the package's ``serialize`` is the function.)
    serialize = importlib.import_module("distributed.protocol.serialize")

    for name, (dumps, loads, *rest) in list(serialize.families.items()):
        if not getattr(dumps, "__serial_counted__", False):
            serialize.families[name] = (_counted(dumps, 0), _counted(loads, 1), *rest)
    try:
        from spillway import codec
    except ImportError:  # a stock-only environment
        return
    if not getattr(codec.dumps, "__serial_counted__", False):
        codec.dumps = _counted(codec.dumps, 0)
        codec.loads = _counted(codec.loads, 1)


def counts() -> tuple:
    """(serializations, deserializations) in this process so far."""
    with _lock:
        return tuple(_counts)


install()
