"""How values become frames and back: pickle protocol 5 with out-of-band buffers, and dask's weight.

* :func:`dumps`: ``[header, *out-of-band buffers]``, each buffer a 1-D byte view of the object's own
  memory (no copy). ``cloudpickle`` is the fallback when plain pickle fails and cloudpickle is
  installed, as in dask. A value that fails both fails as it fails in dask's store: once distributed
  is loaded, dask's own ``serialize`` is tried on it (so its own fallbacks and its own log line run)
  and its ``TypeError("Could not serialize object of type ...")``, chained to the pickling error, is
  raised.
* **dask's serialization families.** Inside a dask process (``distributed.protocol.serialize``
  loaded), a value of a type registered with ``dask_serialize`` (scipy sparse matrices, h5py and
  netCDF4 objects, torch tensors, masked arrays, types a user registered...), or a list, tuple, set
  or dict whose first item is one, is serialized by dask's ``serialize`` as dask's store spills it:
  its frames go out of band, under a pickle header that calls :func:`_from_dask` (dask's
  ``deserialize``). numpy arrays and bytes, for which dask's family and pickle give the same
  object back, stay on the paths below.
* A top-level numpy array (exactly ``numpy.ndarray``, writeable, contiguous, of a plain dtype) is
  pickled as a
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
    "stock_frames",
]

logger = logging.getLogger("distributed.spillway")

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
    if _dask_family(value):
        return _dumps_dask(value)
    buffers: list = []
    try:
        header = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    except Exception as error:
        buffers = []
        try:
            if _cloudpickle is None:
                raise
            header = _cloudpickle.dumps(value, protocol=5, buffer_callback=buffers.append)
        except Exception:
            return _dumps_dask(value, error)
    return [header, *(b.raw() for b in buffers)]


#: Types whose dask serialization family gives back the same object as pickle does: they keep
#: spillway's own paths.
_PICKLE_EQUIVALENT = frozenset({bytes, bytearray, memoryview})


def _dask_family(value: object) -> bool:
    """Whether dask's store would spill ``value`` with a ``dask_serialize`` family other than
    pickle (as ``distributed.protocol.serialize.check_dask_serializable`` decides: a registered
    type, or a list, tuple, set or dict whose first item is one). Only inside a dask process."""
    ser = sys.modules.get("distributed.protocol.serialize")
    if ser is None:
        return False
    item = value
    t = type(value)
    if t in (list, tuple, set) and value:
        item = next(iter(value))
    elif t is dict and value:
        item = next(iter(value.values()))
    t = type(item)
    if t in _PICKLE_EQUIVALENT or t is getattr(sys.modules.get("numpy"), "ndarray", None):
        return False
    try:
        ser.dask_serialize.dispatch(t)
    except TypeError:
        return False
    return True


def _dumps_dask(value: object, error: BaseException | None = None) -> list:
    """``value`` serialized by dask's ``serialize`` (``("dask", "pickle")``, raising as dask's store
    raises), as frames: a pickle header calling :func:`_from_dask` with dask's header, and dask's
    frames out of band. Without distributed, re-raises ``error`` as dask would."""
    ser = sys.modules.get("distributed.protocol.serialize")
    if ser is None:
        name = type(value).__name__
        try:
            text = str(value)[:10000]
        except Exception:
            raise TypeError(f"Could not serialize object of type {name}") from error
        raise TypeError(f"Could not serialize object of type {name}", text) from error
    header, frames = ser.serialize(value, serializers=("dask", "pickle"), on_error="raise")
    buffers: list = []
    head = pickle.dumps(_DaskFrames(header, frames), protocol=5, buffer_callback=buffers.append)
    return [head, *(b.raw() for b in buffers)]


class _DaskFrames:
    """Pickles as ``_from_dask(header, *frames)`` with dask's frames out of band."""

    __slots__ = ("frames", "header")

    def __init__(self, header: dict, frames: list):
        self.header = header
        self.frames = frames

    def __reduce__(self) -> tuple:
        return _from_dask, (self.header, *(pickle.PickleBuffer(f) for f in self.frames))


def _from_dask(header: dict, *frames: object) -> object:
    """What dask's ``deserialize`` makes of a value ``_dumps_dask`` serialized."""
    from distributed.protocol.serialize import deserialize

    return deserialize(header, list(frames))


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
        and value.flags.writeable
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
    """Whether unpickling ``frames`` needs spillway: a header of the numpy fast path (see
    ``_dumps_array``) or of dask's families (``_dumps_dask``), which name this module."""
    # Both name this module in the pickle's first global, within its first bytes.
    start = bytes(memoryview(frames[0])[:128]) if frames else b""
    return b"spillway.codec" in start


def stock_frames(frames: list) -> list | None:
    """Frames of the numpy fast path (see ``_dumps_array``) as numpy's own pickle of the array, on
    the same buffer: what an unpickler without spillway reads (dask's ``pickle_loads``), giving a
    writeable array as numpy's pickle of a writeable array does. None where numpy's own pickle
    would carry the bytes in band (datetimes) or the frames are not the fast path's."""
    spec = _array_specs.get(bytes(frames[0])) if len(frames) == 2 else None
    if spec is None:
        try:  # a header made by another process (received from a peer): read it
            a = loads(frames, False)
        except Exception:
            return None
        np = sys.modules.get("numpy")
        if np is None or type(a) is not np.ndarray or len(frames) != 2:
            return None
        spec = (a.dtype, a.shape, "C" if a.flags.c_contiguous else "F")
    dtype, shape, order = spec
    if dtype.kind in "mM":
        return None
    header = _stock_headers.get(spec)
    if header is None:
        header = pickle.dumps(_StockArray(dtype, shape, order), protocol=5, buffer_callback=lambda b: False)
        if len(_stock_headers) >= _ARRAY_HEADERS_MAX:
            _stock_headers.clear()
        _stock_headers[spec] = header
    return [header, frames[1]]


#: (dtype, shape, order) -> numpy's own pickle header of a writeable array of that kind.
_stock_headers: dict = {}


class _StockArray:
    """Pickles as numpy pickles a writeable contiguous array of ``dtype``, ``shape`` and ``order``,
    with its buffer out of band (a stand-in buffer: the header says only that a writeable buffer
    comes next)."""

    __slots__ = ("dtype", "order", "shape")

    def __init__(self, dtype: object, shape: tuple, order: str):
        self.dtype, self.shape, self.order = dtype, shape, order

    def __reduce__(self) -> tuple:
        import numpy

        rebuild = numpy.empty(1, dtype="u1").__reduce_ex__(5)[0]  # numpy's own (_frombuffer)
        return rebuild, (pickle.PickleBuffer(bytearray(1)), self.dtype, self.shape, self.order)


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
