"""Dask keys as the store's byte keys: :func:`encode_key`, and :class:`KeyMap`, which store key
holds each key of a ``SpillBuffer``."""

from __future__ import annotations

import contextlib
import hashlib
import math
import numbers
import threading
from collections.abc import Hashable, Iterator

__all__ = ["MAX_ENCODED_KEY_BYTES", "KeyMap", "encode_key"]

#: Encoded keys longer than this are shortened to a prefix and a digest (store keys are bounded).
MAX_ENCODED_KEY_BYTES = 512

#: Locks that order the sets and deletes of one key (a key's is chosen by its hash).
_STRIPES = 64


class KeyMap:
    """Which store key holds each dask key's value (a key and its store key are each other's: one
    ``encode_key`` of it, with a ``#n`` suffix where two keys encode alike), and the store keys
    reserved for values a peer sends straight to disk that are not yet set (:mod:`spillway.received`).
    ``lock`` orders its changes; :meth:`stripe` orders the sets and deletes of one key.

    The protocol with the store (docs/architecture.md, "Store keys"): a store key is in exactly one
    of four states, free, owned (a key's value), reserved (a value being received, or received and
    not yet set) or retiring (no longer anyone's, its store entry not yet removed). Only a free
    store key is handed out (:meth:`place`, :meth:`reserve`); a store key leaves a key or a
    reservation only through retiring (:meth:`removing`, :meth:`adopt`, :meth:`drop`), and becomes
    free only once the store has removed its entry. So a late removal never deletes a newer value
    that got the same store key."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._stripes = [threading.RLock() for _ in range(_STRIPES)]
        self._keys: dict[Hashable, bytes] = {}  # key -> its store key
        self._owners: dict[bytes, Hashable] = {}  # store key -> key
        self._reserved: dict[bytes, Hashable] = {}  # store key -> key it was received for
        self._retiring: set[bytes] = set()  # store keys whose entries are being removed

    def stripe(self, key: Hashable) -> threading.RLock:
        """The lock that orders the sets and deletes of ``key``."""
        return self._stripes[hash(key) % _STRIPES]

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __iter__(self) -> Iterator[Hashable]:
        return iter(list(self._keys))

    def __getitem__(self, key: Hashable) -> bytes:
        """The store key of ``key`` (KeyError if it has none)."""
        return self._keys[key]

    def get(self, key: Hashable) -> bytes | None:
        return self._keys.get(key)

    def owner(self, skey: bytes, default: object = None) -> object:
        """The key whose value ``skey`` holds, or ``default``."""
        return self._owners.get(skey, default)

    def place(self, key: Hashable) -> bytes:
        """Under the key's stripe: the store key a new value of ``key`` goes to."""
        with self.lock:
            skey = self._keys.get(key)
            if skey is None:
                skey = self._free(key)
                self._keys[key] = skey
                self._owners[skey] = key
        return skey

    def forget(self, key: Hashable, skey: bytes) -> None:
        """``key`` has no value any more if ``skey`` still holds it (the store has no entry for it:
        the store key is free at once)."""
        with self.lock:
            if self._keys.get(key) == skey:
                del self._keys[key]
                del self._owners[skey]

    @contextlib.contextmanager
    def removing(self, key: Hashable) -> Iterator[bytes]:
        """Under the key's stripe: forget ``key`` (KeyError if absent), giving its store key to the
        block, which removes its entry from the store; the store key is free after the block."""
        with self.lock:
            skey = self._keys.pop(key)
            del self._owners[skey]
            self._retiring.add(skey)
        try:
            yield skey
        finally:
            self.retired(skey)

    def reserve(self, key: Hashable) -> bytes:
        """A store key of its own for a value of ``key`` received while ``key`` may keep its old
        value; :meth:`adopt` makes it ``key``'s, :meth:`drop` gives it up."""
        with self.lock:
            skey = self._free(key)
            self._reserved[skey] = key
        return skey

    def drop(self, skey: bytes) -> bool:
        """Give up a reserved store key; whether it was reserved (and not adopted). If so, it is
        retiring: the caller removes its entry from the store, then calls :meth:`retired`."""
        with self.lock:
            if self._reserved.pop(skey, None) is None:
                return False
            self._retiring.add(skey)
            return True

    def adopt(self, key: Hashable, skey: bytes) -> tuple[bool, bytes | None]:
        """Under the key's stripe: the reserved ``skey`` becomes ``key``'s store key. Returns
        whether it was reserved (else nothing changes) and the store key it replaces, if any: that
        one is retiring (the caller removes its entry, then calls :meth:`retired`)."""
        with self.lock:
            if self._reserved.pop(skey, None) is None:
                return False, None
            old = self._keys.get(key)
            self._keys[key] = skey
            if old is not None:
                del self._owners[old]
                self._retiring.add(old)
            self._owners[skey] = key
        return True, old

    def retired(self, skey: bytes) -> None:
        """The store no longer has an entry under the retiring ``skey``: it is free."""
        with self.lock:
            self._retiring.discard(skey)

    @property
    def reserved(self) -> frozenset:
        """The store keys reserved and not yet adopted or dropped."""
        with self.lock:
            return frozenset(self._reserved)

    def _free(self, key: Hashable) -> bytes:
        """Under the lock: a free store key for ``key`` (no key's, not reserved, not retiring)."""
        base = encode_key(key)
        skey, n = base, 0
        while skey in self._owners or skey in self._reserved or skey in self._retiring:
            n += 1
            skey = base + b"#%d" % n
        return skey


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
