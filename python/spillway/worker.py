"""Plugging a ``SpillBuffer`` into a dask worker by hand: ``data=spillway.worker_data``.

A dask ``Worker`` (or ``LocalCluster``...) accepts ``data=factory`` or ``data=(factory, kwargs)``
and passes the worker's own directory to a factory that takes a ``worker_local_directory``
argument::

    from distributed import LocalCluster
    import spillway

    cluster = LocalCluster(n_workers=2, memory_limit="2GiB", data=spillway.worker_data)

(Without code: ``dask worker ... --preload-nanny spillway.dask``, see :mod:`spillway.dask`.)
"""

from __future__ import annotations

import os

from spillway import config
from spillway.buffer import SpillBuffer


def worker_data(
    worker_local_directory: str,
    *,
    target: int | None = None,
    memory_limit: int | str | None = None,
    max_spill: int | str | bool | None = None,
    **options: object,
) -> SpillBuffer:
    """A ``SpillBuffer`` in ``<worker_local_directory>/spillway``, set up as dask sets up its own.

    Parameters
    ----------
    worker_local_directory:
        Passed by the worker.
    target:
        Bytes of managed memory above which to spill. Default: what the worker computes from its
        memory limit and ``distributed.worker.memory.target`` (no target where that is False),
        taken from the worker when the buffer is first used (:func:`spillway.config.thresholds`).
    memory_limit:
        A memory limit to compute ``target`` from now instead (bytes, or a string such as
        ``"2GiB"``; ``"auto"`` or None: the worker's).
    max_spill:
        Most bytes on disk. Default: ``distributed.worker.memory.max-spill``.
    options:
        Other keyword arguments of :class:`SpillBuffer` (``compression``, ``backend``, ...).
    """
    from dask.utils import parse_bytes

    if target is None:
        if memory_limit in (None, "auto"):
            target = "auto"
        else:
            limit = (
                parse_bytes(memory_limit) if isinstance(memory_limit, str) else int(memory_limit)
            )
            target = config.thresholds(limit).target
    if max_spill is None:
        max_spill = config.max_spill()
    if isinstance(max_spill, str):
        max_spill = parse_bytes(max_spill)
    if max_spill is True:
        raise ValueError("max_spill must be a number of bytes or False")
    return SpillBuffer(
        os.path.join(worker_local_directory, "spillway"), target, max_spill, **options
    )
