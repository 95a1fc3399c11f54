"""``SpillBuffer``: dask's spill store, as a mapping over the engine's store.

A ``collections.abc.MutableMapping`` from dask keys to objects with the contract of
``distributed.spill.SpillBuffer``: least-recently-used values are pickled and written to disk when
the total in-memory weight passes ``target``. What a caller of dask's store can observe through its
public API is the same here (``python/tests/test_spill_contract.py`` checks it against dask's store
in the same run); docs/dask.md "The buffer's contract" states it, with the few deliberate
differences and what the store does beyond dask's policy.

The store is the engine's (``spillway._core.Store``, ``engine/src/store/``): its tiers, LRU order,
eviction, accounting, ``max_spill``, read-back copies, process thresholds and the per-key slot that
deserializes a value exactly once whatever the number of threads asking are all in Rust, under
dask's rules (``EvictionPolicy::dask``). This module maps dask keys to the store's byte keys, says
what the store reports in dask's words (:mod:`spillway.messages`), takes its settings from dask's
config (:mod:`spillway.config`) and from the worker it belongs to, and adds what only Python knows:
the values a peer sends or is sent (:mod:`spillway.received`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import tempfile
import threading
import weakref
from collections import defaultdict
from collections.abc import Hashable, ItemsView, Iterator, Mapping, MutableMapping, ValuesView
from time import perf_counter
from typing import Any, Literal, NamedTuple

from spillway import codec, config
from spillway._core import Corrupt, SerializeError, Store, take_thread_metrics
from spillway.keys import encode_key
from spillway.messages import (
    DISK_ERROR_MESSAGE,
    LOGGER,
    MAX_SPILL_MESSAGE,
    PICKLE_ERROR_MESSAGE,
    _install_rate_limits,
    reset_log_rate_limits,
    spill_logger,
)
from spillway.received import _SERVING, PeerValues, PickledFrames, ReceivedRecord

__all__ = [
    "PickleError",
    "PickledFrames",
    "ReceivedRecord",
    "SpillBuffer",
    "SpilledSize",
    "encode_key",
    "reset_log_rate_limits",
]

logger = logging.getLogger(LOGGER)

#: Locks that order the sets and deletes of one key (a key's is chosen by its hash).
_STRIPES = 64

#: Seconds between two looks for the dask worker whose data a buffer is (``process_target="auto"``).
_RESOLVE_EVERY = 0.1

# --------------------------------------------------------------------------------------------------
# Serialization


class PickleError(TypeError):
    """A value could not be pickled. ``str()`` is dask's ``"Failed to pickle 'key'"``; the pickling
    error is chained as ``__cause__``."""

    @property
    def key(self) -> Hashable:
        return self.args[0]

    def __str__(self) -> str:
        return f"Failed to pickle {self.key!r}"


#: What dask's store reports in ``cumulative_metrics`` and to distributed's ``context_meter``: the
#: ``(label, unit)`` pairs a caller of dask's store can see.
DASK_METRICS = frozenset(
    {
        ("memory-read", "count"),
        ("memory-read", "bytes"),
        ("disk-read", "count"),
        ("disk-read", "bytes"),
        ("disk-read", "seconds"),
        ("disk-write", "count"),
        ("disk-write", "bytes"),
        ("disk-write", "seconds"),
        ("serialize", "seconds"),
        ("deserialize", "seconds"),
        ("compress", "seconds"),
        ("decompress", "seconds"),
    }
)

#: The store's tiers, as the buffer names them.
_TIERS = {"materialized": "object", "serialized": "frames", "compressed": "frames", "disk": "disk"}


class SpilledSize(NamedTuple):
    """Size of what is on disk: ``memory`` is the in-memory weight (sizeof) of the keys on disk,
    ``disk`` the pickled bytes on disk (the copies of keys read back included)."""

    memory: int
    disk: int

    def __add__(self, other: SpilledSize) -> SpilledSize:  # type: ignore[override]
        return SpilledSize(self.memory + other.memory, self.disk + other.disk)

    def __sub__(self, other: SpilledSize) -> SpilledSize:
        return SpilledSize(self.memory - other.memory, self.disk - other.disk)


def _damaged(key: Hashable, error: Corrupt) -> Corrupt:
    """The error for a spilled record of ``key`` that fails its checks."""
    return Corrupt(
        f"the spilled data of {key!r} is damaged ({error}). An object changed in place while it was "
        "being spilled reads so too: its bytes no longer match the checksum of what was written"
    )


def _close_store(store: Store, directory: str) -> None:
    try:
        store.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


class _LogView:
    """What the tests see of one of the store's segment logs (number ``index`` of ``Store.logs``)."""

    __slots__ = ("index", "store")

    def __init__(self, store: Store, index: int):
        self.store = store
        self.index = index

    def __len__(self) -> int:
        """Records in the log: values on disk and the copies that values read back keep."""
        return self.store.logs[self.index][2]

    @property
    def disk_bytes(self) -> int:
        """Pickled bytes of the records of every log of the store."""
        return self.store.log_records[1]

    @property
    def read_only(self) -> str | None:
        return self.store.logs[self.index][1]

    @property
    def backend(self) -> str:
        return self.store.backend

    def _inject_fault(self, op: str, after: int, kind: str, sticky: bool = False) -> None:
        """Script a fault of this log's simulated disk (backend="sim")."""
        self.store._inject_fault(op, after, kind, sticky, log=self.index)

    def _clear_faults(self) -> None:
        self.store._clear_faults(log=self.index)

    def sync(self) -> None:
        """Write back what the log spills go to holds, and fdatasync it."""
        self.store.sync()


