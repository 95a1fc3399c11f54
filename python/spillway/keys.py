"""Dask keys as bytes: :func:`encode_key`, the store key of a ``SpillBuffer``'s key."""

from __future__ import annotations

import hashlib
import math
import numbers
from collections.abc import Hashable

__all__ = ["MAX_ENCODED_KEY_BYTES", "encode_key"]

#: Encoded keys longer than this are shortened to a prefix and a digest (store keys are bounded).
MAX_ENCODED_KEY_BYTES = 512

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
