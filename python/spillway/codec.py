"""How values become frames and back: pickle protocol 5 with out-of-band buffers, and dask's weight.

* :func:`dumps`: ``[header, *out-of-band buffers]``, each buffer a 1-D byte view of the object's own
  memory (no copy). ``cloudpickle`` is the fallback when plain pickle fails and cloudpickle is
  installed, as in dask.
* A top-level numpy array (exactly ``numpy.ndarray``, contiguous, of a plain dtype) is pickled as a
  call to :func:`_array_from_buffer` with its buffer out of band: the same out-of-band buffer as
  numpy's own reducer gives, in half the time (which matters for small values). That header depends
  only on the dtype, shape and memory order, so it is pickled once per kind and reused (up to
  ``_ARRAY_HEADERS_MAX`` kinds); :func:`loads` of frames whose header is a known one builds the array
  directly instead of running the unpickler. Unpickling such frames elsewhere needs spillway to be
  importable (:func:`spillway_only` tells).
* :func:`loads`: ``pickle.loads(frames[0], buffers=frames[1:])``, so an array read back is built on
  the buffer it was given; with ``writeable``, read-only buffers are copied once first.
* :func:`sizeof`: ``dask.sizeof.sizeof`` (``sys.getsizeof`` without dask), ``SIZEOF_FALLBACK_BYTES``
  when it raises, as ``distributed.sizeof.safe_sizeof``.
"""

from __future__ import annotations

import logging
import pickle
import sys

try:
    from dask.sizeof import sizeof as _dask_sizeof
except ImportError:  # pragma: no cover - dask is optional
    _dask_sizeof = None

try:
    import cloudpickle as _cloudpickle
except ImportError:  # pragma: no cover - cloudpickle is optional
    _cloudpickle = None

__all__ = [
    "SIZEOF_FALLBACK_BYTES",
    "byte_frame",
    "dumps",
    "frame_bytes",
    "loads",
    "private_copies",
    "shares_writeable_memory",
    "sizeof",
    "spillway_only",
]

logger = logging.getLogger("spillway")

#: Weight of a value whose ``sizeof`` raised (as ``distributed.sizeof.safe_sizeof``).
SIZEOF_FALLBACK_BYTES = 1_000_000


def sizeof(value: object) -> int:
    if _dask_sizeof is None:
        return sys.getsizeof(value)
    try:
        return int(_dask_sizeof(value))
    except Exception:
        logger.warning(
            "Sizeof calculation for object of type %r failed; defaulting to %d bytes",
            type(value).__qualname__,
            SIZEOF_FALLBACK_BYTES,
            exc_info=True,
        )
        return SIZEOF_FALLBACK_BYTES


def dumps(value: object) -> list:
    """``[header, *out-of-band buffers]``; each buffer a 1-D, C-contiguous byte view."""
    if _is_plain_array(value):
        return _dumps_array(value)
    buffers: list = []
    try:
        header = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    except Exception:
        if _cloudpickle is None:
            raise
        buffers = []
        header = _cloudpickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    return [header, *(b.raw() for b in buffers)]


#: Most array headers remembered (distinct dtype, shape and order); the caches restart when full.
_ARRAY_HEADERS_MAX = 1024
#: (dtype.str, shape, order) -> the pickle header of a plain array of that kind (its buffer is out of
#: band, so the header depends on nothing else), and the reverse map (to (dtype, shape, order)).
_array_headers: dict = {}
_array_specs: dict = {}


def _dumps_array(a: object) -> list:
    """``dumps`` of a plain numpy array. A worker spills many chunks of the same dtype and shape, so
    the header is pickled once per kind and reused: the same bytes as pickling every time, in a
    fraction of the time. Its reverse lookup lets :func:`loads` skip the unpickler."""
    order = "C" if a.flags.c_contiguous else "F"
    spec = (a.dtype.str, a.shape, order)
    header = _array_headers.get(spec)
    if header is None:
        buffers: list = []
        header = pickle.dumps(_PlainArray(a), protocol=5, buffer_callback=buffers.append)
        if len(_array_headers) >= _ARRAY_HEADERS_MAX:
            _array_headers.clear()
            _array_specs.clear()
        _array_headers[spec] = header
        _array_specs[header] = (a.dtype, a.shape, order)
    return [header, _array_buffer(a, order).raw()]


