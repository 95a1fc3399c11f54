"""One ``SpillBuffer`` raced by several threads against a dict as the model (``python/bench/races.py``:
sets, reads, deletes, evictions, receives that succeed, fail and are never set, their records let go
of at random moments): every key reads back its last value after every step, and at the end the
buffer holds exactly the model's keys. Brief here; ``python bench/races.py --seconds N`` soaks."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "bench"))
import races  # noqa: E402


@pytest.mark.parametrize("seed", [10, 11, 12])
def test_no_value_is_lost_when_calls_race(seed):
    r = races.run(ops=20_000, threads=4, seed=seed)
    assert r["ops"] == 20_000
    assert all(r["by_op"].get(op, 0) > 0 for op in races.OPS), r["by_op"]
