"""A dask cluster whose workers each live in a network namespace of their own, joined to the
scheduler and to each other by a bridge, every link limited by ``tc`` to a rate: transfers between
workers cost what they cost on a real network, not what loopback costs (a memcpy).

Started the way users start clusters: the scheduler in this process (on the bridge's address), and
each worker a real ``dask worker`` process (a Nanny and its worker) launched with ``ip netns exec``.
The store is chosen as a user chooses it from the command line: nothing for dask's,
``--preload-nanny spillway.dask`` for spillway (``DASK_SPILLWAY__PLUGIN=False`` for the store
alone). Needs root (``ip netns``, ``tc``); used by ``cluster_bench.py --net RATE``.

Layout: bridge ``spwb-br`` with 10.77.0.1/24 in this namespace; worker ``i`` in namespace
``spwb-w{i}`` at 10.77.0.{10+i}, on a veth pair (``spwb-h{i}`` on the bridge, ``spwb-n{i}`` in the
namespace) with a token bucket of ``rate`` on each end, so each worker sends and receives at most
``rate``. The bytes that cross each worker's link are read from the host end's counters.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil

BRIDGE = "spwb-br"
SUBNET = "10.77.0"
SCHEDULER_IP = f"{SUBNET}.1"


def _sh(*args: str, check: bool = True) -> None:
    subprocess.run(args, check=check, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _ns(i: int) -> str:
    return f"spwb-w{i}"


def teardown_network(n: int = 64) -> None:
    """Remove the namespaces, links and bridge of any earlier run (one that was killed included)."""
    for i in range(n):
        _sh("ip", "netns", "del", _ns(i), check=False)
        _sh("ip", "link", "del", f"spwb-h{i}", check=False)
    _sh("ip", "link", "del", BRIDGE, check=False)


def setup_network(n: int, rate: str) -> None:
    """The bridge and ``n`` namespaces, each on a veth pair limited to ``rate`` both ways."""
    teardown_network(n)
    _sh("ip", "link", "add", BRIDGE, "type", "bridge")
    _sh("ip", "addr", "add", f"{SCHEDULER_IP}/24", "dev", BRIDGE)
    _sh("ip", "link", "set", BRIDGE, "up")
    # A bucket of at least one timer tick at the rate (tbf's rule), and never under 256 KiB.
    tbf = ("tbf", "rate", rate, "burst", "256kb", "latency", "50ms")
    for i in range(n):
        ns, host, inner = _ns(i), f"spwb-h{i}", f"spwb-n{i}"
        _sh("ip", "netns", "add", ns)
        _sh("ip", "link", "add", host, "type", "veth", "peer", "name", inner)
        _sh("ip", "link", "set", inner, "netns", ns)
        _sh("ip", "link", "set", host, "master", BRIDGE, "up")
        _sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{SUBNET}.{10 + i}/24", "dev", inner)
        _sh("ip", "netns", "exec", ns, "ip", "link", "set", inner, "up")
        _sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        _sh("tc", "qdisc", "add", "dev", host, "root", *tbf)
        _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", inner, "root", *tbf)


def link_bytes(n: int) -> int:
    """Bytes that crossed the workers' links so far (each worker's sent plus received: a transfer
    between two workers counts on both links, as it crosses both)."""
    total = 0
    for i in range(n):
        for way in ("rx_bytes", "tx_bytes"):
            with open(f"/sys/class/net/spwb-h{i}/statistics/{way}") as f:
                total += int(f.read())
    return total


class _Worker:
    """One ``dask worker`` process (a Nanny), shaped as cluster_bench's ``Watch`` reads a
    LocalCluster's nannies: ``.process.pid`` is its current worker process."""

    def __init__(self, popen: subprocess.Popen, log: str):
        self.popen = popen
        self.log = log
        self.process = self

    @property
    def pid(self) -> int | None:
        """The pid of the nanny's worker process (a new one after a restart), if it has one."""
        try:
            children = psutil.Process(self.popen.pid).children()
        except psutil.Error:
            return None
        for c in children:
            try:
                if "spawn_main" in " ".join(c.cmdline()):
                    return c.pid
            except psutil.Error:
                continue
        return None


