"""What dask's dashboard shows of spillway: a screenshot of its fine performance metrics page.

Starts a ``LocalCluster`` of two Nanny workers on spillway with the plugin (``preload_nanny=
["spillway.dask"]``, 1 GiB each, dask's default thresholds), runs a workload that spills and moves
spilled data between the workers (a persisted array, its transpose added to it, a task rechunk),
checks that dask's metrics carry spillway's work under the activities that caused it (the
scheduler's ``cumulative_worker_metrics``, which the page draws, and each worker's Prometheus
``/metrics``), then opens the page in headless Chromium (Debian's ``chromium``) and saves a
screenshot::

    python3 python/bench/dashboard.py docs/dashboard-fine-metrics.png   # 1 GiB workers, a 2 GiB array
    python3 python/bench/dashboard.py --small out.png                  # 400 MiB, 512 MiB (the test)

Needs bokeh (dask's dashboard) and chromium; exits 2 naming what is missing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

#: (activity, label) pairs the page must show for spillway's work.
EXPECTED = {
    ("get-data", "disk-read"),  # a sender reading spilled values for a peer
    ("gather-dep", "disk-write"),  # a receiver spilling to make room for what arrives
    ("execute", "disk-read"),  # a task's inputs read back
    ("execute", "deserialize"),  # ... and unpickled (those received still pickled too)
    ("execute", "disk-write"),  # a task's output spilling others
}

#: What the small workload (--small, the test) is sure to show: its workers may never need to
#: spill on a transfer's arrival or a task's output.
EXPECTED_SMALL = {("get-data", "disk-read"), ("execute", "disk-read"), ("execute", "deserialize")}


def workload(client, n: int) -> None:
    """An ``n`` x ``n`` float64 array, persisted (most of it spilled), its transpose added to it,
    rechunked by tasks."""
    import dask
    import dask.array as da
    from distributed import futures_of

    with dask.config.set({"array.rechunk.method": "tasks"}):
        x = da.random.default_rng(0).random((n, n), chunks=(n // 8, n // 8))
        x = x.persist()
        (x + x.T).sum().compute()
        x.rechunk((n, n // 64)).sum(axis=0).compute()
    # The client is no plugged peer: it fetches over dask's own get_data, so a key on disk is read
    # for it in-band ('get-data', 'disk-read'), whichever way the workers moved values to each other.
    on_disk = client.run(lambda dask_worker: dask_worker.data.keys_by_place()[1][:2])
    wanted = {k for keys in on_disk.values() for k in keys}
    assert wanted, "the workload spilled nothing"
    client.gather([f for f in futures_of(x) if f.key in wanted])


def seen_in_scheduler(client) -> set:
    keys = client.run_on_scheduler(
        lambda dask_scheduler: list(dask_scheduler.cumulative_worker_metrics)
    )
    return {(k[0], k[-2]) for k in keys if isinstance(k, tuple) and k[-1] == "seconds"}


def _stop_group(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGTERM to ``proc``'s process group, SIGKILL to what is left after ``timeout``; returns once
    no process of the group is left."""
    import signal

    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            proc.poll()  # (reaps the leader; its children are re-parented and reaped by init)
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)


def screenshot(url: str, out: str, chromium: str, settle: float = 8.0) -> None:
    """A PNG of ``url`` as headless Chromium renders it, ``settle`` seconds after it loaded (the
    dashboard draws from a websocket once its scripts run: a plain ``--screenshot`` is taken
    before). Driven through the DevTools protocol with tornado's websocket client (what
    distributed already depends on)."""
    import asyncio
    import base64
    import json

    from tornado.websocket import websocket_connect

    async def drive(ws_url: str) -> bytes:
        ws = await websocket_connect(ws_url, max_message_size=64 << 20)
        calls = iter(range(1, 1000))

        async def call(method, **params):
            n = next(calls)
            ws.write_message(json.dumps({"id": n, "method": method, "params": params}))
            while True:
                msg = json.loads(await ws.read_message())
                if msg.get("id") == n:
                    return msg.get("result", {})

        await call("Emulation.setDeviceMetricsOverride", width=1500, height=1100, deviceScaleFactor=1, mobile=False)
        await call("Page.enable")
        await call("Page.navigate", url=url)
        await asyncio.sleep(settle)
        shot = await call("Page.captureScreenshot", format="png")
        ws.close()
        return base64.b64decode(shot["data"])

    with tempfile.TemporaryDirectory() as profile:
        proc = subprocess.Popen(
            [
                chromium,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                f"--user-data-dir={profile}",
                "--hide-scrollbars",
                "--remote-debugging-port=0",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            port_file = os.path.join(profile, "DevToolsActivePort")
            deadline = time.monotonic() + 30
            while not (os.path.exists(port_file) and open(port_file).read().strip()):
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("chromium did not start its DevTools server")
                time.sleep(0.1)
            port = open(port_file).read().split()[0]
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json", timeout=30) as r:
                pages = [t for t in json.load(r) if t["type"] == "page"]
            png = asyncio.run(drive(pages[0]["webSocketDebuggerUrl"]))
            with open(out, "wb") as f:
                f.write(png)
        finally:
            # Chromium's helpers (renderer, crash handler) outlive its main process and keep
            # writing into the profile: stop the whole group before the profile is removed.
            _stop_group(proc)


def main(argv: list | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", nargs="?", default="dashboard-fine-metrics.png")
    p.add_argument("--small", action="store_true", help="400 MiB workers and a 512 MiB array")
    args = p.parse_args(argv)
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    try:
        import bokeh  # noqa: F401
    except ImportError:
        print("needs bokeh (pip install bokeh), for dask's dashboard", file=sys.stderr)
        return 2
    if chromium is None:
        print("needs chromium (apt-get install chromium)", file=sys.stderr)
        return 2
    import distributed

    with (
        distributed.LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            memory_limit="400MiB" if args.small else "1GiB",
            preload_nanny=["spillway.dask"],
            dashboard_address="127.0.0.1:0",
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        types = client.run(lambda dask_worker: type(dask_worker.data).__module__)
        assert set(types.values()) == {"spillway.buffer"}, types
        workload(client, 8_000 if args.small else 16_000)
        expected = EXPECTED_SMALL if args.small else EXPECTED
        deadline = time.monotonic() + 30
        while not expected <= (seen := seen_in_scheduler(client)) and time.monotonic() < deadline:
            time.sleep(0.5)  # (the scheduler learns them from the workers' heartbeats)
        missing = expected - seen
        print("activities in dask's fine metrics:", sorted(seen))
        for addr, port in client.run(lambda dask_worker: dask_worker.http_server.port).items():
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
                text = r.read().decode()
            spill = [line for line in text.splitlines() if line.startswith("dask_worker_spill_time")]
            print(addr, "Prometheus:", "; ".join(spill))
        url = cluster.dashboard_link.replace("/status", "/individual-fine-performance-metrics")
        screenshot(url, args.out, chromium)
        print("screenshot of", url, "->", args.out)
        if missing:
            print("missing from dask's fine metrics:", sorted(missing), file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
