"""spillway's log messages in dask's words, rate-limited as dask rate-limits its own.

The messages a ``SpillBuffer`` logs on the ``spillway`` logger when a spill does not happen are
dask's (``distributed.spill``): "Spill file on disk reached capacity; keeping data in memory",
"Spill to disk failed; keeping data in memory", "Failed to pickle %r". The first two are let through
at most once every 10 s each, with distributed's ``RateLimiterFilter`` once distributed is loaded
(so that its ``reset_timer("spillway")``, which dask's test suite uses, resets them too).
"""

from __future__ import annotations

import logging
import math
import re
import sys
from time import monotonic

__all__ = ["DISK_ERROR_MESSAGE", "MAX_SPILL_MESSAGE", "PICKLE_ERROR_MESSAGE", "reset_log_rate_limits"]

logger = logging.getLogger("spillway")

MAX_SPILL_MESSAGE = "Spill file on disk reached capacity; keeping data in memory"
DISK_ERROR_MESSAGE = "Spill to disk failed; keeping data in memory"
PICKLE_ERROR_MESSAGE = "Failed to pickle %r"

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
