"""Values that cross between dask workers without being unpickled: what a peer sends a
:class:`~spillway.SpillBuffer` (:class:`PickledFrames` in memory, or a :class:`ReceivedRecord`
written straight onto its disk), and the buffer's side of :mod:`spillway.dask`'s transfers
(:class:`PeerValues`: ``receive``, ``disk_record``, ``serving``).

A received value stays pickled until a task reads it. ``receive`` decides where it goes: into memory
if it fits under the buffer's ``target`` and its process target (counting what is being received
into memory meanwhile), else straight into the buffer's store on disk (``fetch_into_store``: socket ->
buffer -> file, the store's lock not held while the bytes arrive), never held in memory.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Hashable, Iterator, Mapping
from time import perf_counter
from typing import TYPE_CHECKING

from spillway import codec
from spillway._core import Store, fetch, fetch_into_store

if TYPE_CHECKING:
    from spillway.buffer import SpillBuffer

__all__ = ["PeerValues", "PickledFrames", "ReceivedRecord"]


class PickledFrames:
    """A value as pickle protocol 5 frames, ``[header, *out-of-band buffers]``: set into a
    :class:`SpillBuffer` (``buf[key] = PickledFrames(frames)``), it is stored as
    :meth:`SpillBuffer.set_serialized` stores frames, without unpickling them. This is how a value
    received from a peer reaches the store through dask's ``data[key] = value`` (see
    :mod:`spillway.dask`). ``sys.getsizeof`` (and so dask's ``sizeof``) is the frames' byte length."""

    __slots__ = ("__weakref__", "frames")

    def __init__(self, frames: list):
        self.frames = frames

    def __sizeof__(self) -> int:
        return codec.frame_bytes(self.frames)

    def __repr__(self) -> str:
        return f"<PickledFrames: {len(self.frames)} frames, {codec.frame_bytes(self.frames)} bytes>"


class ReceivedRecord:
    """A value a peer sent straight onto a :class:`SpillBuffer`'s disk (:meth:`SpillBuffer.receive`):
    set into that buffer (``buf[key] = record``, as dask's ``data[key] = value`` does), it becomes
    the key's value on disk without being read. A record that is never set is deleted once this
    object is collected. ``sys.getsizeof`` (and so dask's ``sizeof``) is the value's frames' byte
    length."""

    __slots__ = ("__weakref__", "_buffer", "_orphan", "_store", "key", "nbytes", "store_key")

    def __init__(
        self, buffer: SpillBuffer, key: Hashable, store: Store, store_key: bytes, nbytes: int
    ):
        self._buffer = weakref.ref(buffer)
        self._store = store
        self.key = key
        self.store_key = store_key
        self.nbytes = nbytes
        self._orphan = weakref.finalize(self, _drop_orphan, self._buffer, store_key)

    def __sizeof__(self) -> int:
        return self.nbytes

    def __repr__(self) -> str:
        return f"<ReceivedRecord: {self.nbytes} bytes on disk>"


def _drop_orphan(buffer_ref, store_key: bytes) -> None:
    buffer = buffer_ref()
    if buffer is not None:
        buffer._drop_pending(store_key)


#: (buffer, {key: value}) while :meth:`SpillBuffer.serving` is in effect in this context.
_SERVING: contextvars.ContextVar = contextvars.ContextVar("spillway_serving", default=None)


class PeerValues:
    """:class:`~spillway.SpillBuffer`'s methods for values a peer sends or is sent. A mixin of the
    buffer: it works on the buffer's key maps (``_keys``, ``_owners``), its store and its lock, plus its own ``_pending`` (store keys of received records not yet set, by key) and
    ``_incoming`` (bytes received into memory and not yet let go of)."""

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
        ``address`` (``(host, port)``), which granted ``ticket`` for its record ``remote_key``. If it
        fits under ``target`` and ``process_target`` (counting what is being received into memory
        meanwhile), the frames come into memory: a :class:`PickledFrames`. Otherwise they are written
        straight onto this buffer's disk, never held in memory: a :class:`ReceivedRecord`. Either way
        the value stays pickled until a task reads it; set it with ``buf[key] = value``. Raises
        KeyError if the server no longer has it, OSError or SpillwayError if the transfer fails or
        the value is not ``nbytes`` (nothing is kept). ``timeout`` bounds each network call,
        ``connect_timeout`` connecting and the server's greeting (default: ``timeout``)."""
        self._find_worker()
        headroom = self._store.process_headroom()
        with self._lock:
            memory = self.fast.total_weight
            to_disk = memory + self._incoming + nbytes > self.target or (
                headroom is not None and self._incoming + nbytes > headroom
            )
            # (A key the buffer has already keeps its value until the new one is set: the record
            # goes under a store key of its own, which ``buf[key] = record`` then makes the key's.)
            if to_disk:
                skey = self._free_store_key(key)
                self._pending[skey] = key
                store = self._store
            else:
                self._incoming += nbytes
        t0 = perf_counter()
        if not to_disk:
            try:
                frames = fetch(
                    address, ticket, remote_key, nbytes, timeout=timeout, connect_timeout=connect_timeout
                )
                if frames is None:
                    raise KeyError(key)
                value = PickledFrames(frames)
            except BaseException:
                self._arrived(nbytes)
                raise
            # Counted as coming until the caller is done with it (it was set, or dropped).
            weakref.finalize(value, self._arrived, nbytes)
            self._digest_io("receive-memory", codec.frame_bytes(frames), perf_counter() - t0)
            self._settle()
            return value
        try:
            # The store does not hold its lock while the bytes arrive (a large value goes into a
            # segment of its own): spills go on meanwhile.
            n = fetch_into_store(
                store,
                address,
                ticket,
                remote_key,
                skey,
                nbytes,
                timeout=timeout,
                connect_timeout=connect_timeout,
            )
        except BaseException:
            self._drop_pending(skey)
            raise
        if n is None:
            self._drop_pending(skey)
            raise KeyError(key)
        self._digest_io("receive-disk", n, perf_counter() - t0)
        self._settle()  # its writing to disk, to dask's metrics (the activity that asked)
        return ReceivedRecord(self, key, store, skey, n)

    def _arrived(self, nbytes: int) -> None:
        with self._lock:
            self._incoming -= nbytes

    def _adopt(self, key: Hashable, record: ReceivedRecord) -> None:
        """``buf[key] = record``: the record becomes ``key``'s value on disk."""
        with self._stripe(key):
            with self._lock:
                mine = (
                    record._buffer() is self
                    and record._orphan.alive
                    and self._pending.get(record.store_key) is not None
                )
                if mine:
                    record._orphan.detach()
                    del self._pending[record.store_key]
                    old = self._keys.get(key)
                    self._keys[key] = record.store_key
                    if old is not None:
                        del self._owners[old]
                    self._owners[record.store_key] = key
            if mine:
                if old is not None and old != record.store_key:
                    self._store.remove(old)
                return
        # Another buffer's record, or one set before: read it (``get_serialized`` semantics).
        owner = record._buffer()
        if owner is None:
            raise ValueError(f"{record!r} belongs to a buffer that is gone")
        self.set_serialized(key, record._store.get_serialized(record.store_key))

    def _drop_pending(self, store_key: bytes) -> None:
        """A received record that was never set (or failed): delete it."""
        with self._lock:
            if self._pending.pop(store_key, None) is None:
                return
        with contextlib.suppress(ValueError):  # (closed)
            self._store.remove(store_key)

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