# --------------------------------------------------------------------------------------------------
# SpillBuffer


class SpillBuffer(PeerValues, MutableMapping):
    """A mapping from dask keys to objects that spills least-recently-used values to disk.

    Parameters
    ----------
    spill_directory:
        Directory in which a fresh ``spillway-*`` store directory is created (and removed on close).
    target:
        In-memory weight, in bytes, above which least-recently-used values are spilled (settable).
        ``"auto"``: what dask's worker computes from its memory limit and
        ``distributed.worker.memory.target``, taken from the dask worker whose ``data`` this buffer
        is when it is first used (nothing spills before that).
    max_spill:
        Most pickled bytes on disk; ``False`` (or ``None``) for no limit.
    compression:
        The log's compression, by dask's names: ``None``/``False``/``"none"``, ``"lz4"`` or
        ``"auto"`` (:func:`spillway.config.compression`). Default: dask's
        ``distributed.worker.memory.spill-compression``.
    backend:
        The log's I/O backend: ``"auto"``, ``"uring"``, ``"portable"`` or ``"sim"`` (the simulated
        disk, in memory, whose faults tests script with ``buf.log._inject_fault``). Default:
        ``spillway.backend`` in dask's config.
    segment_bytes:
        Size of the log's segment files. Default: ``spillway.segment-bytes``.
    serialized_in_memory:
        Whether frames given to :meth:`set_serialized` stay in memory (tier ``"frames"``, weighed by
        their byte length and spilled in LRU order like objects). If False they go straight to disk.
    writeable:
        Whether objects built on frames the store keeps get writeable buffers (copies of read-only
        ones). Objects read back from disk are writeable either way, without a copy.
    process_target:
        Bytes of process memory (RSS) above which a set or a read back also spills
        least-recently-used keys, until their weight covers the excess. ``"auto"`` (the default):
        inside a dask worker whose ``data`` this buffer is, what its memory monitor does: above the
        memory limit times ``distributed.worker.memory.spill``, down to the limit times ``.target``
        (off where ``spill`` is False or there is no limit); elsewhere, off. ``None``: off.
    """

    #: keys whose pickling error was logged (dask's attribute of the same name)
    logged_pickle_errors: set

    def __init__(
        self,
        spill_directory: str | os.PathLike,
        target: int | Literal["auto"],
        max_spill: int | Literal[False] | None = False,
        *,
        compression: str | None | Literal[False] = config.CONFIGURED,
        backend: str | None = None,
        segment_bytes: int | None = None,
        serialized_in_memory: bool = True,
        writeable: bool = True,
        process_target: int | Literal["auto"] | None = "auto",
    ):
        self.max_spill = False if max_spill is None else max_spill
        self.serialized_in_memory = serialized_in_memory
        self.writeable = writeable
        self.logged_pickle_errors = set()
        _install_rate_limits()

        os.makedirs(spill_directory, exist_ok=True)
        self._parent = os.path.abspath(os.fspath(spill_directory))
        options = {
            "policy": "dask",
            "compression": config.compression(compression),
            "backend": backend or config.get("backend"),
            "segment_bytes": segment_bytes or config.get_bytes("segment-bytes"),
            "writeable": writeable,
            "report_failures": True,
        }
        #: "auto" settings still to take from the dask worker whose data this buffer is
        self._auto = {name for name, v in (("target", target), ("process", process_target)) if v == "auto"}
        self._next_resolve = 0.0  # when to look for that worker again
        self._worker = None  # a weak reference to it, once found
        self.directory = tempfile.mkdtemp(prefix="spillway-", dir=self._parent)
        try:
            store = Store(
                self.directory,
                sys.maxsize if target == "auto" else target,
                None if self.max_spill is False else self.max_spill,
                **options,
            )
        except BaseException:
            shutil.rmtree(self.directory, ignore_errors=True)
            raise
        if process_target != "auto":
            store.process_target = process_target
        self._store = store
        self._finalizer = weakref.finalize(self, _close_store, store, self.directory)

        self._lock = threading.RLock()  # the key maps, the store list
        self._stripes = [threading.RLock() for _ in range(_STRIPES)]
        self._keys: dict[Hashable, bytes] = {}  # key -> its store key
        self._owners: dict[bytes, Hashable] = {}  # store key -> key
        self._pending: dict[bytes, Hashable] = {}  # store keys of received records not yet set
        self._incoming = 0  # frames received into memory (``receive``) and not yet let go of
        self._extra_metrics: defaultdict = defaultdict(float)  # the side channel's, spillway.dask
        self._log_views: dict = {}  # log number -> its view (``log``)
        self._fast = _TierView(self, in_memory=True)
        self._slow = _TierView(self, in_memory=False)
        self._logs_seen = 1
        # Inside a dask worker, also report metrics to distributed's context meter (as dask's
        # SpillBuffer does), so that they appear in the worker's fine performance metrics.
        metrics_module = sys.modules.get("distributed.metrics")
        self._context_meter = getattr(metrics_module, "context_meter", None)

    # ---------------------------------------------------------------------------------------------
    # Properties

    @property
    def target(self) -> int:
        """In-memory weight above which values are spilled; setting it applies from the next set or
        read back."""
        return self._store.target

    @target.setter
    def target(self, value: int) -> None:
        self._store.target = value

    @property
    def log(self) -> _LogView:
        """The segment log new values are spilled to (a fresh one after a failed write: see the
        policy)."""
        with contextlib.suppress(ValueError):  # (closed: the last one seen)
            self._logs_seen = len(self._store.logs)
        index = self._logs_seen - 1
        view = self._log_views.get(index)
        if view is None:
            view = self._log_views[index] = _LogView(self._store, index)
        return view

    @property
    def fast(self) -> _TierView:
        """Keys in memory (objects and held frames), in the order they entered memory. For
        inspection: reading through this view neither changes tiers nor the LRU order."""
        return self._fast

    @property
    def slow(self) -> _TierView:
        """Keys on disk, in the order they were spilled. For inspection: reading through this view
        neither changes tiers nor the LRU order."""
        return self._slow

    memory = fast
    disk = slow

    @property
    def spilled_total(self) -> SpilledSize:
        """(in-memory weight of the keys on disk, pickled bytes on disk): dask subtracts the first
        from the managed memory it counts in memory, and shows the second as spilled. The bytes
        count the copies that keys read back keep (they are on disk too)."""
        if self._worker is None:
            self._find_worker()  # (read by the worker's heartbeat from its start)
        with contextlib.suppress(ValueError):  # (closed)
            return SpilledSize(*self._store.spilled)
        return SpilledSize(0, 0)

    @property
    def cumulative_metrics(self) -> defaultdict:
        """(label, unit) -> ever-increasing total: what dask's store reports, under its labels and
        nothing else (see the module docstring); spillway's own in :attr:`spillway_metrics`."""
        m: defaultdict = defaultdict(float)
        with contextlib.suppress(ValueError):  # (closed)
            for (label, unit), value in self._store.metrics().items():
                if value and (label, unit) in DASK_METRICS:
                    m[label, unit] += value
        return m

    @property
    def spillway_metrics(self) -> defaultdict:
        """(label, unit) -> ever-increasing total of everything spillway counts: dask's metrics
        with every unit (``("serialize", "count")``, ...), the writes spared by copies
        (``disk-write-saved``) and :mod:`spillway.dask`'s transfers."""
        m: defaultdict = defaultdict(float)
        with contextlib.suppress(ValueError):  # (closed)
            for (label, unit), value in self._store.metrics().items():
                if value:
                    m[label, unit] += value
        for k, v in self._extra_metrics.items():
            m[k] += v
        return m

    def tier(self, key: Hashable) -> str:
        """``"object"``, ``"frames"`` or ``"disk"``; KeyError if absent."""
        tier = self.tier_if_present(key)
        if tier is None:
            raise KeyError(key)
        return tier

    def tier_if_present(self, key: Hashable) -> str | None:
        """``"object"``, ``"frames"`` or ``"disk"``; None if absent."""
        skey = self._keys.get(key)
        tier = None if skey is None else self._store.tier(skey)
        return None if tier is None else _TIERS[tier]

    # ---------------------------------------------------------------------------------------------
    # Mapping

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[Hashable]:
        """The keys in memory, then those on disk (as dask's store iterates)."""
        mem, disk = self._keys_by_place()
        return iter(mem + disk)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __repr__(self) -> str:
        on_disk = len(self.slow)
        return (
            f"<SpillBuffer: {len(self) - on_disk} in memory "
            f"({self.fast.total_weight}/{self.target} B), "
            f"{on_disk} on disk ({self.spilled_total.disk} B), {self.directory}>"
        )

    def __setitem__(self, key: Hashable, value: object) -> None:
        """Store ``value`` in memory, then spill least-recently-used keys while above ``target``.
        A value heavier than ``target`` is written to disk at once.

        Raises PickleError (a TypeError) if the value being set is heavier than ``target`` (so it is
        spilled at once) and cannot be pickled; the key is then forgotten. Every other failure
        (a lighter value or another key failed to pickle, disk error, ``max_spill``) is logged and
        the key that caused it stays in memory.
        """
        if type(value) is PickledFrames:
            self.set_serialized(key, value.frames)
            return
        if type(value) is ReceivedRecord:
            self._adopt(key, value)
            return
        if "target" in self._auto:
            self._find_worker(force=True)
        with self._stripe(key):
            skey = self._place(key)
            try:
                self._store.put(skey, value)
            except SerializeError as error:
                self._forget(key, skey)  # (the store forgot it: dask's rule)
                raise PickleError(key) from error.__cause__
        self._settle()

    def __getitem__(self, key: Hashable) -> object:
        """The object of ``key``. An object in memory moves to the tail of the LRU. A key held as
        frames or on disk is unpickled (once, whatever the number of concurrent readers) and, unless
        heavier than ``target``, kept in memory as an object. Inside :meth:`serving`, the values it
        was given come first."""
        serving = _SERVING.get()
        if serving is not None and serving[0] is self and key in serving[1]:
            return serving[1][key]
        for _ in range(3):
            try:
                value = self._store.get(self._keys[key])
            except KeyError:
                continue  # deleted (then KeyError above), or deleted and set again meanwhile
            except Corrupt as error:
                raise _damaged(key, error) from error
            self._settle()
            return value
        raise KeyError(key)

    def __delitem__(self, key: Hashable) -> None:
        with self._stripe(key):
            with self._lock:
                skey = self._keys.pop(key)  # KeyError if absent
                del self._owners[skey]
                self.logged_pickle_errors.discard(key)
            with contextlib.suppress(ValueError):  # closed: its records went with it
                self._store.remove(skey)

    def pop(self, key: Hashable, default: object = None) -> object:
        raise NotImplementedError(
            "Are you calling .pop(key, None) as a way to discard a key if it exists?"
            "It may cause data to be read back from disk! Please use `del` instead."
        )

    def clear(self) -> None:
        """Forget every key without reading anything back."""
        for key in list(self._keys):
            with contextlib.suppress(KeyError):
                del self[key]

    def items(self) -> ItemsView:
        """Items; reading them neither changes tiers nor the LRU order."""
        return _PeekItemsView(self)

    def values(self) -> ValuesView:
        """Values; reading them neither changes tiers nor the LRU order."""
        return _PeekValuesView(self)

    # ---------------------------------------------------------------------------------------------
    # Spilling

    def evict(self) -> int:
        """Spill the least-recently-used key in memory, even if below ``target``. Returns its
        in-memory weight, or -1 if it could not be spilled (pickling error, disk error or
        ``max_spill``; the cause is logged). With nothing in memory, raises KeyError, as dask's
        store does (its callers check ``fast`` first)."""
        try:
            empty = not self._fast
        except ValueError:  # closed
            return -1
        if empty:
            raise KeyError("evict(): dictionary is empty")
        try:
            weight = self._store.evict()
        except Exception:
            logger.exception("Unexpected error while spilling")
            return -1
        self._settle()
        return weight

    # ---------------------------------------------------------------------------------------------
    # Serialized data

    def get_serialized(self, key: Hashable, *, as_read: bool = False) -> list:
        """The pickled frames of ``key`` (``[header, *buffers]``, for ``pickle.loads(frames[0],
        buffers=frames[1:])`` or :meth:`set_serialized` elsewhere), without changing its tier.
        An object is pickled (raising PickleError if it cannot be); frames held in memory are
        returned as views of their buffers; a key on disk is read into read-only views. A key in
        memory moves to the tail of the LRU. ``as_read``: the key moves as ``buf[key]`` would move
        it, a key on disk coming back into memory (as the frames read, not unpickled) unless it is
        heavier than ``target``, others being spilled for it."""
        for _ in range(3):
            try:
                frames = self._store.get_serialized(self._keys[key], as_read)
            except KeyError:
                continue
            except SerializeError as error:
                raise PickleError(key) from error.__cause__
            except Corrupt as error:
                raise _damaged(key, error) from error
            self._settle()
            return frames
        raise KeyError(key)

    def set_serialized(self, key: Hashable, frames: list) -> None:
        """Store pickled frames (as returned by :meth:`get_serialized`) without unpickling them.
        They are held in memory, weighed by their byte length, until spilled or unpickled by
        :meth:`__getitem__`; with ``serialized_in_memory=False``, or if heavier than ``target``,
        they are written to disk at once. The buffers are kept, not copied."""
        frames = [codec.byte_frame(f) for f in frames]
        if not frames:
            raise ValueError("frames must hold at least the pickle header")
        if "target" in self._auto:
            self._find_worker(force=True)
        with self._stripe(key):
            skey = self._place(key)
            self._store.put_serialized(skey, frames, not self.serialized_in_memory)
        self._settle()

    # ---------------------------------------------------------------------------------------------
    # Lifecycle

    def close(self) -> None:
        """Close the stores and remove their directories. Idempotent."""
        self._finalizer()

    def __enter__(self) -> SpillBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------------------------------------
    # Internals

    def _stripe(self, key: Hashable) -> threading.RLock:
        return self._stripes[hash(key) % _STRIPES]

    def _free_store_key(self, key: Hashable) -> bytes:
        """Under the lock: a store key for ``key`` that no other key and no received record has."""
        base = encode_key(key)
        skey, n = base, 0
        while skey in self._owners or skey in self._pending:
            n += 1
            skey = base + b"#%d" % n
        return skey

    def _place(self, key: Hashable) -> bytes:
        """Under the key's stripe: the store key a new value of ``key`` goes to."""
        with self._lock:
            skey = self._keys.get(key)
            if skey is None:
                skey = self._free_store_key(key)
                self._keys[key] = skey
                self._owners[skey] = key
        return skey

    def _forget(self, key: Hashable, skey: bytes) -> None:
        with self._lock:
            if self._keys.get(key) == skey:
                del self._keys[key]
                del self._owners[skey]

    def _settle(self) -> None:
        """After a call that may have evicted: say what the store could not spill, report metrics to
        distributed's context meter."""
        failures = self._store.take_failures()
        if failures:
            self._report(failures)
        if self._worker is None:
            self._find_worker()
        meter = self._context_meter
        if meter is not None:
            # This thread's work since the last report: this call's (the engine works on the
            # caller's thread), reported under the caller's activity.
            for label, unit, value in take_thread_metrics():
                if (label, unit) in DASK_METRICS:
                    meter.digest_metric(label, value, unit)

    def _report(self, failures: list) -> None:
        """Log the store's failed spills in dask's words."""
        for skey, kind, error in failures:
            if kind == "max_spill":
                spill_logger.warning(MAX_SPILL_MESSAGE)
            elif kind == "disk":
                spill_logger.error(DISK_ERROR_MESSAGE, exc_info=error)
            else:
                with self._lock:
                    key = self._owners.get(skey, skey)
                    first = key not in self.logged_pickle_errors
                    self.logged_pickle_errors.add(key)
                if first:
                    spill_logger.error(PICKLE_ERROR_MESSAGE, key, exc_info=error)

    def _find_worker(self, force: bool = False) -> bool:
        """Find the dask worker whose data this buffer is (looked for at most every
        ``_RESOLVE_EVERY`` seconds, or now with ``force``, until found): take the ``"auto"``
        settings from it (``target``, the process thresholds: :func:`spillway.config.thresholds` of
        its memory limit), and close with it if empty (:func:`_close_with`: dask's worker never
        closes its data, and its own store holds no open files). Returns whether it is found."""
        if self._worker is not None:
            return True
        now = perf_counter()
        if not force and now < self._next_resolve:
            return False
        self._next_resolve = now + _RESOLVE_EVERY
        worker_module = sys.modules.get("distributed.worker")
        for worker in list(getattr(getattr(worker_module, "Worker", None), "_instances", ())):
            manager = getattr(worker, "memory_manager", None)
            if getattr(manager, "data", None) is not self:
                continue
            try:
                t = config.thresholds(manager.memory_limit)
            except Exception:  # (a bad setting: logged, and the buffer keeps what it has)
                logger.exception("spillway: cannot take the settings of %s", worker)
            else:
                if "target" in self._auto:
                    self._store.target = t.target
                if "process" in self._auto:
                    self._store.process_target = t.process_target
                    self._store.process_trigger = t.process_trigger
            self._auto = set()
            self._worker = weakref.ref(worker)
            loop = getattr(worker, "loop", None)
            if loop is not None and hasattr(worker, "finished"):
                loop.add_callback(_close_with, weakref.ref(self), worker)
            return True
        return False

    def _digest_locked(self, label: str, value: float, unit: str) -> None:
        """Add to ``spillway_metrics`` the counts only Python sees (:mod:`spillway.dask`'s
        transfers). They are spillway's own: dask's metrics get the engine's work they stand for
        (:meth:`_settle`), under dask's labels."""
        with self._lock:
            self._extra_metrics[label, unit] += value

    def _digest_io(self, label: str, nbytes: int, seconds: float) -> None:
        self._digest_locked(label, 1, "count")
        self._digest_locked(label, nbytes, "bytes")
        self._digest_locked(label, seconds, "seconds")

    def _peek(self, key: Hashable) -> object:
        """The object of ``key`` without changing its tier or the LRU order."""
        for _ in range(3):
            skey = self._keys[key]
            try:
                return self._store.peek(skey)
            except KeyError:
                continue
            except Corrupt as error:
                raise _damaged(key, error) from error
        raise KeyError(key)

    def _keys_by_place(self) -> tuple[list, list]:
        """(keys in memory, keys on disk), each in the order they entered that place."""
        with contextlib.suppress(ValueError):  # (closed: empty)
            mem, disk = self._store.keys_by_place()
            owners = self._owners
            return (
                [k for k in (owners.get(s, _NO_KEY) for s in mem) if k is not _NO_KEY],
                [k for k in (owners.get(s, _NO_KEY) for s in disk) if k is not _NO_KEY],
            )
        return [], []

    def _keys_in(self, in_memory: bool) -> list:
        return self._keys_by_place()[0 if in_memory else 1]


