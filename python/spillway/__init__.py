"""spillway: a storage engine for dask workers.

``SpillBuffer`` is a drop-in replacement for ``distributed.spill.SpillBuffer`` built on ``Log``, the
engine's append-only segment log (the Rust extension ``spillway._core``).
"""

from spillway._core import Corrupt, DiskFull, Log, ReadOnly, SpillwayError, TransferServer
from spillway.buffer import (
    PickledFrames,
    PickleError,
    ReceivedRecord,
    SpillBuffer,
    SpilledSize,
    encode_key,
)
from spillway.worker import worker_data

__version__ = "0.1.0"

__all__ = [
    "Corrupt",
    "DiskFull",
    "Log",
    "PickleError",
    "PickledFrames",
    "ReadOnly",
    "ReceivedRecord",
    "SpillBuffer",
    "SpilledSize",
    "SpillwayError",
    "TransferServer",
    "__version__",
    "encode_key",
    "worker_data",
]
