"""spillway's settings, read from dask's config: the one place that turns config into settings.

* Where dask has a key, dask's key is the setting: ``distributed.worker.memory.target``, ``.spill``,
  ``.max-spill`` and ``.spill-compression`` decide spillway's target, process thresholds, disk limit
  and compression as they decide dask's store's (:func:`thresholds`, :func:`max_spill`,
  :func:`compression`).
* What dask has no key for is under ``spillway:`` (``spillway.yaml`` holds the defaults, registered
  with ``dask.config.update_defaults`` when this module is imported: YAML files in dask's config
  directories and ``DASK_SPILLWAY__...`` environment variables override them, as for any dask key).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Literal, NamedTuple

import dask.config
import yaml
from dask.utils import parse_bytes, parse_timedelta

__all__ = [
    "CONFIGURED",
    "Thresholds",
    "compression",
    "get",
    "get_bytes",
    "get_seconds",
    "max_spill",
    "thresholds",
]

with open(os.path.join(os.path.dirname(__file__), "spillway.yaml")) as f:
    _DEFAULTS = yaml.safe_load(f)

dask.config.update_defaults(_DEFAULTS)


def get(key: str) -> object:
    """``spillway.<key>`` from dask's config (defaults: ``spillway.yaml``)."""
    return dask.config.get(f"spillway.{key}")


def get_bytes(key: str) -> int:
    value = get(key)
    return parse_bytes(value) if isinstance(value, str) else int(value)


def get_bytes_or_none(key: str) -> int | None:
    """:func:`get_bytes`, or None where the key is null or false (no limit)."""
    value = get(key)
    return None if value is None or value is False else get_bytes(key)


def get_seconds(key: str) -> float:
    return float(parse_timedelta(get(key), default="seconds"))


def _memory(key: str) -> object:
    return dask.config.get(f"distributed.worker.memory.{key}", _DASK_MEMORY_DEFAULTS[key])


#: dask's defaults of the keys read here, for a process where distributed (which registers them) is
#: not imported.
_DASK_MEMORY_DEFAULTS = {
    "target": 0.6,
    "spill": 0.7,
    "max-spill": False,
    "spill-compression": "auto",
}


class Thresholds(NamedTuple):
    """What dask's config makes of a memory limit: the store's ``target`` (managed memory to spill
    at: ``sys.maxsize`` when ``target`` is False, as dask's worker sets it), and the process
    thresholds (spill when the RSS is above ``process_trigger``, down to ``process_target``: the
    limit times dask's ``target``, or its ``spill`` where ``target`` is False; both None when
    ``spill`` is False or there is no limit, where dask's memory monitor does not spill either).

    The trigger is where ``spillway.process-trigger`` says: ``target`` (the default) spills as soon
    as the RSS passes the target, which keeps a worker further from the nanny's 95 % than dask's
    monitor does (measured: docs/benchmarks.md); ``spill`` waits for dask's own ``spill`` threshold,
    as dask's memory monitor does."""

    target: int
    process_target: int | None
    process_trigger: int | None


def thresholds(memory_limit: int | None) -> Thresholds:
    """The thresholds dask's worker uses for ``memory_limit`` (bytes; None or 0: no limit)."""
    target_fraction = _memory("target")
    spill_fraction = _memory("spill")
    if not memory_limit:
        return Thresholds(sys.maxsize, None, None)
    target = int(memory_limit * target_fraction) if target_fraction else sys.maxsize
    if spill_fraction is False:
        return Thresholds(target, None, None)
    goal = int(memory_limit * (target_fraction or spill_fraction))
    at = get("process-trigger")
    if at not in ("target", "spill"):
        raise ValueError(f"spillway.process-trigger={at!r}: 'target' or 'spill'")
    trigger = goal if at == "target" else max(goal, int(memory_limit * spill_fraction))
    return Thresholds(target, goal, trigger)


def max_spill() -> int | Literal[False]:
    """``distributed.worker.memory.max-spill`` in bytes, or False, as dask's worker reads it."""
    value = _memory("max-spill")
    if value is False or value is None:
        return False
    if value is True:
        raise ValueError("distributed.worker.memory.max-spill must be a number of bytes or False")
    return parse_bytes(value) if isinstance(value, str) else int(value)


#: What spillway's log compresses with, by dask's name for it: the compressors dask knows that
#: spillway has not (``zlib``, ``snappy``, ``zstd``) ask for compression, which spillway's log does
#: with lz4.
_COMPRESSIONS = {
    None: "none",
    False: "none",
    "none": "none",
    "lz4": "lz4",
    "zlib": "lz4",
    "snappy": "lz4",
    "zstd": "lz4",
}


#: "What dask's config says" (where None has a meaning of its own).
CONFIGURED = "dask-config"


def compression(name: object = CONFIGURED) -> str:
    """The log's compression (``"none"`` or ``"lz4"``) for dask's ``spill-compression`` setting
    ``name`` (default: the configured one). ``"auto"`` is what dask makes of it: lz4 where the lz4
    package is installed, snappy where only that is (spillway compresses with lz4 then: it has no
    snappy), nothing otherwise. Every other compressor dask knows (``zlib``, ``snappy``, ``zstd``)
    turns compression on, with lz4. A name dask does not know is a ValueError, as in dask."""
    if name == CONFIGURED:
        name = _memory("spill-compression")
    if name == "auto":
        found = any(importlib.util.find_spec(m) is not None for m in ("lz4", "snappy"))
        return "lz4" if found else "none"
    try:
        return _COMPRESSIONS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"distributed.worker.memory.spill-compression={name!r}: not a compression dask knows "
            "(auto, lz4, zlib, snappy, zstd, None or False)"
        ) from None
