"""The benchmark script runs (micro-benchmark only, tiny sizes): it must not rot."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("numpy")

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "dask_bench.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("dask_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_parse_size(bench):
    assert bench.parse_size("4KiB") == 4096
    assert bench.parse_size("16MiB") == 16 << 20
    assert bench.parse_size("1.5GiB") == 3 << 29
    assert bench.parse_size("100") == 100


def test_micro_benchmark_runs(bench, tmp_path, capsys):
    out = tmp_path / "out.json"
    status = bench.main(
        [
            "--skip-cluster",
            "--sizes",
            "4KiB,64KiB",
            "--bytes-per-size",
            "256KiB",
            "--dir",
            str(tmp_path),
            "--json",
            str(out),
        ]
    )
    assert status == 0
    rows = json.loads(out.read_text())["micro"]
    assert [(r["size"], r["op"]) for r in rows] == [
        (4096, "spill"),
        (4096, "unspill"),
        (65536, "spill"),
        (65536, "unspill"),
    ]
    assert all(r["spillway_ok"] and r["spillway_ops"] > 0 for r in rows)
    if "dask_ops" in rows[0]:  # with distributed installed: ratios, and the floor of each row
        assert all(r["floor_ops"] > 0 and r["floor_ratio"] == r["floor_ops"] / r["dask_ops"] for r in rows)
    text = capsys.readouterr().out
    assert "spillway ops/s" in text
