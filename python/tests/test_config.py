"""dask's config is spillway's config: the memory keys as dask reads them, compression as dask
means it, and the ``spillway:`` namespace for what dask has no key for."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

dask = pytest.importorskip("dask")

import spillway  # noqa: E402
from spillway import config  # noqa: E402

GIB = 1 << 30


def test_thresholds_are_dasks():
    six, seven = int(0.6 * GIB), int(0.7 * GIB)
    cases = [  # (fractions, process-trigger) -> (target, process target, process trigger)
        ({"target": 0.6, "spill": 0.7}, "target", (six, six, six)),
        ({"target": 0.6, "spill": 0.7}, "spill", (six, six, seven)),
        ({"target": False, "spill": 0.7}, "target", (sys.maxsize, seven, seven)),
        ({"target": False, "spill": 0.7}, "spill", (sys.maxsize, seven, seven)),
        ({"target": 0.5, "spill": False}, "target", (GIB // 2, None, None)),
        ({"target": False, "spill": False}, "spill", (sys.maxsize, None, None)),
    ]
    for fractions, at, expected in cases:
        settings = {f"distributed.worker.memory.{k}": v for k, v in fractions.items()}
        with dask.config.set({**settings, "spillway.process-trigger": at}):
            assert tuple(config.thresholds(GIB)) == expected, (fractions, at)
            assert tuple(config.thresholds(None)) == (sys.maxsize, None, None)
    with dask.config.set({"spillway.process-trigger": "soon"}), pytest.raises(ValueError):
        config.thresholds(GIB)


def test_max_spill_is_dasks():
    for value, expected in [(False, False), ("1 MiB", 1 << 20), (1000, 1000)]:
        with dask.config.set({"distributed.worker.memory.max-spill": value}):
            assert config.max_spill() == expected


def test_compression_is_dasks(monkeypatch):
    for name, expected in [(None, "none"), (False, "none"), ("lz4", "lz4"), ("none", "none")]:
        assert config.compression(name) == expected
    # Every other compressor dask knows asks for compression: spillway's is lz4.
    for name in ("zlib", "snappy", "zstd"):
        assert config.compression(name) == "lz4"
    # A name dask refuses is refused.
    for name in ("gzip", "LZ4", 3, ["lz4"]):
        with pytest.raises(ValueError, match="spill-compression"):
            config.compression(name)
    # "auto": lz4 where dask would find a compressor (lz4, or snappy), else nothing.
    real = importlib.util.find_spec
    for installed, expected in [((), "none"), (("lz4",), "lz4"), (("snappy",), "lz4")]:
        monkeypatch.setattr(
            importlib.util, "find_spec", lambda m, *a: object() if m in installed else real(m, *a)
        )
        assert config.compression("auto") == expected
    monkeypatch.setattr(importlib.util, "find_spec", real)


def test_a_buffer_compresses_as_dasks_config_says(tmp_path):
    for setting, expected in [("lz4", "lz4"), (False, "none")]:
        with dask.config.set({"distributed.worker.memory.spill-compression": setting}):
            buf = spillway.SpillBuffer(str(tmp_path), target=0)
        try:
            assert buf._store.compression == expected
            buf["x"] = "x" * 100_000  # compressible, heavier than the target: on disk
            assert buf["x"] == "x" * 100_000
        finally:
            buf.close()
    buf = spillway.SpillBuffer(str(tmp_path), target=0, compression="lz4")
    assert buf._store.compression == "lz4"
    buf.close()
    with dask.config.set({"distributed.worker.memory.spill-compression": "zstd"}):
        buf = spillway.SpillBuffer(str(tmp_path), target=0)
    assert buf._store.compression == "lz4"
    buf.close()
    with dask.config.set({"distributed.worker.memory.spill-compression": "gzip"}):
        with pytest.raises(ValueError, match="not a compression dask knows"):
            spillway.SpillBuffer(str(tmp_path), target=0)
    assert os.listdir(tmp_path) == [], "nothing left behind"


def test_the_spillway_namespace_has_defaults_and_takes_environment_variables():
    assert config.get("side-channel") is True
    assert config.get_bytes("side-channel-min-bytes") == 4 << 20
    assert config.get_seconds("side-channel-connect-timeout") == 2
    with dask.config.set({"spillway.segment-bytes": "1 MiB", "spillway.backend": "portable"}):
        assert config.get_bytes("segment-bytes") == 1 << 20
    # A DASK_SPILLWAY__... variable, as dask reads its environment when it is imported.
    code = (
        "import spillway.config as c; "
        "print(c.get('side-channel'), c.get_bytes('side-channel-min-bytes'))"
    )
    env = dict(
        os.environ,
        DASK_SPILLWAY__SIDE_CHANNEL="False",
        DASK_SPILLWAY__SIDE_CHANNEL_MIN_BYTES="1MiB",
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["False", str(1 << 20)]