class NetCluster:
    """``n`` CLI workers of ``memory_limit`` bytes and ``threads`` threads each, one per namespace,
    on ``store`` ("dask", "spillway", "spillway+plugin", "spillway+inband",
    "spillway+plugin-loop"), links at ``rate`` (tc's
    syntax: "1gbit", "100mbit"), each worker with the ``preload`` modules (``dask worker --preload``).
    A context manager; ``.scheduler`` and ``.workers`` as a
    LocalCluster's, ``.scheduler_address`` for a Client."""

    def __init__(self, n: int, memory_limit: int, store: str, rate: str, local_directory: str,
                 threads: int = 1, preload: tuple = ()):
        self.n, self.memory_limit, self.store, self.rate = n, memory_limit, store, rate
        self.local_directory, self.threads, self.preload = local_directory, threads, preload
        self.workers: dict = {}
        self._scheduler_cluster = None

    def _worker_env(self) -> dict:
        env = dict(os.environ)
        if self.store == "spillway":
            env["DASK_SPILLWAY__PLUGIN"] = "False"
        elif self.store == "spillway+inband":
            env["DASK_SPILLWAY__SIDE_CHANNEL"] = "False"
        elif self.store == "spillway+plugin-loop":
            env["DASK_SPILLWAY__LOOP_READ_MAX"] = "None"
            env["DASK_SPILLWAY__SPILL_OFF_LOOP"] = "False"
        # The thresholds this harness is about: dask's defaults, spelled out in every process.
        for k, v in (("TARGET", "0.6"), ("SPILL", "0.7"), ("PAUSE", "0.8"), ("TERMINATE", "0.95")):
            env[f"DASK_DISTRIBUTED__WORKER__MEMORY__{k}"] = v
        return env

    def __enter__(self):
        from distributed import LocalCluster

        setup_network(self.n, self.rate)
        try:
            self._scheduler_cluster = LocalCluster(
                n_workers=0, host=SCHEDULER_IP, processes=True, dashboard_address=None
            )
            self.scheduler = self._scheduler_cluster.scheduler
            self.scheduler_address = self.scheduler.address
            env = self._worker_env()
            for i in range(self.n):
                cmd = ["ip", "netns", "exec", _ns(i), sys.executable, "-m",
                       "distributed.cli.dask_worker", self.scheduler_address,
                       "--host", f"{SUBNET}.{10 + i}", "--name", str(i),
                       "--nthreads", str(self.threads), "--memory-limit", str(self.memory_limit),
                       "--local-directory", self.local_directory, "--no-dashboard",
                       "--death-timeout", "60"]
                for preload in self.preload:
                    cmd += ["--preload", preload]
                if self.store != "dask":
                    cmd += ["--preload-nanny", "spillway.dask"]
                log = os.path.join(self.local_directory, f"worker-{i}.log")
                with open(log, "w") as out:
                    p = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
                self.workers[str(i)] = _Worker(p, log)
            deadline = time.monotonic() + 120
            while len(self.scheduler.workers) < self.n:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{len(self.scheduler.workers)} of {self.n} workers joined")
                time.sleep(0.1)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def kills(self) -> int:
        """The nannies' "exceeded 95% memory budget" restarts, from their logs."""
        count = 0
        for w in self.workers.values():
            with open(w.log, errors="replace") as f:
                count += sum("memory budget" in line for line in f)
        return count

    def link_bytes(self) -> int:
        return link_bytes(self.n)

    def __exit__(self, *exc):
        for w in self.workers.values():
            if w.popen.poll() is None:
                w.popen.terminate()
        for w in self.workers.values():
            try:
                w.popen.wait(timeout=30)
            except subprocess.TimeoutExpired:
                for c in psutil.Process(w.popen.pid).children(recursive=True):
                    c.kill()
                w.popen.kill()
                w.popen.wait()
        if self._scheduler_cluster is not None:
            self._scheduler_cluster.close()
        teardown_network(self.n)
        return False
