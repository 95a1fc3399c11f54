"""spillway: a storage engine for dask workers.

``SpillBuffer`` is a drop-in replacement for ``distributed.spill.SpillBuffer`` built on the engine's
store (``spillway._core.Store``, in Rust: its tiers, eviction and once-only deserialization) and its
append-only segment log.
"""

from spillway._core import Corrupt, DiskFull, Log, ReadOnly, SpillwayError, TransferServer
from spillway.buffer import PickleError, SpillBuffer, SpilledSize, encode_key
from spillway.received import PickledFrames, ReceivedRecord
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
