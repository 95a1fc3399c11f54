"""What spillway says in dask's words: where the Python package logs, dask's spill messages with
dask's rate limits, and the metrics dask's store reports (``DASK_METRICS``).

* The messages of the spill buffer that dask's own store logs ("Spill file on disk reached
  capacity; keeping data in memory", "Spill to disk failed; keeping data in memory", "Failed to
  pickle %r") go to dask's logger for them, ``distributed.spill``, so that dask's logging config,
  ``Client.get_worker_logs()`` and tools that watch that logger see them as they see dask's.
* Everything else spillway says (the engine, the buffer, the plugin) goes to loggers under
  ``distributed.spillway``: inside distributed's hierarchy, so dask's ``logging:`` config and the
  worker's log handlers cover it.
* The first two messages are let through at most once every 10 s each, by distributed's own
  ``RateLimiterFilter`` on ``distributed.spill`` (so ``RateLimiterFilter.reset_timer
  ("distributed.spill")``, which dask's tests use, resets them); where distributed is not loaded, by
  an equivalent filter of spillway's, replaced by dask's once distributed is loaded.
"""

from __future__ import annotations

import logging
import math
import re
import sys
from time import monotonic

__all__ = [
    "DASK_METRICS",
    "DISK_ERROR_MESSAGE",
    "LOGGER",
    "MAX_SPILL_MESSAGE",
    "PICKLE_ERROR_MESSAGE",
    "SPILL_LOGGER",
    "reset_log_rate_limits",
]

#: dask's spill buffer's logger: the messages dask's store logs go there.
SPILL_LOGGER = "distributed.spill"
#: The root of the loggers of everything else spillway says.
LOGGER = "distributed.spillway"

spill_logger = logging.getLogger(SPILL_LOGGER)

MAX_SPILL_MESSAGE = "Spill file on disk reached capacity; keeping data in memory"
DISK_ERROR_MESSAGE = "Spill to disk failed; keeping data in memory"
PICKLE_ERROR_MESSAGE = "Failed to pickle %r"

#: The messages rate-limited as dask rate-limits them: the patterns of dask's filters.
_RATE_LIMITED = ("Spill file on disk reached capacity", "Spill to disk failed")


class _RateLimit(logging.Filter):
    """Where distributed is not loaded: let a record whose message starts with ``prefix`` through at
    most once every ``seconds``, as distributed's ``RateLimiterFilter`` does."""

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


def _dask_limiter() -> type | None:
    return getattr(sys.modules.get("distributed.utils"), "RateLimiterFilter", None)


def _install_rate_limits() -> None:
    """Make sure ``distributed.spill`` rate-limits the two messages: nothing to do where dask's
    filters are on it already (``distributed.spill`` was imported); else distributed's
    ``RateLimiterFilter`` once ``distributed.utils`` is loaded, or spillway's own filter before.
    Run whenever a buffer is made (in a dask worker, distributed is loaded by then), so that
    spillway itself never imports distributed."""
    limiter = _dask_limiter()
    ours = [f for f in spill_logger.filters if isinstance(f, _RateLimit)]
    if limiter is not None:
        for f in ours:
            spill_logger.removeFilter(f)
        patterns = {f.pattern.pattern for f in spill_logger.filters if isinstance(f, limiter)}
        for prefix in _RATE_LIMITED:
            if prefix not in patterns and re.escape(prefix) not in patterns:
                spill_logger.addFilter(limiter(re.escape(prefix)))
    elif not ours:
        for prefix in _RATE_LIMITED:
            spill_logger.addFilter(_RateLimit(prefix))


def reset_log_rate_limits() -> None:
    """Let the next rate-limited message through at once (for tests)."""
    for f in spill_logger.filters:
        if isinstance(f, _RateLimit):
            f.last = -math.inf
    limiter = _dask_limiter()
    if limiter is not None:
        limiter.reset_timer(spill_logger)


#: What dask's store reports in ``cumulative_metrics`` and to distributed's ``context_meter``: the
#: ``(label, unit)`` pairs a caller of dask's store can see.
DASK_METRICS = frozenset(
    {
        ("memory-read", "count"),
        ("memory-read", "bytes"),
        ("disk-read", "count"),
        ("disk-read", "bytes"),
        ("disk-read", "seconds"),
        ("disk-write", "count"),
        ("disk-write", "bytes"),
        ("disk-write", "seconds"),
        ("serialize", "seconds"),
        ("deserialize", "seconds"),
        ("compress", "seconds"),
        ("decompress", "seconds"),
    }
)