_NO_KEY = object()  # "no key" where None would be a valid key


async def _close_with(buffer_ref: weakref.ref, worker: object) -> None:
    """Close the buffer once ``worker`` has finished closing (``Server.finished``), if it holds
    nothing: a closed worker's data stays readable as dask's does (dask's tests check a closed
    worker's state against it), and an empty one gives back its files and threads at once."""
    await worker.finished()
    buffer = buffer_ref()
    if buffer is not None and len(buffer) == 0:
        buffer.close()


class _TierView(Mapping):
    """Read-only view of the keys of a SpillBuffer in memory (``in_memory=True``) or on disk."""

    def __init__(self, buffer: SpillBuffer, in_memory: bool):
        # A proxy: the buffer holds its views, and a cycle would keep a buffer nobody holds (and
        # its open files) alive until the garbage collector runs.
        self._buffer = weakref.proxy(buffer)
        self._in_memory = in_memory

    def __contains__(self, key: object) -> bool:
        b = self._buffer
        skey = b._keys.get(key)
        if skey is None:
            return False
        tier = b._store.tier(skey)
        return tier is not None and (tier != "disk") == self._in_memory

    def __getitem__(self, key: Hashable) -> object:
        if key not in self:
            raise KeyError(key)
        return self._buffer._peek(key)

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._buffer._keys_in(self._in_memory))

    def __len__(self) -> int:
        b = self._buffer
        if not b._pending:
            in_memory, on_disk = b._store.counts()
            return in_memory if self._in_memory else on_disk
        return len(b._keys_in(self._in_memory))

    @property
    def total_weight(self) -> int:
        """Sum of the weights of the keys in this view (sizeof for objects, bytes for frames)."""
        b = self._buffer
        if self._in_memory:
            return b._store.memory_bytes
        return b.spilled_total.memory

    def __repr__(self) -> str:
        return f"<{'fast' if self._in_memory else 'slow'} view of {len(self)} keys>"


class _PeekItemsView(ItemsView):
    def __iter__(self) -> Iterator[tuple[Hashable, Any]]:
        for key in self._mapping:
            try:
                yield key, self._mapping._peek(key)
            except KeyError:  # deleted meanwhile
                pass


class _PeekValuesView(ValuesView):
    def __iter__(self) -> Iterator[Any]:
        for _, value in _PeekItemsView(self._mapping):
            yield value