def _array_buffer(a: object, order: str) -> pickle.PickleBuffer:
    """The memory of a contiguous array, without a copy."""
    if a.dtype.kind in "mM":  # the buffer protocol refuses datetimes: export their bytes instead
        a = a.reshape(-1, order=order).view("u1")
    return pickle.PickleBuffer(a)


def _is_plain_array(value: object) -> bool:
    """A contiguous numpy.ndarray (not a subclass) of a dtype that its ``.str`` describes fully."""
    np = sys.modules.get("numpy")
    return (
        np is not None
        and type(value) is np.ndarray
        and value.dtype.kind in "biufcmMSU"
        and (value.flags.c_contiguous or value.flags.f_contiguous)
    )


def _array_from_buffer(buffer: object, dtype: str, shape: tuple, order: str) -> object:
    import numpy

    return numpy.frombuffer(buffer, dtype=dtype).reshape(shape, order=order)


class _PlainArray:
    """Pickles a plain numpy array as ``_array_from_buffer(<out-of-band buffer>, dtype, shape,
    order)``: the same out-of-band buffer as numpy's own reducer gives, in half the time, which
    matters for small values."""

    __slots__ = ("array",)

    def __init__(self, array: object):
        self.array = array

    def __reduce__(self) -> tuple:
        a = self.array
        order = "C" if a.flags.c_contiguous else "F"
        return _array_from_buffer, (_array_buffer(a, order), a.dtype.str, a.shape, order)


def loads(frames: list, writeable: bool) -> object:
    if len(frames) == 2 and len(frames[0]) < 256:
        spec = _array_specs.get(bytes(frames[0]))
        if spec is not None:  # a header _dumps_array made: what unpickling it would do, directly
            buffer = frames[1]
            if writeable and memoryview(buffer).readonly:
                buffer = bytearray(buffer)
            return _array_from_spec(buffer, spec)
    buffers = frames[1:]
    if writeable:
        buffers = [bytearray(b) if memoryview(b).readonly else b for b in buffers]
    return pickle.loads(frames[0], buffers=buffers)


def spillway_only(frames: list) -> bool:
    """Whether unpickling ``frames`` needs spillway (a header of the numpy fast path, see
    ``_dumps_array``): such a header is small and names ``_array_from_buffer``."""
    header = frames[0] if frames else b""
    return len(header) < 256 and (
        bytes(header) in _array_specs or b"_array_from_buffer" in bytes(header)
    )


def shares_writeable_memory(frames: list) -> bool:
    """Whether ``loads(frames, ...)`` may build an object on (and so able to mutate) the memory of
    ``frames``: it uses writeable out-of-band buffers as they are."""
    return any(not memoryview(b).readonly for b in frames[1:])


def private_copies(frames: list) -> list:
    """``frames`` with every writeable out-of-band buffer copied: what ``loads`` builds on them
    shares no memory that can be mutated with ``frames``."""
    return [frames[0], *(b if memoryview(b).readonly else bytearray(b) for b in frames[1:])]


def _array_from_spec(buffer: object, spec: tuple) -> object:
    dtype, shape, order = spec
    a = sys.modules["numpy"].frombuffer(buffer, dtype=dtype)
    return a if len(shape) == 1 else a.reshape(shape, order=order)


def byte_frame(frame: object) -> object:
    """``frame`` as a buffer of bytes the log accepts: bytes and bytearray as they are, any other
    contiguous buffer (numpy array, memoryview of any format) as a 1-D byte view of it, no copy."""
    if isinstance(frame, (bytes, bytearray)):
        return frame
    view = memoryview(frame)  # TypeError if not a buffer
    if view.format == "B" and view.ndim == 1 and view.c_contiguous:
        return frame
    if not view.contiguous:
        raise ValueError("frames must be contiguous buffers")
    return pickle.PickleBuffer(view).raw()


def frame_bytes(frames: list) -> int:
    return sum(memoryview(f).nbytes for f in frames)
