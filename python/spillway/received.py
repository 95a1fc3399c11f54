"""Values that cross between dask workers without being unpickled: what a peer sends a
:class:`~spillway.SpillBuffer` (:class:`PickledFrames` in memory, or a :class:`ReceivedRecord`
written straight onto its disk), and :class:`PeerValues`, the part of a buffer that receives,
grants and serves them for :mod:`spillway.dask`.

A received value stays pickled until a task reads it. Where it goes is the store's rule
(``Store.admit``, engine/src/store/receive.rs): into memory if it fits under the store's target and
process headroom, counting what is being received into memory meanwhile; else straight into the
store on disk (``fetch_into_store``: socket -> buffer -> file, the store's lock not held while the
bytes arrive), never held in memory.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
import weakref
from collections import defaultdict
from collections.abc import Hashable, Iterator, Mapping
from time import perf_counter

from spillway import codec
from spillway._core import Admission, Store, fetch, fetch_into_store
from spillway.keys import KeyMap
from spillway.messages import LOGGER

__all__ = ["PeerValues", "PickledFrames", "ReceivedRecord"]

logger = logging.getLogger(f"{LOGGER}.received")


class PickledFrames:
    """A value as pickle protocol 5 frames, ``[header, *out-of-band buffers]``: set into a
    :class:`SpillBuffer` (``buf[key] = PickledFrames(frames)``), it is stored as
    :meth:`SpillBuffer.set_serialized` stores frames, without unpickling them. This is how a value
    received from a peer reaches the store through dask's ``data[key] = value`` (see
    :mod:`spillway.dask`). ``sys.getsizeof`` (and so dask's ``sizeof``) is the frames' byte length."""

    __slots__ = ("__weakref__", "_admission", "frames")

    def __init__(self, frames: list, admission: Admission | None = None):
        self.frames = frames
        # The room the store gave it in memory (``Store.admit``), held until it is set or dropped.
        self._admission = admission

    def settled(self) -> None:
        """The frames are now the store's (set), or let go of: their admission is no longer
        counted."""
        if self._admission is not None:
            self._admission.release()

    def __sizeof__(self) -> int:
        return codec.frame_bytes(self.frames)

    def __repr__(self) -> str:
        return f"<PickledFrames: {len(self.frames)} frames, {codec.frame_bytes(self.frames)} bytes>"


class ReceivedRecord:
    """A value a peer sent straight onto a :class:`SpillBuffer`'s disk (:meth:`PeerValues.receive`):
    set into that buffer (``buf[key] = record``, as dask's ``data[key] = value`` does), it becomes
    the key's value on disk without being read. A record that is never set is deleted once this
    object is collected. ``sys.getsizeof`` (and so dask's ``sizeof``) is the value's frames' byte
    length."""

    __slots__ = ("__weakref__", "_orphan", "_peers", "_store", "key", "nbytes", "store_key")

    def __init__(self, peers: PeerValues, key: Hashable, store: Store, store_key: bytes, nbytes: int):
        self._peers = weakref.ref(peers)
        self._store = store
        self.key = key
        self.store_key = store_key
        self.nbytes = nbytes
        self._orphan = weakref.finalize(self, _drop_orphan, self._peers, store_key)

    def __sizeof__(self) -> int:
        return self.nbytes

    def read(self) -> list:
        """The value's frames, read from the store it was received into (for a buffer that is not
        that store's)."""
        if self._peers() is None:
            raise ValueError(f"{self!r} belongs to a buffer that is gone")
        return self._store.get_serialized(self.store_key)

    def __repr__(self) -> str:
        return f"<ReceivedRecord: {self.nbytes} bytes on disk>"


def _drop_orphan(peers_ref: weakref.ref, store_key: bytes) -> None:
    peers = peers_ref()
    if peers is not None:
        peers.drop(store_key)


#: (peer values, {key: value}) while :meth:`PeerValues.serving` is in effect in this context.
_SERVING: contextvars.ContextVar = contextvars.ContextVar("spillway_serving", default=None)

#: What :meth:`PeerValues.served` returns for a key it is not serving.
NOT_SERVED = object()


class PeerValues:
    """The values a buffer's peers send it or are sent from it, on the buffer's store and key map:
    ``receive`` (memory or disk, the store decides), ``adopt`` (a received record becomes a key's
    value), ``disk_record`` (what a transfer grant sends from), ``serving`` (values read for a peer,
    handed to dask without touching the store), and the counts of these transfers (``count``,
    ``metrics``: spillway's own, not dask's)."""

    def __init__(self, store: Store, keys: KeyMap):
        self._store = store
        self._keys = keys
        self._lock = threading.Lock()
        self._metrics: defaultdict = defaultdict(float)

    def count(self, label: str, value: float, unit: str) -> None:
        """Add ``value`` to the ``(label, unit)`` transfer metric."""
        with self._lock:
            self._metrics[label, unit] += value

    def metrics(self) -> dict:
        """``(label, unit) -> total`` of the transfers so far."""
        with self._lock:
            return dict(self._metrics)

    def _count_io(self, label: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._metrics[label, "count"] += 1
            self._metrics[label, "bytes"] += nbytes
            self._metrics[label, "seconds"] += seconds

    def disk_record(self, key: Hashable) -> tuple | None:
        """``(store, store key, pickled bytes)`` of ``key``'s value if it is on disk, else None
        (KeyError if absent): what :mod:`spillway.dask` grants a peer
        (``TransferServer.grant(store, store_key)`` pins the record as it is then)."""
        skey = self._keys[key]
        nbytes = self._store.spilled_bytes(skey)
        return None if nbytes is None else (self._store, skey, nbytes)

    def receive(
        self,
        key: Hashable,
        address: tuple,
        ticket: bytes,
        remote_key: bytes,
        nbytes: int,
        *,
        timeout: float = 30.0,
        connect_timeout: float | None = None,
    ) -> PickledFrames | ReceivedRecord:
        """Fetch ``key``'s value, ``nbytes`` of frames, from the spillway transfer server at
        ``address`` (``(host, port)``), which granted ``ticket`` for its record ``remote_key``. Where
        the store admits it into memory (``Store.admit``), the frames come into memory: a
        :class:`PickledFrames`. Otherwise they are written straight onto the store's disk, never
        held in memory: a :class:`ReceivedRecord`. Either way the value stays pickled until a task
        reads it; set it with ``buf[key] = value``. Raises KeyError if the server no longer has it,
        OSError or SpillwayError if the transfer fails or the value is not ``nbytes`` (nothing is
        kept). ``timeout`` bounds each network call, ``connect_timeout`` connecting and the
        server's greeting (default: ``timeout``)."""
        admission = self._store.admit(nbytes)
        t0 = perf_counter()
        if admission is not None:
            try:
                frames = fetch(
                    address, ticket, remote_key, nbytes, timeout=timeout, connect_timeout=connect_timeout
                )
            except BaseException:
                admission.release()
                raise
            if frames is None:
                admission.release()
                raise KeyError(key)
            self._count_io("receive-memory", codec.frame_bytes(frames), perf_counter() - t0)
            return PickledFrames(frames, admission)
        # (A key the buffer has already keeps its value until the new one is set: the record goes
        # under a store key of its own, which ``buf[key] = record`` then makes the key's.)
        skey = self._keys.reserve(key)
        try:
            # The store does not hold its lock while the bytes arrive (a large value goes into a
            # segment of its own): spills go on meanwhile.
            n = fetch_into_store(
                self._store,
                address,
                ticket,
                remote_key,
                skey,
                nbytes,
                timeout=timeout,
                connect_timeout=connect_timeout,
            )
        except BaseException:
            self.drop(skey)
            raise
        if n is None:
            self.drop(skey)
            raise KeyError(key)
        self._count_io("receive-disk", n, perf_counter() - t0)
        return ReceivedRecord(self, key, self._store, skey, n)

    def adopt(self, key: Hashable, record: ReceivedRecord) -> bool:
        """Under ``key``'s stripe: ``record``, received by this buffer and not set before, becomes
        ``key``'s value on disk (its old value, if any, is removed). False if the record is not
        this buffer's to adopt (another buffer's, or set before): nothing changes."""
        if record._peers() is not self or not record._orphan.alive:
            return False
        adopted, old = self._keys.adopt(key, record.store_key)
        if not adopted:
            return False
        record._orphan.detach()
        if old is not None:
            try:
                self._store.remove(old)
            except ValueError:  # (closed)
                pass
            except Exception:  # the new value stands; the old record is the store's to reclaim
                logger.exception("spillway: the record %r replaced could not be removed", key)
            finally:
                self._keys.retired(old)
        return True

    def drop(self, store_key: bytes) -> None:
        """A received record that was never set (or failed): delete it. Its store key is handed
        out again only once its entry is gone (:class:`~spillway.keys.KeyMap`)."""
        if self._keys.drop(store_key):
            try:
                with contextlib.suppress(ValueError):  # (closed)
                    self._store.remove(store_key)
            finally:
                self._keys.retired(store_key)

    @contextlib.contextmanager
    def serving(self, values: Mapping) -> Iterator[None]:
        """While in effect (in this thread, or this asyncio task and what it awaits), the buffer's
        ``buf[key]`` returns ``values[key]`` for the keys ``values`` has, without touching their
        tiers, the LRU or the metrics. :mod:`spillway.dask` uses it to hand dask's ``get_data`` the
        frames of values it reads for a peer, so that they are neither unpickled nor brought back
        into memory."""
        token = _SERVING.set((self, values))
        try:
            yield
        finally:
            _SERVING.reset(token)

    def served(self, key: Hashable) -> object:
        """The value :meth:`serving` hands out for ``key`` in this context, else ``NOT_SERVED``."""
        serving = _SERVING.get()
        if serving is not None and serving[0] is self:
            return serving[1].get(key, NOT_SERVED)
        return NOT_SERVED
