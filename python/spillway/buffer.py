"""``SpillBuffer``: dask's spill store on the spillway segment log.

A ``collections.abc.MutableMapping`` from dask keys to objects with the public contract of
``distributed.spill.SpillBuffer``: least-recently-used values are pickled and written to disk when
the total in-memory weight passes ``target``. Pass it to a dask worker as ``data=`` (see
:func:`spillway.worker_data`).

Tiers
-----
Each key is in exactly one tier:

* ``"object"``: the Python object, weighed with ``dask.sizeof.sizeof`` (``sys.getsizeof`` when dask
  is not installed), exactly as dask weighs it, so the same sequence of sets and gets spills the
  same keys as dask's ``SpillBuffer`` (with ``max_spill`` set, see below);
* ``"frames"``: pickled frames held in memory (from :meth:`SpillBuffer.set_serialized`), weighed by
  their exact byte length and spilled in the same LRU order as objects;
  :meth:`~SpillBuffer.__getitem__` unpickles them once and keeps the object (an object heavier than
  ``target`` is not kept: it is built on copies of the frames' writeable buffers, since the frames
  are written to disk while it is in use);
* ``"disk"``: a record in the :class:`spillway.Log`.

``fast`` (alias ``memory``) views the first two tiers, ``slow`` (alias ``disk``) the third.

Policy (as dask's)
------------------
* Setting a key adds it to the tail of the LRU; while the in-memory weight is above ``target``, the
  head is spilled. A value heavier than ``target`` is spilled first, at once, and is served from
  disk without being brought back into memory. Reading a spilled key that is not heavier than
  ``target`` moves it back into memory (and may spill others).
* A key not heavier than ``target`` is never spilled by its own set: when the older keys in memory
  are all being written or read by other threads, the in-memory weight stays above ``target`` until
  a later eviction round.
* ``max_spill``: a spill that would take the bytes on disk above it is refused; the key stays in
  memory and "Spill file on disk reached capacity; keeping data in memory" is logged (at most every
  10 s). The bytes counted are the pickle frames spillway stores; dask counts its own framing, a
  little larger, so right at the limit dask may refuse a spill that spillway makes.
* A disk error (``OSError``, or a :class:`spillway.SpillwayError` other than ``DiskFull``), or a
  value the log refuses (``ValueError``: more than 65535 out-of-band buffers, or larger than the
  log's value limit), keeps the key in memory and logs "Spill to disk failed; keeping data in memory" with the traceback (at most
  every 10 s).
* A failed write that left the log read-only (an EIO: the log cannot tell what reached the file) is
  retried once on a fresh log in a new directory, and later spills go there; the read-only log keeps
  serving its records until the buffer closes. After ``MAX_FRESH_LOGS`` fresh logs, the last
  read-only one is kept: spills fail as above, and that the buffer keeps data in memory from now on
  is logged once, with the log's reason.
* A value that fails to pickle: if it is the one being set and is heavier than ``target`` (the only
  case in which its own set spills it), ``__setitem__`` raises ``TypeError("Failed to pickle
  'key'")`` (the pickling error chained as ``__cause__``) and the key is forgotten; otherwise it
  stays in memory and "Failed to pickle 'key'" is logged once per key.
* A failed spill stops the eviction round that hit it (as in dask); the key that failed keeps its
  place in the LRU. If the key being set is heavier than ``target`` and cannot be spilled, the other
  keys in memory are spilled instead (dask's rule).
* A spilled object that is still referenced elsewhere is kept in a weak-reference cache: reading it
  returns that same object without touching the disk (for types that allow weak references).
* **An object must not be changed in place while it is in the buffer** (dask's rule for task
  inputs). Its buffers are written to disk without a copy, with the GIL released, so a change made
  while it is being spilled lands in the record in part, or not at all. The record's checksum tells:
  as long as the object is alive, reads return it from the weak-reference cache (with the change);
  once it is gone, a read of a record whose bytes changed between the checksum and the write raises
  :class:`spillway.Corrupt`, naming the key and this cause; a change that both saw (or, with
  ``compression="lz4"``, that the compressor saw) reads back as written. Dask's own store writes such
  a torn value and reads it back without a check.

Beyond dask's policy (memory under pressure)
--------------------------------------------
These change when memory is freed and what is written, never which keys are in which tier:

* **Copies.** A value read back from disk keeps its record as a *copy* (unless ``max_spill`` is set:
  the copy's bytes would count against it). Evicting it again pickles it and compares the
  ``frames_crc`` of the result with the copy's: if they agree (the object was not changed in place)
  nothing is written and the object is dropped at once; otherwise it is written anew. Such skipped
  writes are counted in ``("disk-write-saved", "count"|"bytes")``.
* **Writing ahead.** A background thread per buffer (``spillway-writer``) writes copies of the
  oldest in-memory values, ``CLEAN_FRACTION`` of ``target`` of them, while memory is within that
  much of ``target`` or of ``process_target``: the evictions that follow (a set above target, dask's
  memory monitor calling :meth:`~SpillBuffer.evict`) drop them instead of writing them on the
  calling thread, which in a dask worker is its event loop. An eviction that reaches a value whose
  copy is being written waits for it. The same thread deletes the records the buffer gives up
  (``del``, replaced or re-read values), so no caller waits for a hole punch.
* **Process memory.** With ``process_target`` (by default, inside a dask worker: its memory limit
  times ``distributed.worker.memory.target``), a set or a read back that finds the process's RSS
  above it also spills least-recently-used keys, until their weight covers the excess: what dask's
  memory monitor does every 100 ms from the event loop, done as memory grows, before the nanny's
  95% limit can be reached. The RSS is read once per ``RSS_CHECK_BYTES`` of weight brought in.

Metrics
-------
``cumulative_metrics`` maps ``(label, unit)`` to an ever-increasing total, with dask's labels:
``("disk-write", "count"|"bytes"|"seconds")``, ``("disk-read", "count"|"bytes"|"seconds")``,
``("serialize", "seconds")``, ``("deserialize", "seconds")`` and ``("memory-read",
"count"|"bytes")`` (reads of objects in memory, bytes being their sizeof). Bytes are payload bytes.
When ``distributed`` is loaded, each metric is also reported to its ``context_meter``, as dask's
store does, so that spilling shows in a worker's fine performance metrics.

Differences from dask's ``SpillBuffer``
---------------------------------------
* ``evict()`` returns -1 when there is nothing to evict (dask raises ``KeyError``).
* A spill failure while *reading* a key (the read brought the key back into memory and pushed
  another one out) is logged and not raised (dask raises it from ``__getitem__``).
* ``spilled_total.disk`` counts payload bytes before the log's compression.
* No ``("compress", ...)``/``("decompress", ...)`` metrics: compression happens inside the log and
  is counted in ``disk-write``/``disk-read`` seconds.

Serialization
-------------
:mod:`spillway.codec`: ``pickle`` protocol 5 with out-of-band buffers (frames ``[header,
*buffers]``, handed to the log without joining them), the cloudpickle fallback, and the numpy fast
path whose header is pickled once per kind of array.

Read-only buffers: ``Log.get`` returns writable memoryviews over a read buffer private to that call,
so arrays unspilled from disk are writeable without a copy, as dask's are. Frames kept in memory
(``set_serialized``) may be read-only (``bytes``): by default (``writeable=True``) such an
out-of-band buffer is copied once into a ``bytearray``; ``writeable=False`` never copies.

Keys
----
The mapping itself is a Python dict, so keys follow dict semantics: ``1`` and ``"1"`` are distinct
keys, while ``1``, ``1.0`` and ``True`` are the same key. A spilled record's log key is
``encode_key(key)`` (deterministic, injective over dask keys up to dict equality; see
:func:`encode_key`) followed by an 8-byte write counter, so every write has a log key of its own: a
record written by an eviction that raced with a ``del`` or a new ``set`` of the same key is never
mistaken for the current one.

Directory
---------
Like dask's, a ``SpillBuffer`` starts empty: it opens a fresh log in a new ``spillway-*``
subdirectory of ``spill_directory`` and removes that subdirectory in :meth:`~SpillBuffer.close`
(also run when the buffer is garbage-collected or the interpreter exits). Nothing is ever reopened.

Threads
-------
All methods may be called from several threads. One lock guards the bookkeeping; pickling,
unpickling and disk I/O run outside it (the log releases the GIL while it reads, writes or
deletes); deletes run on the background writer.
Concurrent ``__getitem__`` of the same key that is not in memory as an object unpickles it once: the
first thread reads and unpickles, the others wait on an event (GIL released) and receive the same
object, or the same exception, in which case the data stays where it was.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import hashlib
import logging
import math
import numbers
import os
import re
import shutil
import sys
import tempfile
import threading
import weakref
from collections import OrderedDict, defaultdict
from collections.abc import Hashable, ItemsView, Iterator, Mapping, MutableMapping, ValuesView
from time import monotonic, perf_counter, thread_time
from typing import Any, Literal, NamedTuple

from spillway import codec
from spillway._core import Corrupt, DiskFull, Log, SpillwayError, fetch, fetch_into, frames_crc

__all__ = [
    "PickleError",
    "PickledFrames",
    "ReceivedRecord",
    "SpillBuffer",
    "SpilledSize",
    "encode_key",
    "reset_log_rate_limits",
]

logger = logging.getLogger("spillway")

MAX_SPILL_MESSAGE = "Spill file on disk reached capacity; keeping data in memory"
DISK_ERROR_MESSAGE = "Spill to disk failed; keeping data in memory"
PICKLE_ERROR_MESSAGE = "Failed to pickle %r"

#: Encoded keys longer than this are shortened to a prefix and a digest (log keys are bounded).
MAX_ENCODED_KEY_BYTES = 512

#: The background writer keeps the oldest in-memory values written to disk (as copies, see
#: ``_Entry.log_key``), so that evicting them drops them without a write: the oldest values adding
#: up to this fraction of ``target`` (and at most ``CLEAN_SCAN`` of them). It works only while
#: values are being evicted (one was in the last ``AHEAD_AFTER_EVICTION_SECONDS``) and memory is
#: within that much of ``target`` or of ``process_target``: where nothing is evicted, a write
#: ahead is wasted on values deleted first (a task shuffle's pieces: 5x the pickles, measured).
CLEAN_FRACTION = 0.25
AHEAD_AFTER_EVICTION_SECONDS = 2.0
CLEAN_SCAN = 256
#: Values the writer takes per round (it lets go of the lock between rounds).
CLEAN_BATCH = 8
#: An object that pickles slower than this (bytes per second of frames) is not written ahead: checking
#: its copy at eviction would cost such a pickle again, about what writing it costs. (A numpy array
#: pickles at many GB/s: a header and a view; a dataframe of Python objects at tens of MB/s.)
AHEAD_MIN_PICKLE_RATE = 1 << 30
#: A pickle's fixed cost, not counted against its type's rate: a 100 KB array's pickle (a header
#: and a view of its buffer) takes 20-180 µs of CPU from one call to the next, and counted, that
#: noise judged arrays slow (below ``AHEAD_MIN_PICKLE_RATE``) in one round of two.
PICKLE_OVERHEAD_SECONDS = 200e-6
#: A type found to pickle too slowly is pickled again for a write ahead at most once per this many
#: seconds, to learn whether its values became quicker to pickle. (Once per 64 of the writer's scans
#: of it, a task shuffle of Python objects pickled each piece 2.5-4x where dask's store pickles it
#: once: the writer scans the same pieces at each wake-up.)
AHEAD_PROBE_SECONDS = 30.0
#: After a failed write ahead (disk error, pickling error), the writer rests this long (s).
CLEAN_BACKOFF_SECONDS = 5.0
#: A failed write (an EIO, say) leaves a log read-only: the buffer then writes to a fresh log, in a
#: new directory, at most this many times in its life (the disk may have failed for a moment; if it
#: fails that often, it is failing). The read-only logs stay open, for their records (a delete of
#: spill data needs no write: it releases the record's blocks), until the buffer closes.
MAX_FRESH_LOGS = 3

#: Bytes of weight brought into memory (sets, reads back) between two reads of the process's RSS
#: (see ``process_target``). A read costs about 2 µs.
RSS_CHECK_BYTES = 1 << 20


# --------------------------------------------------------------------------------------------------
# Logging


class _RateLimit(logging.Filter):
    """Where distributed is not installed: let a record whose message starts with ``prefix``
    through at most once every ``seconds``. (With distributed, its own ``RateLimiterFilter``.)"""

    def __init__(self, prefix: str, seconds: float = 10.0):
        super().__init__()
        self.prefix = prefix
        self.seconds = seconds
        self.last = -math.inf

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith(self.prefix):
            now = monotonic()
            if now - self.last < self.seconds:
                return False
            self.last = now
        return True


#: The messages rate-limited as dask rate-limits its own (``distributed.spill``): the prefixes dask's
#: filters match.
_RATE_LIMITED = ("Spill file on disk reached capacity", "Spill to disk failed")
_rate_filters: list = []


def _install_rate_limits() -> None:
    """Rate-limit ``_RATE_LIMITED`` on the ``spillway`` logger: with distributed's
    ``RateLimiterFilter`` once distributed is loaded (so its ``reset_timer("spillway")``, which dask's
    test suite uses, resets them), else with ``_RateLimit``. Run whenever a buffer is made (in a
    dask worker, distributed is loaded by then), so that spillway itself never imports distributed."""
    utils = sys.modules.get("distributed.utils")
    limiter = getattr(utils, "RateLimiterFilter", None)
    if _rate_filters and (limiter is None or isinstance(_rate_filters[0], limiter)):
        return
    for f in _rate_filters:
        logger.removeFilter(f)
    if limiter is None:
        _rate_filters[:] = [_RateLimit(prefix) for prefix in _RATE_LIMITED]
    else:
        _rate_filters[:] = [limiter(re.escape(prefix)) for prefix in _RATE_LIMITED]
    for f in _rate_filters:
        logger.addFilter(f)


def reset_log_rate_limits() -> None:
    """Let the next rate-limited message through at once (for tests)."""
    for f in _rate_filters:
        if isinstance(f, _RateLimit):
            f.last = -math.inf
        else:
            type(f).reset_timer(logger)


# --------------------------------------------------------------------------------------------------
# Process memory

_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
_statm_fd: int | None = None


def _rss() -> int:
    """This process's resident set size in bytes (what dask's memory monitor and nanny watch)."""
    global _statm_fd
    if _statm_fd is None:
        _statm_fd = os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC)
    return int(os.pread(_statm_fd, 128, 0).split()[1]) * _PAGE_BYTES


# --------------------------------------------------------------------------------------------------
# Keys


def encode_key(key: Hashable) -> bytes:
    """Deterministic bytes describing a dask key.

    Injective over dask keys (``str``, ``bytes``, ``int``, ``float``, ``None`` and tuples of these,
    nested) up to dict equality: two keys get the same bytes if and only if they are the same dict
    key. So ``1``, ``1.0`` and ``True`` encode alike, ``"1"`` and ``b"1"`` differ from them and
    from each other, and ``("a", ("b", 1))`` differs from ``("a", "b", 1)``. numpy integer and
    float scalars encode as the Python numbers they equal. Other types are encoded by type name and
    ``repr``, which describes them but is not guaranteed to be injective; ``SpillBuffer`` never
    relies on it for identity. Encodings longer than ``MAX_ENCODED_KEY_BYTES`` are cut to a prefix
    plus a BLAKE2b digest of the whole.
    """
    out = bytearray()
    _encode(key, out)
    if len(out) > MAX_ENCODED_KEY_BYTES:
        digest = hashlib.blake2b(out, digest_size=32).digest()
        out = out[: MAX_ENCODED_KEY_BYTES // 2] + b"~" + digest
    return bytes(out)


def _encode(key: object, out: bytearray) -> None:
    if isinstance(key, str):
        b = key.encode("utf-8", "surrogatepass")
        out += b"s%d:" % len(b)
        out += b
    elif isinstance(key, tuple):
        out += b"t%d:" % len(key)
        for item in key:
            _encode(item, out)
    elif isinstance(key, (bytes, bytearray)):
        out += b"b%d:" % len(key)
        out += key
    elif key is None:
        out += b"n"
    elif isinstance(key, (int, numbers.Integral)):  # bool, int, numpy integers
        out += b"i%d;" % int(key)
    elif isinstance(key, float):  # float, numpy.float64
        _encode_real(float(key), out)
    elif isinstance(key, complex):
        if key.imag == 0:
            _encode_real(key.real, out)
        else:
            out += b"c%s,%s;" % (key.real.hex().encode(), key.imag.hex().encode())
    else:
        r = f"{type(key).__module__}.{type(key).__qualname__}:{key!r}".encode(
            "utf-8", "backslashreplace"
        )
        out += b"r%d:" % len(r)
        out += r


def _encode_real(x: float, out: bytearray) -> None:
    if math.isfinite(x) and x == int(x):
        out += b"i%d;" % int(x)  # 1.0 == 1 and -0.0 == 0 as dict keys
    else:
        out += b"f%s;" % x.hex().encode()


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



# --------------------------------------------------------------------------------------------------
# State


class PickledFrames:
    """A value as pickle protocol 5 frames, ``[header, *out-of-band buffers]``: set into a
    :class:`SpillBuffer` (``buf[key] = PickledFrames(frames)``), it is stored as
    :meth:`SpillBuffer.set_serialized` stores frames, without unpickling them. This is how a value
    received from a peer reaches the store through dask's ``data[key] = value`` (see
    :mod:`spillway.dask`). ``sys.getsizeof`` (and so dask's ``sizeof``) is the frames' byte length."""

    __slots__ = ("frames", "__weakref__")

    def __init__(self, frames: list):
        self.frames = frames

    def __sizeof__(self) -> int:
        return codec.frame_bytes(self.frames)

    def __repr__(self) -> str:
        return f"<PickledFrames: {len(self.frames)} frames, {codec.frame_bytes(self.frames)} bytes>"


class ReceivedRecord:
    """A value a peer sent straight into a :class:`SpillBuffer`'s log (:meth:`SpillBuffer.receive`):
    set into that buffer (``buf[key] = record``, as dask's ``data[key] = value`` does), it becomes
    the key's value on disk without being read. A record that is never set is deleted from the log
    once this object is collected. ``sys.getsizeof`` (and so dask's ``sizeof``) is the value's
    frames' byte length."""

    __slots__ = ("_buffer", "key", "log_key", "nbytes", "_orphan", "__weakref__")

    def __init__(self, buffer: SpillBuffer, key: Hashable, log_key: bytes, nbytes: int):
        self._buffer = weakref.ref(buffer)
        self.key = key
        self.log_key = log_key
        self.nbytes = nbytes
        self._orphan = weakref.finalize(self, _delete_orphan, self._buffer, key, log_key)

    def __sizeof__(self) -> int:
        return self.nbytes

    def __repr__(self) -> str:
        return f"<ReceivedRecord: {self.nbytes} bytes on disk>"


def _delete_orphan(buffer_ref, key: Hashable, log_key: bytes) -> None:
    buffer = buffer_ref()
    if buffer is not None:
        buffer._delete_record(key, log_key)  # queued for the writer thread: safe from a finalizer


#: (buffer, {key: value}) while :meth:`SpillBuffer.serving` is in effect in this context.
_SERVING: contextvars.ContextVar = contextvars.ContextVar("spillway_serving", default=None)


class Tier(enum.Enum):
    """Where a key's value is."""

    OBJECT = "object"
    FRAMES = "frames"
    DISK = "disk"


_NO_KEY = object()  # "no key" where None would be a valid key
_OBJECT = Tier.OBJECT
_FRAMES = Tier.FRAMES
_DISK = Tier.DISK


class SpilledSize(NamedTuple):
    """Size of what is on disk: ``memory`` is its in-memory weight (sizeof), ``disk`` its payload
    bytes."""

    memory: int
    disk: int

    def __add__(self, other: SpilledSize) -> SpilledSize:  # type: ignore[override]
        return SpilledSize(self.memory + other.memory, self.disk + other.disk)

    def __sub__(self, other: SpilledSize) -> SpilledSize:
        return SpilledSize(self.memory - other.memory, self.disk - other.disk)


class _Load:
    """One in-flight unpickle of a key; other readers of the key wait for its outcome.

    A plain lock, held by the reading thread from creation until the outcome is set, is the cheapest
    event there is: a waiter blocks in ``acquire`` (with the GIL released), then passes it on.
    """

    __slots__ = ("_busy", "_value", "_error")

    def __init__(self) -> None:
        self._busy = threading.Lock()
        self._busy.acquire()
        self._value: object = None
        self._error: BaseException | None = None

    def set_result(self, value: object) -> None:
        self._value = value
        self._busy.release()

    def set_exception(self, error: BaseException) -> None:
        self._error = error
        self._busy.release()

    def wait(self) -> object:
        with self._busy:  # blocks until the outcome is set; the GIL is released meanwhile
            pass
        if self._error is not None:
            raise self._error
        return self._value


class _Entry:
    """One key. ``value`` is the object (tier OBJECT), the frames (FRAMES) or None (DISK)."""

    __slots__ = (
        "tier",
        "value",
        "weight",
        "log_key",
        "disk_bytes",
        "crc",
        "loading",
        "evicting",
        "evicting_weight",
        "cleaning",
    )

    def __init__(self, tier: Tier, value: object, weight: int):
        self.tier = tier
        self.value = value
        self.weight = weight  # sizeof (objects) or byte length (frames); kept while on disk
        # The key's record in the log (b"" if none): its value on disk (tier DISK), or a copy of an
        # object read back from disk (tier OBJECT), kept so that evicting it again costs no write.
        self.log_key = b""
        self.disk_bytes = 0
        # ``frames_crc`` of the record's frames, when known (a copy's, always): an object whose
        # frames have this crc still is what the record holds.
        self.crc: int | None = None
        self.loading: _Load | None = None  # a thread is reading/unpickling this key
        self.evicting = False  # a thread is writing this key to disk
        # The part of the buffer's _evicting_weight that this key's write accounts for: its weight,
        # until the write returns, or until a del or an unpickle makes that write moot (the weight
        # has then left memory, or is counted anew, at once).
        self.evicting_weight = 0
        self.cleaning = False  # the background writer is writing a copy of it


class _WeakCache:
    """Key -> object, holding weak references only: spilled objects that are still alive elsewhere.

    A ``WeakValueDictionary`` without its per-item callback (a Python-level ``KeyedRef`` per set,
    which cost more than the rest of a small read): a reference whose object died stays until its
    key is looked up, replaced or dropped, which ``SpillBuffer`` does when the key is read back,
    promoted or deleted, so dead references are bounded by the number of keys on disk. Only used
    under the buffer's lock."""

    __slots__ = ("_refs",)

    def __init__(self) -> None:
        self._refs: dict = {}

    def get(self, key: Hashable) -> object:
        ref = self._refs.get(key)
        if ref is None:
            return None
        obj = ref()
        if obj is None:
            del self._refs[key]
        return obj

    def __setitem__(self, key: Hashable, obj: object) -> None:
        """TypeError if ``obj``'s type does not allow weak references."""
        self._refs[key] = weakref.ref(obj)

    def pop(self, key: Hashable, default: object = None) -> object:
        ref = self._refs.pop(key, None)
        obj = None if ref is None else ref()
        return default if obj is None else obj

    def __len__(self) -> int:
        return len(self._refs)


class _RecordGone(Exception):
    """A key's record left the log while it was being read (another thread deleted the key, set it
    again, or brought it back into memory): the reader starts over from the key's current state."""


class _SpillFailure(Exception):
    """A spill that did not happen; the key is still in memory. ``kind`` is "pickle", "max_spill" or
    "disk"; ``error`` the exception behind it."""

    def __init__(self, kind: str, key: Hashable, error: BaseException):
        super().__init__(kind, key, error)
        self.kind = kind
        self.key = key
        self.error = error


class _Writer:
    """The background writer of one buffer: a thread that writes copies of the oldest in-memory
    values ahead of their eviction (``SpillBuffer._clean_round``) and deletes records that the
    buffer gave up (``SpillBuffer._delete_record``), so that neither runs on the threads that set,
    get or evict (in a dask worker, its event loop). It holds the buffer through a weak reference:
    the buffer can be garbage-collected, and its finalizer stops the thread."""

    def __init__(self, buffer: SpillBuffer):
        self.cond = threading.Condition(threading.Lock())
        self.deletes: list = []  # (key, log key) to delete
        self.wanted = False  # a round of writes ahead is wanted
        self.busy = False  # the thread is deleting or writing ahead
        self.stopping = False
        self.ref = weakref.ref(buffer)
        self.thread = threading.Thread(target=self._run, name="spillway-writer", daemon=True)
        self.thread.start()

    def wake(self) -> None:
        with self.cond:
            if not self.wanted:
                self.wanted = True
                self.cond.notify_all()

    def delete(self, key: Hashable, log_key: bytes) -> None:
        with self.cond:
            self.deletes.append((key, log_key))
            self.cond.notify_all()

    def drain(self) -> None:
        """Wait until the thread is idle: every delete handed over so far done, no round wanted or
        running. (For tests.)"""
        with self.cond:
            while (self.deletes or self.wanted or self.busy) and not self.stopping:
                self.cond.wait()

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        if threading.current_thread() is not self.thread:
            self.thread.join()

    def _run(self) -> None:
        while True:
            with self.cond:
                while not (self.deletes or self.wanted or self.stopping):
                    self.cond.wait()
                if self.stopping:
                    return  # the log is closed next: its records go with its directory
                deletes, self.deletes = self.deletes, []
                wanted, self.wanted = self.wanted, False
                self.busy = True
            buffer = self.ref()
            if buffer is None:
                return
            for key, log_key in deletes:
                buffer._delete_from_log(key, log_key)
            more = False
            if wanted:
                try:
                    more = buffer._clean_round()
                except Exception:  # never let the thread die: evictions write instead
                    logger.exception("Unexpected error while writing ahead")
            del buffer
            with self.cond:
                self.wanted = self.wanted or more
                self.busy = False
                self.cond.notify_all()


def _damaged(key: Hashable, error: Corrupt) -> Corrupt:
    """The error for a spilled record of ``key`` that fails its checks."""
    return Corrupt(
        f"the spilled data of {key!r} is damaged ({error}). An object changed in place while it was "
        "being spilled reads so too: its bytes no longer match the checksum of what was written"
    )


def _close_logs(logs: list, writer: _Writer) -> None:
    try:
        writer.stop()
    finally:
        for _, log, directory in logs:
            try:
                log.close()
            finally:
                shutil.rmtree(directory, ignore_errors=True)


# --------------------------------------------------------------------------------------------------
# SpillBuffer


class SpillBuffer(MutableMapping):
    """A mapping from dask keys to objects that spills least-recently-used values to a spillway log.

    Parameters
    ----------
    spill_directory:
        Directory in which a fresh ``spillway-*`` log directory is created (and removed on close).
    target:
        In-memory weight, in bytes, above which least-recently-used values are spilled.
    max_spill:
        Most payload bytes on disk; ``False`` (or ``None``) for no limit.
    compression:
        The log's compression: ``"none"`` or ``"lz4"``.
    backend:
        The log's I/O backend: ``"auto"``, ``"uring"``, ``"portable"`` or ``"sim"`` (the simulated
        disk, in memory, whose faults tests script with ``Log._inject_fault``).
    segment_bytes:
        Size of the log's segment files.
    serialized_in_memory:
        Whether frames given to :meth:`set_serialized` stay in memory (tier ``"frames"``, weighed by
        their byte length and spilled in LRU order like objects). If False they go straight to disk.
    writeable:
        Whether objects read back from the log get writeable buffers (see the module docstring). If
        False, buffers are never copied and may be read-only.
    process_target:
        Bytes of process memory (RSS) above which a set or a read back also spills
        least-recently-used keys, until their weight covers the excess. ``"auto"`` (the default):
        inside a dask worker whose ``data`` this buffer is, the worker's memory limit times
        ``distributed.worker.memory.target`` (or ``.spill``); elsewhere, off. ``None``: off.
    """

    #: keys whose pickling error was logged (dask's attribute of the same name)
    logged_pickle_errors: set
    #: (label, unit) -> ever-increasing cumulative value, with dask's labels
    cumulative_metrics: defaultdict

    def __init__(
        self,
        spill_directory: str | os.PathLike,
        target: int,
        max_spill: int | Literal[False] | None = False,
        *,
        compression: str = "none",
        backend: str = "auto",
        segment_bytes: int = 64 << 20,
        serialized_in_memory: bool = True,
        writeable: bool = True,
        process_target: int | Literal["auto"] | None = "auto",
    ):
        self.target = target
        self.max_spill = False if max_spill is None else max_spill
        self.serialized_in_memory = serialized_in_memory
        self.writeable = writeable
        self.logged_pickle_errors = set()
        self.cumulative_metrics = defaultdict(float)
        _install_rate_limits()

        os.makedirs(spill_directory, exist_ok=True)
        self.directory = tempfile.mkdtemp(
            prefix="spillway-", dir=os.path.abspath(os.fspath(spill_directory))
        )
        self._log_options = {
            "segment_bytes": segment_bytes,
            "compression": compression,
            "backend": backend,
        }
        try:
            self._log = Log(self.directory, **self._log_options)
        except BaseException:
            shutil.rmtree(self.directory, ignore_errors=True)
            raise
        #: Every open log, oldest first, as [first write number, log, directory]: the log of a log
        #: key is the last one whose first write number is at most the key's (see ``_log_of``). The
        #: last is ``self._log``, where new records go.
        self._logs: list = [[1, self._log, self.directory]]
        self._fresh_logs = 0  # fresh logs opened after a failed write
        self._log_swap = threading.Lock()  # taken to replace a read-only log
        self._writer = _Writer(self)
        self._finalizer = weakref.finalize(self, _close_logs, self._logs, self._writer)
        self._clean_backoff_until = 0.0
        self._last_eviction = -math.inf
        self._pickle_rates: dict = {}  # type -> [average bytes/s of its pickles, next probe time]

        self._lock = threading.RLock()
        self._cleaned = threading.Condition(self._lock)  # the writer settled a copy
        self._entries: dict[Hashable, _Entry] = {}
        self._lru: OrderedDict[Hashable, None] = OrderedDict()  # in-memory keys, least recent first
        self._heavy: OrderedDict[Hashable, None] = OrderedDict()  # in-memory keys to spill first
        self._memory_weight = 0  # sum of weights of in-memory keys
        self._evicting_weight = 0  # ... of those being written to disk right now
        self._spilled_memory = 0  # sum of weights of keys on disk
        self._spilled_disk = 0  # sum of payload bytes of keys on disk
        self._reserved_disk = 0  # payload bytes of writes in flight (max_spill)
        self._incoming = 0  # frames received into memory (``receive``) and not yet let go of
        self._writes = 0  # makes every log key unique
        self._process_target = process_target
        self._added_since_rss = 0  # weight brought into memory since the RSS was last read
        self._last_rss = 0
        self._out_of_reach = 0  # RSS above process_target that spilling did not bring down
        self._weak = _WeakCache()
        # Inside a dask worker, also report metrics to distributed's context meter (as dask's
        # SpillBuffer does), so that they appear in the worker's fine performance metrics.
        metrics_module = sys.modules.get("distributed.metrics")
        self._context_meter = getattr(metrics_module, "context_meter", None)

    # ---------------------------------------------------------------------------------------------
    # Properties

    @property
    def log(self) -> Log:
        """The :class:`spillway.Log` new records go to (see ``MAX_FRESH_LOGS``)."""
        return self._log

    @property
    def fast(self) -> _TierView:
        """Keys in memory (objects and held frames). For inspection: reading through this view
        neither changes tiers nor the LRU order."""
        return _TierView(self, in_memory=True)

    @property
    def slow(self) -> _TierView:
        """Keys on disk. For inspection: reading through this view neither changes tiers nor the LRU
        order."""
        return _TierView(self, in_memory=False)

    memory = fast
    disk = slow

    @property
    def spilled_total(self) -> SpilledSize:
        """(in-memory weight, payload bytes) of the keys on disk."""
        with self._lock:
            return SpilledSize(self._spilled_memory, self._spilled_disk)

    def tier(self, key: Hashable) -> str:
        """``"object"``, ``"frames"`` or ``"disk"``; KeyError if absent."""
        return self._entries[key].tier.value

    # ---------------------------------------------------------------------------------------------
    # Mapping

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Hashable]:
        with self._lock:
            keys = list(self._entries)
        return iter(keys)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __repr__(self) -> str:
        with self._lock:
            return (
                f"<SpillBuffer: {len(self._lru)} in memory "
                f"({self._memory_weight}/{self.target} B), "
                f"{len(self._entries) - len(self._lru)} on disk ({self._spilled_disk} B), "
                f"{self.directory}>"
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
        weight = codec.sizeof(value)
        self._insert(key, _Entry(_OBJECT, value, weight), heavy=weight > self.target)

    def __getitem__(self, key: Hashable) -> object:
        """The object of ``key``. An object in memory moves to the tail of the LRU. A key held as
        frames or on disk is unpickled (once, whatever the number of concurrent readers) and, unless
        heavier than ``target``, kept in memory as an object. Raises SpillwayError if the key's
        record is missing from the log. Inside :meth:`serving`, the values it was given come first."""
        serving = _SERVING.get()
        if serving is not None and serving[0] is self and key in serving[1]:
            return serving[1][key]
        while True:
            try:
                return self._get_once(key)
            except _RecordGone:
                # Another thread deleted, replaced or promoted the key (a record that is lost while
                # the key still points to it raises SpillwayError instead): read again from what
                # the key is now (KeyError if it is gone).
                continue

    def _get_once(self, key: Hashable) -> object:
        with self._lock:
            e = self._entries[key]
            if e.tier is _OBJECT:
                self._lru.move_to_end(key)
                self._digest("memory-read", 1, "count")
                self._digest("memory-read", e.weight, "bytes")
                return e.value
            obj = self._weak.get(key)
            if obj is None:
                load = e.loading
                owner = load is None
                if owner:
                    load = e.loading = _Load()
                tier, frames, log_key = e.tier, e.value, e.log_key
                # An object read back is kept in memory with its record as a copy, unless it is too
                # heavy to keep, or max_spill counts the bytes on disk.
                keep_copy = self.max_spill is False and e.weight <= self.target
        if obj is not None:
            self._promote(key, e, obj)
            return obj
        if not owner:
            return load.wait()
        read = None  # (bytes, seconds) of the disk read, digested with the promotion (one lock)
        weight = None  # sizeof(obj), when known already
        crc = None  # frames_crc of the frames read, for keeping the record as a copy
        try:
            if tier is _DISK:
                t0 = perf_counter()
                try:
                    frames, crc = self._log_of(log_key).get_with_crc(log_key)
                except KeyError:
                    raise self._record_gone(key, log_key) from None  # for its waiters too
                except Corrupt as error:
                    raise _damaged(key, error) from error
                t1 = perf_counter()
                read = (sum(map(len, frames)), t1 - t0)  # 1-D byte memoryviews: len is nbytes
                if not keep_copy:
                    crc = None
                elif (
                    crc is None
                ):  # (lz4) before anything is built on the frames, which it may change
                    crc = frames_crc(frames)
                # The log's memoryviews are writeable already: nothing to copy.
                obj = codec.loads(frames, False)
            else:
                t1 = perf_counter()
                obj = codec.loads(frames, self.writeable)
                weight = codec.sizeof(obj)
                if weight > self.target and codec.shares_writeable_memory(frames):
                    # Too heavy to keep: these frames stay (and are written to disk) while the
                    # object is handed out, and may be being written already. Built on them, a task
                    # mutating the object in place would change, or tear, the record. Build it
                    # again on copies (heavy values only; a light object replaces its frames).
                    obj = codec.loads(codec.private_copies(frames), self.writeable)
            seconds = perf_counter() - t1
        except BaseException as error:
            with self._lock:
                e.loading = None
                if read is not None:
                    self._digest_io("disk-read", *read)
            load.set_exception(error)
            raise
        self._promote(key, e, obj, load, read, seconds, weight, crc)
        return obj

    def __delitem__(self, key: Hashable) -> None:
        with self._lock:
            if key not in self._entries:
                raise KeyError(key)
            log_key = self._drop(key)
        self._delete_record(key, log_key)  # outside the lock: it may punch holes, unlink files

    def pop(self, key: Hashable, default: object = None) -> object:
        raise NotImplementedError(
            "Are you calling .pop(key, None) as a way to discard a key if it exists?"
            "It may cause data to be read back from disk! Please use `del` instead."
        )

    def clear(self) -> None:
        """Forget every key without reading anything back."""
        with self._lock:
            records = [(key, self._drop(key)) for key in list(self._entries)]
        for key, log_key in records:  # outside the lock (see _delete_record)
            self._delete_record(key, log_key)

    def items(self) -> ItemsView:
        """Items; reading them neither changes tiers nor the LRU order."""
        return _PeekItemsView(self)

    def values(self) -> ValuesView:
        """Values; reading them neither changes tiers nor the LRU order."""
        return _PeekValuesView(self)

    # ---------------------------------------------------------------------------------------------
    # Spilling

    def evict(self) -> int:
        """Spill the least-recently-used key in memory (a key heavier than ``target`` first), even
        if below ``target``. Returns its in-memory weight, or -1 if nothing could be spilled
        (nothing in memory, pickling error, disk error or ``max_spill``; the cause is logged).
        Never raises."""
        try:
            weight = self._evict_one(force=True)
            if weight is not None:
                # Sets and reads made during the write counted on it to make room, and a light set
                # never spills itself: spill what they did not (if the write was thrown away, its
                # key deleted, replaced or unpickled meanwhile, it made no room at all).
                try:
                    self._evict_until_below_target()
                except _SpillFailure as failure:
                    self._log_failure(failure)
        except _SpillFailure as failure:
            self._log_failure(failure)
            return -1
        except Exception:
            logger.exception("Unexpected error while spilling")
            return -1
        self._wake_writer()
        return -1 if weight is None else weight

    # ---------------------------------------------------------------------------------------------
    # Serialized data

    def get_serialized(self, key: Hashable) -> list:
        """The pickled frames of ``key`` (``[header, *buffers]``, for ``pickle.loads(frames[0],
        buffers=frames[1:])`` or :meth:`set_serialized` elsewhere), without changing its tier.
        An object is pickled (raising PickleError if it cannot be); frames held in memory are
        returned as they are; a key on disk is read as zero-copy views of the log's buffers. A key
        in memory moves to the tail of the LRU."""
        with self._lock:
            e = self._entries[key]
            tier, value, log_key = e.tier, e.value, e.log_key
            if tier is not _DISK:
                self._lru.move_to_end(key)
                self._digest("memory-read", 1, "count")
                self._digest("memory-read", e.weight, "bytes")
                if tier is _FRAMES:
                    return list(value)
        if tier is _DISK:
            try:
                return self._read(key, log_key)
            except _RecordGone:  # (SpillwayError instead if the key has not moved: no endless loop)
                return self.get_serialized(key)  # moved meanwhile: from where it is now
        return self._pickle(key, value)

    def set_serialized(self, key: Hashable, frames: list) -> None:
        """Store pickled frames (as returned by :meth:`get_serialized`) without unpickling them.
        They are held in memory, weighed by their byte length, until spilled or unpickled by
        :meth:`__getitem__`; with ``serialized_in_memory=False``, or if heavier than ``target``,
        they are written to disk at once. The buffers are kept, not copied."""
        frames = [codec.byte_frame(f) for f in frames]
        if not frames:
            raise ValueError("frames must hold at least the pickle header")
        weight = codec.frame_bytes(frames)
        heavy = weight > self.target or not self.serialized_in_memory
        self._insert(key, _Entry(_FRAMES, frames, weight), heavy=heavy)

    def disk_record(self, key: Hashable) -> tuple | None:
        """``(log, log key, payload bytes)`` of ``key``'s record if its value is on disk, else
        None (KeyError if absent). Log keys are never reused: as long as the log has that log key,
        it holds this value (:mod:`spillway.dask` grants it to a peer)."""
        with self._lock:
            e = self._entries[key]
            if e.tier is not _DISK:
                return None
            return self._log_of(e.log_key), e.log_key, e.disk_bytes

    def receive(
        self,
        key: Hashable,
        address: tuple,
        ticket: bytes,
        remote_key: bytes,
        nbytes: int,
        *,
        timeout: float = 30.0,
    ) -> PickledFrames | ReceivedRecord:
        """Fetch ``key``'s value, ``nbytes`` of frames, from the spillway transfer server at
        ``address`` (``(host, port)``), which granted ``ticket`` for its record ``remote_key``. If it
        fits under ``target`` and ``process_target`` (counting what is being received into memory
        meanwhile), the frames come into memory: a :class:`PickledFrames`. Otherwise (and within
        ``max_spill``) they are written straight into this buffer's log, never held in memory: a
        :class:`ReceivedRecord`. Either way the value stays pickled until a task
        reads it; set it with ``buf[key] = value``. Raises KeyError if the server no longer has it,
        OSError or SpillwayError if the transfer fails or the value is not ``nbytes`` (nothing is
        kept)."""
        goal = self._resolve_process_target()
        rss = _rss() if goal is not None else 0
        with self._lock:
            to_disk = self._memory_weight + self._incoming + nbytes > self.target or (
                goal is not None and rss - self._out_of_reach + self._incoming + nbytes > goal
            )
            if to_disk and self.max_spill is not False:
                to_disk = self._spilled_disk + self._reserved_disk + nbytes <= self.max_spill
            if to_disk:
                self._reserved_disk += nbytes
            else:
                self._incoming += nbytes
        t0 = perf_counter()
        if not to_disk:
            try:
                frames = fetch(address, ticket, remote_key, nbytes, timeout=timeout)
                if frames is None:
                    raise KeyError(key)
                value = PickledFrames(frames)
            except BaseException:
                self._arrived(nbytes)
                raise
            # Counted as coming until the caller is done with it (it was set, or dropped).
            weakref.finalize(value, self._arrived, nbytes)
            with self._lock:
                self._digest_io("receive-memory", codec.frame_bytes(frames), perf_counter() - t0)
            return value
        try:
            with self._lock:  # the number and the log together, as in _put
                self._writes += 1
                log_key = encode_key(key) + self._writes.to_bytes(8, "big")
                log = self._log
            try:
                # The log does not hold its writer lock while the bytes arrive (a large value goes
                # into a segment of its own): spills go on meanwhile.
                n = fetch_into(log, address, ticket, remote_key, log_key, nbytes, timeout=timeout)
            except (OSError, SpillwayError) as error:
                # A grant is good for one try: no retry here (the caller falls back in-band). A log
                # the failure left read-only is replaced for the writes that follow.
                if not isinstance(error, DiskFull):
                    self._replace_read_only(log)
                raise
        finally:
            with self._lock:
                self._reserved_disk -= nbytes
        if n is None:
            raise KeyError(key)
        with self._lock:
            self._digest_io("receive-disk", n, perf_counter() - t0)
        return ReceivedRecord(self, key, log_key, n)

    def _arrived(self, nbytes: int) -> None:
        with self._lock:
            self._incoming -= nbytes

    def _adopt(self, key: Hashable, record: ReceivedRecord) -> None:
        """``buf[key] = record``: the record becomes ``key``'s value on disk."""
        if record._buffer() is not self or not record._orphan.alive:
            # Another buffer's record, or one set before: read it (``get_serialized`` semantics).
            owner = record._buffer()
            if owner is None:
                raise ValueError(f"{record!r} belongs to a buffer that is gone")
            frames = owner._log_of(record.log_key).get(record.log_key)
            self.set_serialized(key, frames)
            return
        record._orphan.detach()
        e = _Entry(_DISK, None, record.nbytes)
        e.log_key = record.log_key
        e.disk_bytes = record.nbytes
        with self._lock:
            old_log_key = self._drop(key)
            self._entries[key] = e
            self._spilled_memory += record.nbytes
            self._spilled_disk += record.nbytes
        self._delete_record(key, old_log_key)

    @contextlib.contextmanager
    def serving(self, values: Mapping) -> Iterator[None]:
        """While in effect (in this thread, or this asyncio task and what it awaits),
        ``buf[key]`` returns ``values[key]`` for the keys ``values`` has, without touching their
        tiers, the LRU or the metrics. :mod:`spillway.dask` uses it to hand dask's ``get_data`` the
        frames of values it reads for a peer, so that they are neither unpickled nor brought back
        into memory."""
        token = _SERVING.set((self, values))
        try:
            yield
        finally:
            _SERVING.reset(token)

    # ---------------------------------------------------------------------------------------------
    # Lifecycle

    def close(self) -> None:
        """Close the log and remove its directory. Idempotent. Waits for log operations running on
        other threads (a spill being written, a read) to finish first."""
        self._finalizer()

    def __enter__(self) -> SpillBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------------------------------------
    # Internals

    def _insert(self, key: Hashable, e: _Entry, heavy: bool) -> None:
        with self._lock:
            old_log_key = self._drop(key)
            self._entries[key] = e
            self._lru[key] = None
            self._memory_weight += e.weight
            if heavy:
                self._heavy[key] = None
        self._delete_record(key, old_log_key)  # outside the lock (see _delete_record)
        try:
            # dask (zict.LRU) spills from the LRU head, so a key not heavier than target is never
            # spilled by its own set: the older keys go first, and with them gone it fits alone.
            # Older keys that other threads are writing or reading cannot go now; spilling the new
            # key instead would still be wrong (and raise PickleError for a light value, which dask
            # never does): it waits for a later round, as in dask.
            self._evict_until_below_target(exclude=_NO_KEY if heavy else key)
            self._relieve_process_memory(e.weight, exclude=key)
            self._wake_writer()
        except _SpillFailure as failure:
            with self._lock:
                current = self._entries.get(key) is e
                # dask (zict.LRU.__setitem__): the key being set is heavier than target and its own
                # spill failed: spill all the other keys instead.
                heavy_failed = current and e.weight > self.target and key not in self._heavy
            if heavy_failed:
                self._evict_all_but(key)
            if failure.kind == "pickle" and failure.key == key and heavy:
                # dask raises only for the value being set, and only when it is heavier than
                # target (the only case in which its own set spills it); the key is forgotten.
                with self._lock:
                    log_key = self._drop(key) if self._entries.get(key) is e else b""
                self._delete_record(key, log_key)
                raise failure.error from failure.error.__cause__
            self._log_failure(failure)

    def _evict_until_below_target(self, exclude: object = _NO_KEY) -> None:
        while self._evict_one(force=False, exclude=exclude) is not None:
            # Nothing left to do (read without the lock, as an early exit: a thread that changes
            # these afterwards runs its own eviction).
            if not self._heavy and self._memory_weight - self._evicting_weight <= self.target:
                return

    def _clean_reserve(self) -> int:
        return int(self.target * CLEAN_FRACTION) if self.max_spill is False else 0

    def _writing_ahead_wanted(self) -> bool:
        """Whether values were evicted in the last ``AHEAD_AFTER_EVICTION_SECONDS`` and memory is
        within the reserve of ``target`` or of ``process_target`` (read without the lock: a
        hint)."""
        reserve = self._clean_reserve()
        if reserve <= 0 or monotonic() - self._last_eviction > AHEAD_AFTER_EVICTION_SECONDS:
            return False
        if self._memory_weight > self.target - reserve:
            return True
        goal = self._process_target
        return isinstance(goal, int) and self._last_rss > goal - reserve

    def _wake_writer(self) -> None:
        if self._writing_ahead_wanted():
            self._writer.wake()

    def _clean_round(self) -> bool:
        """One round of the background writer: write a copy of up to ``CLEAN_BATCH`` of the oldest
        in-memory values that have none, among the oldest adding up to the reserve. Returns whether
        it stopped for the batch limit (another round is wanted)."""
        if monotonic() < self._clean_backoff_until or not self._writing_ahead_wanted():
            return False
        picks = []
        with self._lock:
            reserve = self._clean_reserve()
            seen = 0
            for n, key in enumerate(self._lru):
                if n >= CLEAN_SCAN or seen >= reserve or len(picks) >= CLEAN_BATCH:
                    break
                e = self._entries[key]
                seen += e.weight
                if (
                    e.log_key
                    or e.evicting
                    or e.cleaning
                    or e.loading is not None
                    or key in self._heavy
                    or key in self.logged_pickle_errors
                    or (e.tier is _OBJECT and self._pickles_slowly(type(e.value)))
                ):
                    continue
                e.cleaning = True
                picks.append((key, e, e.tier, e.value))
        slow = set()  # types this round found to pickle slowly: the rest of the batch skips them
        for i, (key, e, tier, value) in enumerate(picks):
            if tier is _OBJECT and type(value) in slow:
                with self._lock:
                    e.cleaning = False
                    self._cleaned.notify_all()
                continue
            try:
                # The pickle's cost is the thread's CPU time: wall time would count the waits for
                # the GIL (the threads that set and get run meanwhile) and judge a quick type slow.
                t0 = thread_time()
                frames = value if tier is _FRAMES else self._pickle(key, value)
                if tier is _OBJECT and self._note_pickle_rate(
                    type(value), codec.frame_bytes(frames), thread_time() - t0
                ):
                    # Checking a copy of it would cost a pickle as slow as this one: evicting it
                    # will write it instead (and nothing is written ahead that may be deleted).
                    slow.add(type(value))
                    with self._lock:
                        e.cleaning = False
                        self._cleaned.notify_all()
                    continue
                crc = frames_crc(frames)
                log_key, stored, seconds = self._put(key, frames)
            except BaseException as error:
                # The value stays without a copy; an eviction writes it (and logs what fails).
                with self._lock:
                    for _, other, *_ in picks[i:]:
                        other.cleaning = False
                    self._cleaned.notify_all()
                self._clean_backoff_until = monotonic() + CLEAN_BACKOFF_SECONDS
                if isinstance(error, Exception):
                    return False
                raise
            with self._lock:
                e.cleaning = False
                self._cleaned.notify_all()
                self._digest_io("disk-write", stored, seconds)
                # Still this value, in memory, without a copy: the record is its copy. (Frames
                # unpickled meanwhile: the record holds the frames the object was built on.)
                keep = self._entries.get(key) is e and e.tier is not _DISK and not e.log_key
                if keep:
                    e.log_key, e.disk_bytes, e.crc = log_key, stored, crc
            if not keep:
                self._delete_record(key, log_key)
        return len(picks) >= CLEAN_BATCH

    def _pickles_slowly(self, kind: type) -> bool:
        """Under the lock: whether objects of this type are left to evictions (see
        ``AHEAD_MIN_PICKLE_RATE``). One is pickled again anyway once per ``AHEAD_PROBE_SECONDS``,
        to learn whether the type's values became quicker to pickle."""
        rate = self._pickle_rates.get(kind)
        if rate is None or rate[0] >= AHEAD_MIN_PICKLE_RATE:
            return False
        now = monotonic()
        if now < rate[1]:
            return True
        rate[1] = now + AHEAD_PROBE_SECONDS
        return False

    def _note_pickle_rate(self, kind: type, nbytes: int, seconds: float) -> bool:
        """Record a pickle of an object of type ``kind`` (an average of the rates of its type's
        pickles); whether it was too slow to write ahead."""
        seconds -= PICKLE_OVERHEAD_SECONDS
        rate = nbytes / seconds if seconds > 0 else math.inf
        with self._lock:
            known = self._pickle_rates.get(kind)
            if known is None:
                self._pickle_rates[kind] = [rate, monotonic() + AHEAD_PROBE_SECONDS]
            else:
                known[0] = (known[0] + rate) / 2
        return rate < AHEAD_MIN_PICKLE_RATE

    def _drain(self) -> None:
        """Wait for the background writer to be idle (its deletes done). For tests."""
        self._writer.drain()

    def _relieve_process_memory(self, added: int, exclude: object) -> None:
        """After ``added`` bytes of weight came into memory: if the process's RSS is above
        ``process_target``, spill least-recently-used keys (never ``exclude``, the key just set or
        read) until their weight covers the excess. The RSS is read once per ``RSS_CHECK_BYTES``
        of weight added.

        Memory that spilling did not give back to the system (freed Python objects that stay in
        the allocator's arenas, values still referenced elsewhere) is learned as out of reach: a
        round that spilled W bytes of weight while the RSS fell by less than W/2 adds the
        difference, and later checks spill only for RSS above it (it shrinks again as the RSS
        falls, and never exceeds a quarter of ``process_target``). Without this, a worker whose RSS stays
        high whatever is spilled spills and reads back everything over and over (a task shuffle
        of Python objects: 10x the pickles, measured). Raises _SpillFailure."""
        self._added_since_rss += added  # (a race loses a count: this only paces the checks)
        if self._added_since_rss < RSS_CHECK_BYTES:
            return
        self._added_since_rss = 0
        goal = self._resolve_process_target()
        if goal is None:
            return
        self._last_rss = rss = _rss()
        self._out_of_reach = min(self._out_of_reach, max(0, rss - goal))
        excess = rss - goal - self._out_of_reach
        freed = 0
        while freed < excess:
            weight = self._evict_one(force=True, exclude=exclude)
            if weight is None:
                break
            freed += weight
        if freed:
            fell = rss - _rss()
            if fell < freed / 2:
                self._out_of_reach = min(goal // 4, self._out_of_reach + freed - max(fell, 0))

    def _resolve_process_target(self) -> int | None:
        """``process_target`` in bytes; for "auto", that of the dask worker whose data this buffer
        is (memory_limit x the target fraction, or the spill fraction), looked up until found."""
        target = self._process_target
        if target != "auto":
            return target
        worker_module = sys.modules.get("distributed.worker")
        for worker in list(getattr(getattr(worker_module, "Worker", None), "_instances", ())):
            manager = getattr(worker, "memory_manager", None)
            if getattr(manager, "data", None) is self:
                fraction = manager.memory_target_fraction or manager.memory_spill_fraction
                limit = manager.memory_limit
                self._process_target = int(limit * fraction) if limit and fraction else None
                return self._process_target
        return None

    def _evict_all_but(self, key: Hashable) -> None:
        try:
            while self._evict_one(force=True, exclude=key) is not None:
                pass
        except _SpillFailure:
            pass

    def _victim(self, force: bool, exclude: object) -> object:
        """Under the lock: the next key to spill (heavy keys first, then LRU order), or _NO_KEY.
        Keys another thread is evicting or reading are skipped; a key whose copy the background
        writer is writing is not (the eviction waits for the copy)."""
        for key in self._heavy:
            e = self._entries[key]
            if not e.evicting and e.loading is None and (exclude is _NO_KEY or key != exclude):
                return key
        if force or self._memory_weight - self._evicting_weight > self.target:
            for key in self._lru:
                e = self._entries[key]
                if not e.evicting and e.loading is None and (exclude is _NO_KEY or key != exclude):
                    return key
        return _NO_KEY

    def _evict_one(self, force: bool, exclude: object = _NO_KEY) -> int | None:
        """Spill one key: the head of the LRU, if above target or ``force``. Returns its weight,
        None if there was nothing to spill, raises _SpillFailure if the spill failed (the key stays
        in memory, in its place in the LRU)."""
        with self._lock:
            while True:
                key = self._victim(force, exclude)
                if key is _NO_KEY:
                    return None
                e = self._entries[key]
                if not e.cleaning:
                    break
                # Its copy is being written: once it lands, evicting the value writes nothing.
                self._cleaned.wait()
            e.evicting = True
            self._last_eviction = monotonic()
            self._heavy.pop(key, None)  # a heavy key whose spill fails stays at the LRU tail
            e.evicting_weight = e.weight
            self._evicting_weight += e.weight
            tier, value, weight = e.tier, e.value, e.weight
            copy = (e.log_key, e.disk_bytes, e.crc) if e.log_key else None
        try:
            log_key, stored, seconds = self._write(key, tier, value, copy)
        except BaseException as error:
            with self._lock:
                e.evicting = False
                self._stop_evicting(e)
            if isinstance(error, PickleError):
                raise _SpillFailure("pickle", key, error) from None
            if isinstance(error, DiskFull):
                raise _SpillFailure("max_spill", key, error) from None
            # ValueError: a value the log cannot hold (more out-of-band buffers than a record's
            # frame table, or larger than its value limit) stays in memory like any failed write.
            if isinstance(error, (OSError, SpillwayError, ValueError)):
                raise _SpillFailure("disk", key, error) from None
            raise

        reused = copy is not None and log_key == copy[0]
        stale = b""  # a copy that no longer matches the object: deleted once the write landed
        with self._lock:
            e.evicting = False
            self._stop_evicting(e)  # (nothing left to release if a del or an unpickle did)
            if reused:
                self._digest("disk-write-saved", 1, "count")
                self._digest("disk-write-saved", stored, "bytes")
            else:
                self._digest_io("disk-write", stored, seconds)
            lost = self._entries.get(key) is not e or e.tier is not tier
            if not lost:
                if copy is not None and not reused:
                    stale = e.log_key
                del self._lru[key]
                self._heavy.pop(key, None)
                self._memory_weight -= weight
                e.tier = _DISK
                e.value = None
                e.log_key = log_key
                e.disk_bytes = stored
                if not reused:
                    e.crc = None
                self._spilled_memory += weight
                self._spilled_disk += stored
                if tier is _OBJECT:
                    try:
                        self._weak[key] = value
                    except TypeError:  # no weak references to this type
                        pass
        if lost:
            # Deleted, replaced or unpickled by another thread while we were writing. A new record
            # is no one's (its log key is new): delete it outside the lock (see _delete_record). A
            # reused copy was deleted with the key by whoever dropped it.
            if not reused:
                self._delete_record(key, log_key)
            return 0
        self._delete_record(key, stale)
        return weight

    def _write(self, key: Hashable, tier: Tier, value: object, copy=None):
        """Pickle (objects) and write one value to the log, within ``max_spill``. Returns (log
        key, payload bytes, seconds). ``copy`` is the (log key, payload bytes, crc) of a record
        the value was read back from: if the value still pickles to frames of that crc, nothing is
        written and the copy's log key is returned. Raises PickleError, DiskFull (max_spill),
        OSError, SpillwayError, ValueError (a value the log refuses)."""
        frames = value if tier is _FRAMES else self._pickle(key, value)
        if copy is not None and copy[2] is not None and frames_crc(frames) == copy[2]:
            return copy[0], copy[1], 0.0
        if self.max_spill is False:
            return self._put(key, frames)
        nbytes = codec.frame_bytes(frames)
        with self._lock:  # reserve the space, so that concurrent spills cannot overshoot together
            if self._spilled_disk + self._reserved_disk + nbytes > self.max_spill:
                raise DiskFull(f"spilling {nbytes} bytes would exceed max_spill={self.max_spill}")
            self._reserved_disk += nbytes
        try:
            return self._put(key, frames)
        finally:
            with self._lock:
                self._reserved_disk -= nbytes

    def _put(self, key: Hashable, frames: list) -> tuple:
        """Write ``frames`` for ``key`` under a new log key, in the current log. Returns (log key,
        payload bytes, seconds). A write that leaves the log read-only is tried once more, on the
        fresh log that replaces it (see ``MAX_FRESH_LOGS``). Raises what ``Log.put`` raises."""
        for attempt in (1, 2):
            with self._lock:  # the number and the log together: ``_log_of`` maps one to the other
                self._writes += 1
                log_key = encode_key(key) + self._writes.to_bytes(8, "big")
                log = self._log
            t0 = perf_counter()
            try:
                return log_key, log.put(log_key, frames), perf_counter() - t0
            except (OSError, SpillwayError) as error:
                if isinstance(error, DiskFull) or attempt == 2 or not self._replace_read_only(log):
                    raise

    def _log_of(self, log_key: bytes) -> Log:
        """The log that holds ``log_key`` (by the write number at its end; see ``self._logs``)."""
        number = int.from_bytes(log_key[-8:], "big")
        if number >= self._logs[-1][0]:
            return self._log
        for first, log, _ in reversed(self._logs):
            if number >= first:
                return log
        return self._logs[0][1]

    def _replace_read_only(self, failed: Log) -> bool:
        """After ``failed`` refused a write: if it is read-only now, make a fresh log the one new
        records go to (unless another thread did already, or ``MAX_FRESH_LOGS`` were opened).
        Returns whether a write should be tried again."""
        try:
            reason = failed.read_only
        except ValueError:  # closed
            return False
        if reason is None:
            return False  # an error of that write alone
        with self._log_swap:
            if self._log is not failed:
                return True
            if self._fresh_logs >= MAX_FRESH_LOGS:
                if self._fresh_logs == MAX_FRESH_LOGS:
                    self._fresh_logs += 1
                    logger.error(
                        "the spill log in %s is read-only (%s) and %d fresh logs failed before it; "
                        "keeping data in memory from now on",
                        self._logs[-1][2],
                        reason,
                        MAX_FRESH_LOGS,
                    )
                return False
            parent = os.path.dirname(self.directory)
            try:
                directory = tempfile.mkdtemp(prefix="spillway-", dir=parent)
                try:
                    log = Log(directory, **self._log_options)
                except BaseException:
                    shutil.rmtree(directory, ignore_errors=True)
                    raise
            except Exception:
                logger.exception("could not open a fresh spill log in %s", parent)
                return False
            self._fresh_logs += 1
            with self._lock:
                self._logs.append([self._writes + 1, log, directory])
                self._log = log
        logger.error(
            "the spill log in %s is read-only (%s); spilling to a fresh log in %s (%d of %d)",
            self._logs[-2][2],
            reason,
            directory,
            self._fresh_logs,
            MAX_FRESH_LOGS,
        )
        return True

    def _delete_from_log(self, key: Hashable, log_key: bytes) -> None:
        """Delete a record (on the background writer), from the log that holds it."""
        try:
            self._log_of(log_key).delete(log_key)
        except ValueError:
            pass  # the buffer was closed: the log and its directory are gone already
        except (OSError, SpillwayError):
            logger.error("Failed to delete the spilled data of %r from disk", key, exc_info=True)

    def _promote(
        self,
        key: Hashable,
        e: _Entry,
        obj: object,
        load: _Load | None = None,
        read: tuple | None = None,
        deserialize_seconds: float | None = None,
        weight: int | None = None,
        crc: int | None = None,
    ) -> None:
        """After ``obj`` was unpickled (or found in the weak cache) for a key held as frames or on
        disk: keep it in memory unless it is heavier than target, wake the waiters, then spill
        others if above target (failures logged, not raised). ``read`` (bytes, seconds) and
        ``deserialize_seconds`` are the metrics of how ``obj`` was obtained, digested here under the
        same lock; ``weight`` is ``sizeof(obj)`` if the caller knows it already; ``crc`` is the
        ``frames_crc`` of the frames ``obj`` was read from (the key then keeps its record as a
        copy)."""
        if weight is None:
            weight = codec.sizeof(obj)
        memory_changed = False
        old_log_key = b""  # the record to delete once the lock is released
        try:
            with self._lock:
                if load is not None:
                    e.loading = None  # first: whatever happens below, the key is not left loading
                if read is not None:
                    self._digest_io("disk-read", *read)
                if deserialize_seconds is not None:
                    self._digest("deserialize", deserialize_seconds, "seconds")
                # (without ``load``, ``obj`` came from the weak cache, whose reference is there
                # already)
                if self._entries.get(key) is e and e.tier is not _OBJECT:
                    if weight <= self.target:
                        if e.tier is _DISK:
                            self._spilled_memory -= e.weight
                            self._spilled_disk -= e.disk_bytes
                            if crc is None:  # nothing to tell a changed object by: no copy
                                old_log_key = e.log_key
                            self._lru[key] = None
                        else:
                            self._memory_weight -= e.weight
                            self._heavy.pop(key, None)
                            self._lru.move_to_end(key)
                            # Frames being written: that write will be thrown away (the tier
                            # changes), so their weight stops counting as leaving memory now (see
                            # _drop); the object's weight counts in full.
                            self._stop_evicting(e)
                        self._weak.pop(key, None)
                        e.tier = _OBJECT
                        e.value = obj
                        e.weight = weight
                        if old_log_key:
                            e.log_key = b""
                            e.disk_bytes = 0
                            e.crc = None
                        elif crc is not None:
                            e.crc = crc
                        # (Frames with a copy from the writer keep it: it holds those frames.)
                        self._memory_weight += weight
                        memory_changed = True
                    else:
                        if load is not None:
                            try:
                                self._weak[key] = obj
                            except TypeError:
                                pass
                        if e.tier is _FRAMES and not e.evicting:
                            # Served from disk from now on, as dask does. (A key being written
                            # already is on its way: marking it again would spill it twice.)
                            self._heavy[key] = None
                            memory_changed = True
        finally:
            if load is not None:
                load.set_result(obj)  # the waiters have their object whatever happened above
        self._delete_record(key, old_log_key)  # outside the lock (see _delete_record)
        if memory_changed:
            try:
                self._evict_until_below_target()
                self._relieve_process_memory(weight, exclude=key)
                self._wake_writer()
            except _SpillFailure as failure:
                self._log_failure(failure)

    def _drop(self, key: Hashable) -> bytes:
        """Under the lock: forget ``key`` if present. Returns the log key of its disk record (b""
        if none), for the caller to delete with :meth:`_delete_record` once the lock is
        released."""
        e = self._entries.pop(key, None)
        if e is None:
            return b""
        self._heavy.pop(key, None)
        log_key = e.log_key  # its value on disk, or a copy of it
        if e.tier is _DISK:
            self._spilled_memory -= e.weight
            self._spilled_disk -= e.disk_bytes
        else:
            del self._lru[key]
            self._memory_weight -= e.weight
            # Being written: its weight has left memory now, not when the write returns (which
            # then throws the record away). Still counted as leaving until then, it would make the
            # eviction rounds of the sets made meanwhile stop early, and no one would spill what
            # they did not.
            self._stop_evicting(e)
        self._weak.pop(key, None)
        self.logged_pickle_errors.discard(key)
        return log_key

    def _stop_evicting(self, e: _Entry) -> None:
        """Under the lock: ``e``'s weight no longer counts as leaving memory (idempotent)."""
        self._evicting_weight -= e.evicting_weight
        e.evicting_weight = 0

    def _delete_record(self, key: Hashable, log_key: bytes) -> None:
        """Delete a record from the log; b"" is none. Called without the lock: the log may punch
        holes and unlink segment files, which the other threads' gets and sets must not wait for.
        The bookkeeping was updated under the lock already, and log keys are never reused, so
        nothing can take the record for a live one meanwhile (a reader racing the delete finds it
        gone and starts over)."""
        if log_key:
            self._writer.delete(key, log_key)

    def _pickle(self, key: Hashable, value: object) -> list:
        t0 = perf_counter()
        try:
            frames = codec.dumps(value)
        except Exception as error:
            raise PickleError(key) from error
        self._digest_locked("serialize", perf_counter() - t0, "seconds")
        return frames

    def _read(self, key: Hashable, log_key: bytes) -> list:
        t0 = perf_counter()
        try:
            frames = self._log_of(log_key).get(log_key)
        except KeyError:
            raise self._record_gone(key, log_key) from None
        except Corrupt as error:
            raise _damaged(key, error) from error
        seconds = perf_counter() - t0
        nbytes = sum(map(len, frames))  # the log returns 1-D byte memoryviews: len is nbytes
        with self._lock:
            self._digest_io("disk-read", nbytes, seconds)
        return frames

    def _record_gone(self, key: Hashable, log_key: bytes) -> Exception:
        """The exception for a read of ``log_key`` that the log did not find. _RecordGone (start
        over) if the key has moved: another thread deleted, replaced or promoted it (the
        bookkeeping changes under the lock before the record is deleted). If the key still points
        to that record, the log lost it: starting over would read it again forever."""
        with self._lock:
            e = self._entries.get(key)
            lost = e is not None and e.tier is _DISK and e.log_key == log_key
        if lost:
            return SpillwayError(f"the spilled record of {key!r} is missing from the log")
        return _RecordGone()

    def _log_failure(self, failure: _SpillFailure) -> None:
        if failure.kind == "max_spill":
            logger.warning(MAX_SPILL_MESSAGE)
        elif failure.kind == "disk":
            logger.error(DISK_ERROR_MESSAGE, exc_info=failure.error)
        else:
            with self._lock:
                first = failure.key not in self.logged_pickle_errors
                self.logged_pickle_errors.add(failure.key)
            if first:
                logger.error(PICKLE_ERROR_MESSAGE, failure.key, exc_info=failure.error)

    def _digest(self, label: str, value: float, unit: str) -> None:
        """Under the lock: add to ``cumulative_metrics`` (and to distributed's context meter)."""
        self.cumulative_metrics[label, unit] += value
        if self._context_meter is not None:
            self._context_meter.digest_metric(label, value, unit)

    def _digest_io(self, label: str, nbytes: int, seconds: float) -> None:
        """Under the lock: one operation of ``nbytes`` that took ``seconds``."""
        m = self.cumulative_metrics
        m[label, "count"] += 1
        m[label, "bytes"] += nbytes
        m[label, "seconds"] += seconds
        if self._context_meter is not None:
            self._context_meter.digest_metric(label, 1, "count")
            self._context_meter.digest_metric(label, nbytes, "bytes")
            self._context_meter.digest_metric(label, seconds, "seconds")

    def _digest_locked(self, label: str, value: float, unit: str) -> None:
        with self._lock:
            self._digest(label, value, unit)

    def _peek(self, key: Hashable) -> object:
        """The object of ``key`` without changing its tier or the LRU order."""
        with self._lock:
            e = self._entries[key]
            tier, value, log_key = e.tier, e.value, e.log_key
            if tier is _DISK:
                value = self._weak.get(key)
        if tier is _OBJECT:
            return value
        if tier is _FRAMES:
            # The frames stay (and may be spilled later): an object built on their writeable memory
            # would let a caller's in-place change reach the stored value and its record.
            if codec.shares_writeable_memory(value):
                value = codec.private_copies(value)
            return codec.loads(value, self.writeable)
        if value is not None:  # still alive elsewhere
            return value
        try:
            frames = self._read(key, log_key)
        except _RecordGone:
            return self._peek(key)  # moved meanwhile: from where it is now
        return codec.loads(frames, False)  # the log's memoryviews are writeable


class _TierView(Mapping):
    """Read-only view of the keys of a SpillBuffer in memory (``in_memory=True``) or on disk."""

    def __init__(self, buffer: SpillBuffer, in_memory: bool):
        self._buffer = buffer
        self._in_memory = in_memory

    def __contains__(self, key: object) -> bool:
        e = self._buffer._entries.get(key)
        return e is not None and (e.tier is not _DISK) == self._in_memory

    def __getitem__(self, key: Hashable) -> object:
        if key not in self:
            raise KeyError(key)
        return self._buffer._peek(key)

    def __iter__(self) -> Iterator[Hashable]:
        b = self._buffer
        with b._lock:
            if self._in_memory:
                keys = list(b._lru)
            else:
                keys = [k for k, e in b._entries.items() if e.tier is _DISK]
        return iter(keys)

    def __len__(self) -> int:
        b = self._buffer
        with b._lock:
            return len(b._lru) if self._in_memory else len(b._entries) - len(b._lru)

    @property
    def total_weight(self) -> int:
        """Sum of the weights of the keys in this view (sizeof for objects, bytes for frames)."""
        b = self._buffer
        with b._lock:
            return b._memory_weight if self._in_memory else b._spilled_memory

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
