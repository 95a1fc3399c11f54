"""``SpillBuffer``: dask's spill store (the contract of ``distributed.spill.SpillBuffer``), an
adapter over the engine's store (``spillway._core.Store``, whose tiers, eviction, accounting and
deserialize-once slots are in Rust under dask's rules). It says what the store reports in dask's
words and takes its settings from dask's config and its worker. docs/dask.md "The buffer's contract"
states the contract; docs/architecture.md maps which file owns each rule.
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
from spillway.keys import KeyMap, encode_key
from spillway.messages import (
    DASK_METRICS,
    DISK_ERROR_MESSAGE,
    LOGGER,
    MAX_SPILL_MESSAGE,
    PICKLE_ERROR_MESSAGE,
    _install_rate_limits,
    reset_log_rate_limits,
    spill_logger,
)
from spillway.received import NOT_SERVED, PeerValues, PickledFrames, ReceivedRecord
from spillway.views import LogView, PeekItemsView, PeekValuesView, TierView

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


#: How far over the target (a share of it) memory may go before a set whose spilling is deferred
#: (``SpillBuffer.defer_spills``) spills on its own thread after all.
DEFER_SLACK = 0.25


class _Spiller:
    """The thread that spills a buffer down to its target after sets that left it the spilling
    (``SpillBuffer.defer_spills``). It holds the buffer weakly and ends with it."""

    def __init__(self, buf: SpillBuffer, setter: int, digest, pressed):
        self.setter = setter  # the thread id whose sets defer
        self._digest = digest
        self._pressed = pressed
        self._buf = weakref.ref(buf)
        self._wake = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="spillway-spiller", daemon=True)
        self._thread.start()

    def spill(self, store: Store, pending: int) -> None:
        """After a deferred set left ``pending`` bytes in memory that no write is taking away, over
        the target (or due a check of the process's memory): wake the thread; spill here too if
        that is over the target by more than ``DEFER_SLACK`` of it."""
        self._wake.set()
        if pending > store.target * (1 + DEFER_SLACK):
            store.enforce_target()

    def pressed(self) -> bool:
        """Whether the process is short of memory (the setter spills for itself meanwhile)."""
        if self._pressed is None:
            return False
        try:
            return bool(self._pressed())
        except Exception:  # (whatever the check fails on, the setter spills: the safe side)
            return True

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()

    def _run(self) -> None:
        while not self._stopped:
            if not self._wake.wait(1.0):
                if self._buf() is None:
                    return
                continue
            self._wake.clear()
            buf = self._buf()
            if buf is None or self._stopped:
                return
            try:
                buf._store.enforce_target()
                buf._settle(self._digest)
            except ValueError:  # closed
                return
            except Exception:
                logger.exception("Unexpected error while spilling")
            del buf


def _close_store(store: Store, directory: str) -> None:
    try:
        store.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


# --------------------------------------------------------------------------------------------------
# SpillBuffer


class SpillBuffer(MutableMapping):
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

        self._spiller: _Spiller | None = None  # see defer_spills
        self._keys = KeyMap()
        #: The values peers send this buffer or are sent from it (:mod:`spillway.received`).
        self.peers = PeerValues(store, self._keys)
        self._log_views: dict = {}  # log number -> its view (``log``)
        self._fast = TierView(self, in_memory=True)
        self._slow = TierView(self, in_memory=False)
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
    def log(self) -> LogView:
        """The segment log new values are spilled to (a fresh one after a failed write: see the
        policy)."""
        with contextlib.suppress(ValueError):  # (closed: the last one seen)
            self._logs_seen = len(self._store.logs)
        index = self._logs_seen - 1
        view = self._log_views.get(index)
        if view is None:
            view = self._log_views[index] = LogView(self._store, index)
        return view

    @property
    def fast(self) -> TierView:
        """Keys in memory (objects and held frames), in the order they entered memory. For
        inspection: reading through this view neither changes tiers nor the LRU order."""
        return self._fast

    @property
    def slow(self) -> TierView:
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
        for k, v in self.peers.metrics().items():
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
        mem, disk = self.keys_by_place()
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
            value.settled()
            return
        if type(value) is ReceivedRecord:
            with self._keys.stripe(key):
                if self.peers.adopt(key, value):
                    return
            self.set_serialized(key, value.read())  # another buffer's, or set before
            return
        if "target" in self._auto:
            self._find_worker(force=True)
        spiller = self._spiller_here()
        pending = None
        with self._keys.stripe(key):
            skey = self._keys.place(key)
            try:
                if spiller is None:
                    self._store.put(skey, value)
                else:
                    pending = self._store.put_deferred(skey, value)
            except SerializeError as error:
                self._keys.forget(key, skey)  # (the store forgot it: dask's rule)
                raise PickleError(key) from error.__cause__
            except BaseException:
                self._forget_if_gone(key, skey)
                raise
        if pending is not None:
            spiller.spill(self._store, pending)
        self._settle()

    def __getitem__(self, key: Hashable) -> object:
        """The object of ``key``. An object in memory moves to the tail of the LRU. A key held as
        frames or on disk is unpickled (once, whatever the number of concurrent readers) and, unless
        heavier than ``target``, kept in memory as an object. Inside :meth:`serving`, the values it
        was given come first."""
        served = self.peers.served(key)
        if served is not NOT_SERVED:
            return served
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
        with self._keys.stripe(key), self._keys.removing(key) as skey:  # KeyError if absent
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
        return PeekItemsView(self)

    def values(self) -> ValuesView:
        """Values; reading them neither changes tiers nor the LRU order."""
        return PeekValuesView(self)

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

    def defer_spills(self, thread_id: int | None, digest=None, pressed=None) -> None:
        """Sets made on the thread ``thread_id`` (``threading.get_ident()``; a dask worker's event
        loop: :mod:`spillway.dask`) return without spilling for themselves: a thread of this
        buffer's own spills down to ``target`` after them, so that the setter does not wait for
        the writes. The setter still spills, as any set does, when memory is over the target by
        more than ``DEFER_SLACK`` of it (the spilling thread falls behind), and while
        ``pressed()`` says the process is short of memory (the setter then waits for the writes,
        which holds back what it would do next). ``digest(label, value, unit)`` receives the
        metrics of the spilling thread's work. None: every set spills on its own thread again."""
        old, self._spiller = self._spiller, None
        if old is not None:
            old.stop()
        if thread_id is not None:
            self._spiller = _Spiller(self, thread_id, digest, pressed)

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
        spiller = self._spiller_here() if self.serialized_in_memory else None
        pending = None
        with self._keys.stripe(key):
            skey = self._keys.place(key)
            try:
                if spiller is None:
                    self._store.put_serialized(skey, frames, not self.serialized_in_memory)
                else:
                    pending = self._store.put_serialized_deferred(skey, frames)
            except BaseException:
                self._forget_if_gone(key, skey)
                raise
        if pending is not None:
            spiller.spill(self._store, pending)
        self._settle()

    # ---------------------------------------------------------------------------------------------
    # Peers (:mod:`spillway.received`)

    def receive(self, key: Hashable, *args: Any, **kwargs: Any) -> PickledFrames | ReceivedRecord:
        """:meth:`PeerValues.receive` (its arguments), under this buffer's settings."""
        self._find_worker()
        value = self.peers.receive(key, *args, **kwargs)
        self._settle()  # a write to disk, to dask's metrics (the activity that asked)
        return value

    def disk_record(self, key: Hashable) -> tuple | None:
        """:meth:`PeerValues.disk_record`."""
        return self.peers.disk_record(key)

    def serving(self, values: Mapping) -> contextlib.AbstractContextManager:
        """:meth:`PeerValues.serving`: ``buf[key]`` returns ``values[key]`` while in effect."""
        return self.peers.serving(values)

    # ---------------------------------------------------------------------------------------------
    # Lifecycle

    def close(self) -> None:
        """Close the stores and remove their directories. Idempotent."""
        if self._spiller is not None:
            self._spiller.stop()
        self._finalizer()

    def __enter__(self) -> SpillBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------------------------------------
    # Internals

    def _spiller_here(self) -> _Spiller | None:
        """The spilling thread a set on this thread leaves its spilling to now (``defer_spills``)."""
        spiller = self._spiller
        if spiller is None or spiller.setter != threading.get_ident() or spiller.pressed():
            return None
        return spiller

    def _settle(self, digest=None) -> None:
        """After a call that may have evicted: say what the store could not spill, report metrics to
        distributed's context meter (or to ``digest(label, value, unit)``)."""
        failures = self._store.take_failures()
        if failures:
            self._report(failures)
        if self._worker is None:
            self._find_worker()
        if digest is not None:
            for label, unit, value in take_thread_metrics():
                if (label, unit) in DASK_METRICS:
                    digest(label, value, unit)
            return
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
                with self._keys.lock:
                    key = self._keys.owner(skey, skey)
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
            if getattr(getattr(worker, "memory_manager", None), "data", None) is self:
                self._attach(worker)
                return True
        return False

    def _attach(self, worker: object) -> None:
        """This buffer is ``worker``'s data: take the ``"auto"`` settings from it (``target``, the
        process thresholds: :func:`spillway.config.thresholds` of its memory limit), and close with
        it if empty (:func:`_close_with`)."""
        try:
            t = config.thresholds(worker.memory_manager.memory_limit)
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

    def _forget_if_gone(self, key: Hashable, skey: bytes) -> None:
        """After a failed put under ``skey``: if the store holds nothing there, ``key`` has no value
        (it would be listed without one)."""
        try:
            gone = self._store.tier(skey) is None
        except Exception:  # (closed)
            gone = True
        if gone:
            self._keys.forget(key, skey)

    def peek(self, key: Hashable) -> object:
        """The object of ``key`` without changing its tier or the LRU order (a key on disk is read
        and unpickled, and stays on disk); KeyError if absent."""
        for _ in range(3):
            skey = self._keys[key]
            try:
                return self._store.peek(skey)
            except KeyError:
                continue
            except Corrupt as error:
                raise _damaged(key, error) from error
        raise KeyError(key)

    def keys_by_place(self) -> tuple[list, list]:
        """(keys in memory, keys on disk), each in the order they entered that place."""
        with contextlib.suppress(ValueError):  # (closed: empty)
            mem, disk = self._store.keys_by_place()
            owner = self._keys.owner
            return (
                [k for k in (owner(s, _NO_KEY) for s in mem) if k is not _NO_KEY],
                [k for k in (owner(s, _NO_KEY) for s in disk) if k is not _NO_KEY],
            )
        return [], []

    def place_counts(self) -> tuple[int, int]:
        """(keys in memory, keys on disk); ValueError once closed."""
        if self._keys.reserved:  # keys being put: count those the store has as this buffer's
            mem, disk = self.keys_by_place()
            return len(mem), len(disk)
        return self._store.counts()

    @property
    def memory_weight(self) -> int:
        """Weight of the keys in memory (sizeof for objects, bytes for frames); ValueError once
        closed."""
        return self._store.memory_bytes


_NO_KEY = object()  # "no key" where None would be a valid key


async def _close_with(buffer_ref: weakref.ref, worker: object) -> None:
    """Close the buffer once ``worker`` has finished closing (``Server.finished``), if it holds
    nothing: a closed worker's data stays readable as dask's does (dask's tests check a closed
    worker's state against it), and an empty one gives back its files and threads at once."""
    await worker.finished()
    buffer = buffer_ref()
    if buffer is not None and len(buffer) == 0:
        buffer.close()
