"""dask's dashboard shows spillway's work: ``python/bench/dashboard.py`` runs a spilling workload on
a spillway cluster, checks dask's fine metrics for spillway's activities and takes a screenshot of
the fine performance metrics page in headless Chromium, which must show more than a blank page."""

from __future__ import annotations

import os
import shutil
import sys
import zlib

import pytest

pytest.importorskip("bokeh")
pytest.importorskip("distributed")
if shutil.which("chromium") is None:
    pytest.skip("no chromium (apt-get install chromium)", allow_module_level=True)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "bench"))
import dashboard  # noqa: E402


def _pixels(png: bytes) -> bytes:
    """The raw (filtered) scanlines of a PNG: its IDAT chunks inflated."""
    at, data = 8, b""
    while at < len(png):
        n = int.from_bytes(png[at : at + 4], "big")
        kind = png[at + 4 : at + 8]
        if kind == b"IDAT":
            data += png[at + 8 : at + 8 + n]
        at += 12 + n
    return zlib.decompress(data)


def test_the_fine_performance_metrics_page_shows_spillways_work(tmp_path, capsys):
    out = tmp_path / "page.png"
    code = dashboard.main(["--small", str(out)])
    assert code == 0, capsys.readouterr()  # (1: an activity missing from the metrics)
    png = out.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    # A blank page is one colour: the drawn page has plots (many distinct byte values).
    assert len(set(_pixels(png))) > 50
