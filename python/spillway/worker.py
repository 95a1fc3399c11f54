"""Plugging a ``SpillBuffer`` into a dask worker.

A dask ``Worker`` (or ``LocalCluster``...) accepts ``data=(factory, kwargs)`` and passes the
worker's own directory to ``factory`` when it takes a ``worker_local_directory`` argument::

    from distributed import LocalCluster
    import spillway

    cluster = LocalCluster(
        n_workers=2,
        memory_limit="2GiB",
        data=(spillway.worker_data, {"memory_limit": "2GiB"}),
    )
"""

from __future__ import annotations

import os
import sys

from spillway.buffer import SpillBuffer


def worker_data(
    worker_local_directory: str,
    *,
    target: int | None = None,
    memory_limit: int | str | None = None,
    max_spill: int | str | bool | None = None,
    **options: object,
) -> SpillBuffer:
    """A ``SpillBuffer`` in ``<worker_local_directory>/spillway`` with dask's default thresholds.

    Parameters
    ----------
    worker_local_directory:
        Passed by the worker.
    target:
        Bytes of managed memory above which to spill. Default: ``memory_limit`` times
        ``distributed.worker.memory.target`` (or ``.spill`` when target is False), as dask computes
        it for its own SpillBuffer; no limit if both are False.
    memory_limit:
        The worker's memory limit (bytes, or a string such as ``"2GiB"``); needed when ``target`` is
        not given (the worker does not tell its data factory).
    max_spill:
        Most bytes on disk. Default: ``distributed.worker.memory.max-spill``.
    options:
        Other keyword arguments of :class:`SpillBuffer` (``compression``, ``backend``, ...).
    """
    import dask.config
    from dask.utils import parse_bytes

    if target is None:
        if memory_limit is None:
            raise TypeError("worker_data() needs target or memory_limit")
        limit = parse_bytes(memory_limit) if isinstance(memory_limit, str) else int(memory_limit)
        fraction = dask.config.get("distributed.worker.memory.target") or dask.config.get(
            "distributed.worker.memory.spill"
        )
        target = int(limit * fraction) if fraction else sys.maxsize
    if max_spill is None:
        max_spill = dask.config.get("distributed.worker.memory.max-spill", False)
    if isinstance(max_spill, str):
        max_spill = parse_bytes(max_spill)
    if max_spill is True:
        raise ValueError("max_spill must be a number of bytes or False")
    return SpillBuffer(
        os.path.join(worker_local_directory, "spillway"), target, max_spill, **options
    )
