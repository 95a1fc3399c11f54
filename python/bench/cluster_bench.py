#!/usr/bin/env python
"""A tight-memory dask cluster on spillway against dask's own store, in one invocation.

Each run starts a fresh ``LocalCluster`` of Nanny worker processes (one thread each, a real
``memory_limit``, dask's default memory thresholds, P2P off so that rechunks and shuffles go through
``Worker.data``), runs the workload's phases, and closes it. The stores alternate: run 1 is dask then
spillway, run 2 spillway then dask, and so on. Reported per store and run:

* completed or not (the exception of the first phase that failed, e.g. ``KilledWorker``);
* worker restarts (new worker processes under a nanny, and the nanny's "exceeded 95% memory budget"
  lines);
* peak RSS of each worker process (sampled every 50 ms from this process, so a worker that was killed
  counts too), and inside each worker: peak RSS, the store's in-memory weight against its target,
  managed memory, and the "Unmanaged memory use is high" warnings;
* the scheduler's unmanaged-memory samples (from the workers' heartbeats);
* wall time of each phase, and whether every phase's result is identical across all runs of all
  stores;
* the CPU time of each phase: the machine's (busy and idle, over all its cores) and the workers'
  own (user and system), which says whether a phase is bound by the CPUs, and whose work fills them.

Phases: ``persist`` (a random float64 array, most of it spilled), ``transpose-sum``
(``(x + x.T).sum()``), ``rechunk`` (a task rechunk to tall narrow chunks, ``x.rechunk((n, 128))
.sum(0)``), ``shuffle`` (a random dataframe shuffled on an int column by tasks, persisted,
``len()``), ``transfer`` (an array persisted on one worker, every chunk read by tasks on the other)
and ``retire`` (one worker retired: its spilled data moves to the other, then ``x.sum()``). The
``moved`` workload runs ``transfer`` and ``replicate`` (the transfer's array persisted on one
worker, then a copy of every chunk replicated to every other worker, where nothing uses it).

    python python/bench/cluster_bench.py                    # the full workload, 5 runs per store
    python python/bench/cluster_bench.py --size ci --runs 1 --stores spillway
    python python/bench/cluster_bench.py --json out.json --phases persist,rechunk

``python/tests/test_cluster.py`` runs the ``ci`` size through :func:`run_one`.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import hashlib
import json
import logging
import os
import statistics
import tempfile
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

from distributed import WorkerPlugin

MiB, GiB = 1 << 20, 1 << 30


@dataclass(frozen=True)
class Size:
    """How big the workload is."""

    workers: int
    memory_limit: int
    array_bytes: int
    chunk_bytes: int
    frame_bytes: int  # the dataframe
    transfer_bytes: int  # the array persisted on one worker, then read by tasks on the other
    array_chunk_size: str  # dask's array.chunk-size: the rechunk's intermediate chunks are this big
    forward_values: int = 768  # "forward": counted values made on one worker, moved to the other
    forward_bytes: int = 1 * MiB  # ... each this big
    object_rows: int = 1 << 17  # "shuffle-objects": rows of a dataframe with a column of them
    big_values: int = 4  # "big-move": arrays spilled on one worker, moved to the other
    big_bytes: int = 256 * MiB  # ... each this big
    big_memory_limit: int = 1200 * MiB  # the workers' memory limit in the "big" workload
    big_filler: int = 480 * MiB  # held in the receiver's memory first: it receives over its target


SIZES = {
    # The workload, dask's defaults. The rechunk goes through intermediate chunks of 90 MiB.
    "full": Size(2, 600 * MiB, 2 * GiB, 16 * MiB, 512 * MiB, 256 * MiB, "128MiB"),
    # Sized for CI. With the default array.chunk-size, a 1 GiB array's rechunk goes through 128 MiB
    # intermediate chunks: a task holding 256 MiB while a peer sends it one and it sends one, in a
    # 500 MiB worker, which no store can survive every time (dask's restarted 1 and 6 times in two
    # runs). 64 MiB keeps the task's share of the worker as in "full".
    "ci": Size(
        2,
        500 * MiB,
        1 * GiB,
        16 * MiB,
        256 * MiB,
        128 * MiB,
        "64MiB",
        512,
        1 * MiB,
        1 << 16,
        4,
        64 * MiB,
        500 * MiB,
        200 * MiB,
    ),
}
#: The memory workload (issue #24) and the forwarding one (values that move between workers still
#: pickled, with the spillway.dask plugin).
WORKLOADS = {
    "memory": ("persist", "transpose-sum", "rechunk", "shuffle", "transfer", "retire"),
    "forward": ("shuffle-objects", "forward"),  # (forward retires a worker: last)
    # Values moved between workers: each used by a task on the receiver at once (transfer), or
    # never used there (replicate: copies of every chunk on every worker): the best and the worst
    # case for deserializing on demand.
    "moved": ("transfer", "replicate"),
    # Large spilled values sent to a peer (the side channel of spillway.dask): workers of
    # ``big_memory_limit``.
    "big": ("big-move",),
}
PHASES = tuple(p for phases in WORKLOADS.values() for p in phases)
#: "spillway+plugin": spillway's store and ``client.register_plugin(spillway.dask.SpillwayPlugin())``;
#: "spillway+inband": the same plugin with ``side_channel=False`` (every value in dask's reply);
#: "spillway+plugin-loop": the plugin with the store's work left on the event loop where dask does it
#: (``loop_read_max_bytes`` unbounded, ``spill_off_loop=False``).
#: "baseline": another build's ``SpillBuffer`` (``--baseline FILE``) run as spillway's is, on this
#: build's ``spillway._core``.
STORES = ("dask", "spillway", "spillway+plugin", "spillway+inband", "spillway+plugin-loop", "baseline")

#: ``--baseline FILE``: the path of another build's ``buffer.py``, for the "baseline" store.
BASELINE_ENV = "CLUSTER_BENCH_BASELINE"

#: The worker's data factory for the "baseline" store: a module the worker processes import (its
#: directory goes on their PYTHONPATH): ``worker_data`` with the baseline's ``SpillBuffer``.
_BASELINE_FACTORY = """
import importlib.util, os, sys

import spillway.worker


def worker_data(worker_local_directory, **kwargs):
    module = sys.modules.get("spillway_baseline")
    if module is None:
        spec = importlib.util.spec_from_file_location("spillway_baseline", os.environ["%s"])
        module = importlib.util.module_from_spec(spec)
        sys.modules["spillway_baseline"] = module
        spec.loader.exec_module(module)
    saved = spillway.worker.SpillBuffer
    spillway.worker.SpillBuffer = module.SpillBuffer
    try:
        return spillway.worker.worker_data(worker_local_directory, **kwargs)
    finally:
        spillway.worker.SpillBuffer = saved
""" % BASELINE_ENV


def _install_baseline(path: str) -> None:
    """Make the "baseline" store's factory importable here and in the workers."""
    directory = tempfile.mkdtemp(prefix="cluster-bench-baseline-")
    with open(os.path.join(directory, "cluster_bench_baseline.py"), "w") as f:
        f.write(_BASELINE_FACTORY)
    os.environ[BASELINE_ENV] = os.path.abspath(path)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [directory, os.environ.get("PYTHONPATH")]))
    sys.path.insert(0, directory)

#: The preload that counts each worker's serializations and deserializations.
SERIAL_COUNTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "serial_counts.py")

#: Seconds any one phase may take before it counts as failed.
PHASE_TIMEOUT = 600
#: ``CLUSTER_BENCH_TIMELINE=1`` keeps every 50 ms sample of each worker (``TIMELINE_FIELDS``) and
#: returns them with the phase's stats (in ``--json``); ``=file`` also appends each one, with the
#: running tasks, to ``/tmp/tl-<pid>.txt``, which outlives a worker the nanny kills.
TIMELINE = os.environ.get("CLUSTER_BENCH_TIMELINE")
TIMELINE_FIELDS = (
    "time",
    "rss",
    "mmapped",
    "store_memory",
    "transfer_in",
    "transfer_out",
    "executing",
    "status",
    "alive_spilled",
)


@dataclass
class RunResult:
    """One store's run of the workload."""

    store: str
    run: int
    completed: bool = False
    error: str = ""
    restarts: int = 0
    nanny_kills: int = 0
    phase_seconds: dict = field(default_factory=dict)
    results: dict = field(default_factory=dict)  # phase -> digest of its result
    values: dict = field(default_factory=dict, repr=False)  # phase -> its result (not in --json)
    notes: dict = field(default_factory=dict)  # what the phases observed besides their results
    peak_rss: list = field(default_factory=list)  # per worker slot, across restarts (bytes)
    worker_stats: dict = field(default_factory=dict)  # phase -> {worker: stats from inside it}
    unmanaged: list = field(default_factory=list)  # scheduler's samples (bytes), all workers
    link_bytes: dict = field(default_factory=dict)  # phase -> bytes over the workers' links (--net)
    #: phase -> {worker: [serializations, deserializations] since it started} (serial_counts.py),
    #: a worker closed in the phase (retire) with its counts at its close.
    serial: dict = field(default_factory=dict)
    #: phase -> the machine's CPU time in the phase, seconds summed over its cores, by kind
    #: (``psutil.cpu_times``: user, system, idle, iowait, steal, ...): every process, the scheduler
    #: and this one included. Where ``busy`` is close to ``cores``, the phase is bound by the CPUs.
    cpu: dict = field(default_factory=dict)
    #: phase -> [user, system] CPU seconds of the worker processes in the phase, summed (a worker
    #: that started in it from its start; one that left in it, retire's, not counted).
    worker_cpu: dict = field(default_factory=dict)
    backend: str = ""

    @property
    def total_seconds(self) -> float:
        return sum(self.phase_seconds.values())


# --------------------------------------------------------------------------------------------------
# Inside the workers


class MemorySampler(WorkerPlugin):
    """A worker plugin: a thread sampling the worker's RSS, its store's in-memory weight and its
    managed memory every 50 ms, and a log handler counting "Unmanaged memory use is high". Its
    ``collect`` (run through ``client.run``) returns the peaks since the last call and resets them.
    A worker that closes writes its (de)serialization counts to ``closed_dir`` (its address, quoted,
    as the file name), where the harness finds those of a worker retired in a phase."""

    name = "cluster-bench-sampler"

    def __init__(self, closed_dir: str | None = None):
        self.closed_dir = closed_dir

    def setup(self, worker):
        import psutil

        self.worker = worker
        self.proc = psutil.Process()
        self.lock = threading.Lock()
        self.reset()
        self.stop = threading.Event()
        self.timeline = []
        self.warnings = _Counting(
            "distributed.worker.memory", "Unmanaged memory use is high", logging.WARNING
        )
        self.thread = threading.Thread(target=self.loop, name="cluster-bench-sampler", daemon=True)
        self.thread.start()
        self.loop_watch = LoopWatch(worker)

    def reset(self):
        self.peak = {"rss": 0, "store_memory": 0, "managed": 0, "over_target": 0, "at_peak": {}}

    def loop(self):
        while not self.stop.wait(0.05):
            try:
                self.sample()
            except Exception:  # the worker is closing
                pass

    def sample(self):
        data = self.worker.data
        rss = self.proc.memory_info().rss
        fast = getattr(data, "fast", None)
        weight = int(getattr(fast, "total_weight", 0) or 0)
        target = getattr(data, "target", None) or getattr(fast, "n", None) or 0
        managed = sum(
            ts.nbytes for ts in list(self.worker.state.tasks.values()) if ts.state == "memory"
        )
        if TIMELINE:
            w = self.worker
            row = (
                time.time(),
                rss,
                _malloc_info().get("mmapped", 0),
                weight,
                w.state.transfer_incoming_bytes,
                w.transfer_outgoing_bytes,
                len(w.state.executing),
                w.status.name,
                _alive_spilled(data),
            )
            self.timeline.append(row)
            if TIMELINE == "file":
                tasks = [str(ts.key)[:40] for ts in w.state.executing]
                with open(f"/tmp/tl-{os.getpid()}.txt", "a") as f:
                    f.write(repr(row + (tasks,)) + "\n")
        with self.lock:
            p = self.peak
            if rss > p["rss"]:
                # What the memory is at the peak: the store's weight and glibc's view of the heap.
                p["at_peak"] = dict(_malloc_info(), store_memory=weight)
            p["rss"] = max(p["rss"], rss)
            p["store_memory"] = max(p["store_memory"], weight)
            p["managed"] = max(p["managed"], managed)
            if target:
                p["over_target"] = max(p["over_target"], weight - int(target))
            p["target"] = int(target)

    def collect(self):
        self.sample()
        with self.lock:
            out = dict(self.peak, unmanaged_warnings=self.warnings.take())
            m = getattr(self.worker.data, "cumulative_metrics", {})
            out["metrics"] = {f"{k[0]} {k[1]}": v for k, v in m.items()}
            out["time"] = _fine_seconds(self.worker)
            counter = sys.modules.get("serial_counts")
            out["serial"] = list(counter.counts()) if counter is not None else None
            out["cpu"] = _worker_cpu(self.worker)  # since it started
            if TIMELINE:
                out["timeline"], self.timeline = self.timeline, []
            out["loop"] = self.loop_watch.collect()
            out["received_keys"] = self._received_keys()
            own = getattr(self.worker.data, "spillway_metrics", {})
            out["side_sent"] = own.get(("send-side", "count"), 0)  # (cumulative)
            self.reset()
        return out

    def _received_keys(self) -> int:
        """Keys this worker received from peers since the last call (its transfer log's entries
        since then)."""
        log = list(self.worker.transfer_incoming_log)
        last, self.last_entry = getattr(self, "last_entry", None), (log[-1] if log else None)
        n = 0
        for entry in reversed(log):
            if entry is last:
                break
            n += len(entry["keys"])
        return n

    def teardown(self, worker):
        self.stop.set()
        self.loop_watch.close()
        counter = sys.modules.get("serial_counts")
        if self.closed_dir and counter is not None:
            with open(os.path.join(self.closed_dir, _quoted(worker.address)), "w") as f:
                json.dump(list(counter.counts()), f)
        self.warnings.close()


class LoopWatch:
    """How responsive a worker's event loop is: a callback of its own every ``TICK`` seconds on the
    loop (dask's own tick interval, the ``tick-duration`` dask's servers measure) records how long
    each tick really took (a stalled loop makes one long tick); the "Event loop was unresponsive"
    messages dask logs past ``distributed.admin.tick.limit`` are counted; and the time the loop's
    thread spends inside the store's calls (sets, reads, deletes, evictions, serialized reads and
    sets, on either store) is summed, by call and per tick.

    Each tick of ``LONG`` or more is put down to what filled it, the largest of: the store's calls
    on the loop (``store``); the loop thread's own CPU time outside them (``loop``: dask's
    handlers, (de)serialization of messages, the task's function when it runs on the loop); time
    it waited for a core (``core``: its run-queue delay, from ``/proc/thread-self/schedstat``);
    and the rest, where it was runnable by the kernel's account but not running Python (``gil``:
    waiting for the GIL a task's thread holds, or any other blocking wait outside the store).

    It also counts what answers the design's doubts on the sender's side: the values it granted
    to a peer's side channel from disk (spillway + plugin), and the reads of a value from disk
    for this worker's own use (a set's value read back), with their times, so that a send of a
    value read back within ``READ_BACK_WINDOW`` seconds shows as the disk read the send did not
    save. ``collect`` returns them since the last call."""

    TICK = 0.02
    #: A tick this long or longer is attributed to a cause (five ticks: a loop that missed four).
    LONG = 0.1
    #: Seconds after a side-channel send within which a read of the same value from disk for the
    #: sender's own use counts as a second read of it.
    READ_BACK_WINDOW = 10.0
    #: The store's methods whose time on the loop's thread is counted.
    CALLS = ("__setitem__", "__getitem__", "__delitem__", "evict", "get_serialized", "set_serialized")

    def __init__(self, worker):
        from tornado.ioloop import PeriodicCallback

        self.ticks: list = []
        self.store_ticks: list = []  # per tick, seconds of store calls in it
        self.long: dict = {}  # cause -> [long ticks, their seconds]
        self.long_calls: dict = {}  # the store's call that filled most of a store-caused one -> n
        self.tick_calls: dict = {}  # call -> seconds in the current tick
        self.by_call: dict = {}  # seconds of store calls on the loop's thread, by the store's method
        self.call_times: dict = {}  # the store's method -> seconds of each of its calls on the loop
        self.loop_thread = threading.current_thread()  # (plugins are set up on the loop)
        self.sends: list = []  # (monotonic time, key, bytes) of side-channel grants from disk
        self.read_backs: list = []  # (monotonic time, key) of reads from disk for own use
        self.last = time.monotonic()
        self.last_cpu = time.thread_time()
        self.last_wait = _run_queue_seconds()
        self.store_type = type(worker.data)
        self._patch(self.store_type)
        self.unresponsive = _Counting("distributed.core", "Event loop was unresponsive", logging.INFO)
        self.pc = PeriodicCallback(self._tick, self.TICK * 1000)
        self.pc.start()

    def _tick(self):
        now, cpu, wait = time.monotonic(), time.thread_time(), _run_queue_seconds()
        tick, store = now - self.last, sum(self.tick_calls.values())
        self.ticks.append(tick)
        self.store_ticks.append(store)
        if tick >= self.LONG:
            own = max(0.0, cpu - self.last_cpu - store)
            queued = max(0.0, wait - self.last_wait)
            parts = {"store": store, "loop": own, "core": queued}
            parts["gil"] = max(0.0, tick - self.TICK - store - own - queued)
            cause = max(parts, key=parts.__getitem__)
            entry = self.long.setdefault(cause, [0, 0.0])
            entry[0] += 1
            entry[1] += tick
            if cause == "store":
                call = max(self.tick_calls, key=self.tick_calls.__getitem__)
                self.long_calls[call] = self.long_calls.get(call, 0) + 1
        self.tick_calls = {}
        self.last, self.last_cpu, self.last_wait = now, cpu, wait
        holder = getattr(self.store_type, "_cluster_bench_watch", None)
        if holder is not None:
            self._watch_grants(holder)

    def _patch(self, store_type):
        """Wrap the store type's calls to sum their time on the loop's thread into this watch's
        (once per type and process: a later watch takes the wrappers over). The wrappers find the
        watch through the type, not through this module's globals, which a plugin pickled by value
        does not share between its functions."""
        holder = store_type.__dict__.get("_cluster_bench_watch")
        if holder is not None:
            holder[0] = self
            return
        holder = [self]
        store_type._cluster_bench_watch = holder
        for name in self.CALLS:
            f = store_type.__dict__.get(name)
            if f is None:
                continue

            def timed(*args, _f=f, _name=name, **kwargs):
                watch = holder[0]
                if _name == "__getitem__" and _on_disk(args[0], args[1]):
                    watch.read_backs.append((time.monotonic(), args[1]))
                if threading.current_thread() is not watch.loop_thread:
                    return _f(*args, **kwargs)
                t0 = time.perf_counter()
                try:
                    return _f(*args, **kwargs)
                finally:
                    spent = time.perf_counter() - t0
                    watch.by_call[_name] = watch.by_call.get(_name, 0.0) + spent
                    watch.tick_calls[_name] = watch.tick_calls.get(_name, 0.0) + spent
                    watch.call_times.setdefault(_name, []).append(spent)

            setattr(store_type, name, timed)
    @staticmethod
    def _watch_grants(holder):
        """Once ``spillway.dask`` is loaded: wrap its grant of a side-channel reference to note
        each value sent from disk that way (the watch found through ``holder``, as above)."""
        plugin = sys.modules.get("spillway.dask")
        grant = getattr(plugin, "_grant", None)
        if grant is None or hasattr(grant, "cluster_bench"):
            return

        def granted(buf, key, side, tickets, _f=grant, _side=plugin.SIDE):
            ref = _f(buf, key, side, tickets)
            if ref is not None:
                holder[0].sends.append((time.monotonic(), key, ref.header[_side][4]))
            return ref

        granted.cluster_bench = True
        plugin._grant = granted

    def collect(self) -> dict:
        ticks, self.ticks = sorted(self.ticks), []
        store_ticks, self.store_ticks = sorted(self.store_ticks), []
        by_call, self.by_call = self.by_call, {}
        call_times, self.call_times = self.call_times, {}
        long, self.long = self.long, {}
        long_calls, self.long_calls = self.long_calls, {}
        now = time.monotonic()
        # Sends old enough for their window to have closed are judged now; the rest next time.
        sends = [s for s in self.sends if s[0] <= now - self.READ_BACK_WINDOW]
        self.sends = [s for s in self.sends if s[0] > now - self.READ_BACK_WINDOW]
        reads: dict = {}
        for t, key in self.read_backs:
            reads.setdefault(key, []).append(t)
        self.read_backs = [r for r in self.read_backs if r[0] > now - 2 * self.READ_BACK_WINDOW]
        read_again = [
            s for s in sends if any(0 <= t - s[0] <= self.READ_BACK_WINDOW for t in reads.get(s[1], ()))
        ]
        n = len(ticks)

        def at(xs, q):
            return 1000 * xs[min(len(xs) - 1, int(len(xs) * q))] if xs else None

        out = {
            "ticks": n,
            "median_ms": at(ticks, 0.5),
            "p99_ms": at(ticks, 0.99),
            "max_ms": at(ticks, 1.0),
            "store_p99_ms": at(store_ticks, 0.99),
            "store_max_ms": at(store_ticks, 1.0),
            "long": long,
            "long_store_calls": long_calls,
            "unresponsive": self.unresponsive.take(),
            "store_on_loop_s": sum(by_call.values()),
            "store_on_loop_by_call_s": by_call,
            # per call: how many on the loop, and the p99 and longest of one (ms)
            "store_calls": {
                name: [len(xs), at(sorted(xs), 0.99), 1000 * max(xs)] for name, xs in call_times.items()
            },
            "side_sends": [len(sends), sum(s[2] for s in sends)],
            "side_sends_read_again": [len(read_again), sum(s[2] for s in read_again)],
        }
        return out

    def close(self):
        self.pc.stop()
        self.unresponsive.close()


class _Counting(logging.Handler):
    """Counts the records of the logger ``name`` whose message contains ``text`` (attached while
    open)."""

    def __init__(self, name: str, text: str, level: int):
        super().__init__(level=level)
        self.text, self.count = text, 0
        self.logger = logging.getLogger(name)
        self.logger.addHandler(self)

    def emit(self, record):
        if self.text in str(record.msg):
            self.count += 1

    def take(self) -> int:
        """The count since the last call."""
        n, self.count = self.count, 0
        return n

    def close(self):
        self.logger.removeHandler(self)
        super().close()


def _run_queue_seconds() -> float:
    """Seconds the calling thread has waited for a core (its run-queue delay), or 0 where the
    kernel does not say."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def _on_disk(data, key) -> bool:
    """Whether ``key``'s value is on disk only in either store (a read of it reads the disk)."""
    try:
        tier = getattr(data, "tier_if_present", None)
        if tier is not None:
            # (a value the plugin serves a reply with is not read by the store)
            received = sys.modules["spillway.received"]
            return data.peers.served(key) is received.NOT_SERVED and tier(key) == "disk"
        return key in data.slow and key not in data.fast
    except Exception:
        return False


def _malloc_info() -> dict:
    """glibc's heap: bytes in use in its arenas (``uordblks``), free but kept (``fordblks``), and in
    use in chunks of their own mapping (``hblkhd``). Empty where glibc lacks ``mallinfo2``."""
    names = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks")
    names += ("fordblks", "keepcost")

    class Mallinfo2(ctypes.Structure):  # built here: the plugin is pickled by value
        _fields_ = [(name, ctypes.c_size_t) for name in names]

    try:
        libc = ctypes.CDLL(None)
        libc.mallinfo2.restype = Mallinfo2
        m = libc.mallinfo2()
    except (AttributeError, OSError):
        return {}
    return {"heap_used": m.uordblks, "heap_free": m.fordblks, "mmapped": m.hblkhd}


def _fine_seconds(worker) -> dict:
    """dask's fine performance metrics of this worker so far, in seconds, by "context activity"
    (e.g. "execute thread-cpu", "get-data disk-read", "memory-monitor disk-write"): where its time
    went, as dask itself measures it for any store."""
    out: dict = {}
    for key, value in list(worker.digests_total.items()):
        if isinstance(key, tuple) and len(key) >= 3 and key[-1] == "seconds":
            name = f"{key[0]} {key[-2]}"
            out[name] = out.get(name, 0.0) + value
    return out


def _alive_spilled(data) -> int:
    """Bytes (sizeof) of spilled objects still alive elsewhere (the stores' weak caches)."""
    from dask.sizeof import sizeof

    try:
        weak = getattr(data, "_weak", None)
        if weak is not None:
            objs = [r() for r in list(weak._refs.values())]
        else:
            objs = list(data.slow.cache.values())
        return sum(sizeof(o) for o in objs if o is not None)
    except Exception:
        return -1


def _bytes_received(keys, dask_worker) -> int:
    """Bytes of these keys (their ``str``) that the worker received from peers, as its transfer log
    has them (its latest entries)."""
    keys = set(keys)
    log = dask_worker.transfer_incoming_log
    return sum(n for e in list(log) for k, n in e["keys"].items() if str(k) in keys)


def _quoted(address: str) -> str:
    import urllib.parse

    return urllib.parse.quote(address, safe="")


def _serial(stats: dict, before: dict, closed_dir: str) -> dict:
    """{worker: [serializations, deserializations]} from a phase's collected ``stats``, with the
    workers of ``before`` that are gone now read from what they wrote at their close."""
    out = {w: s["serial"] for w, s in stats.items() if s.get("serial") is not None}
    for w in before:
        path = os.path.join(closed_dir, _quoted(w))
        if w not in out and os.path.exists(path):
            with open(path) as f:
                out[w] = json.load(f)
    return out


def _worker_cpu(dask_worker) -> list:
    """[user, system] CPU seconds of this worker process since it started."""
    import psutil

    times = psutil.Process().cpu_times()
    return [times.user, times.system]


def _collect(dask_worker):
    plugin = dask_worker.plugins.get(MemorySampler.name)
    return None if plugin is None else plugin.collect()


def _backend(dask_worker):
    log = getattr(dask_worker.data, "log", None)
    return getattr(log, "backend", "") if log is not None else ""


# --------------------------------------------------------------------------------------------------
# In this process


class Watch:
    """Samples every worker process's RSS (50 ms) and the scheduler's unmanaged-memory figures, and
    counts worker processes and the nanny's memory kills, while a cluster runs."""

    def __init__(self, cluster):
        import psutil

        self.psutil = psutil
        self.cluster = cluster
        self.pids: dict = {}  # nanny name -> set of worker pids seen
        self.rss: dict = {}  # nanny name -> peak rss over all its workers
        self.unmanaged: list = []
        self.kills = 0
        self.stop = threading.Event()
        self.handler = _CountKills(self)
        logging.getLogger("distributed.nanny").addHandler(self.handler)
        self.thread = threading.Thread(target=self.loop, name="cluster-bench-watch", daemon=True)
        self.thread.start()

    def loop(self):
        procs: dict = {}
        last_heartbeat = {}
        while not self.stop.wait(0.05):
            for name, nanny in list(self.cluster.workers.items()):
                pid = getattr(getattr(nanny, "process", None), "pid", None)
                if pid is None:
                    continue
                self.pids.setdefault(name, set()).add(pid)
                try:
                    proc = procs.get(pid) or procs.setdefault(pid, self.psutil.Process(pid))
                    rss = proc.memory_info().rss
                except Exception:  # gone between the two calls
                    continue
                self.rss[name] = max(self.rss.get(name, 0), rss)
            scheduler = self.cluster.scheduler
            for addr, ws in list(getattr(scheduler, "workers", {}).items()):
                seen = getattr(ws, "last_seen", None)
                if seen is not None and last_heartbeat.get(addr) != seen:
                    last_heartbeat[addr] = seen
                    with contextlib.suppress(Exception):
                        self.unmanaged.append(int(ws.memory.unmanaged))

    def close(self):
        self.stop.set()
        self.thread.join()
        logging.getLogger("distributed.nanny").removeHandler(self.handler)

    @property
    def restarts(self) -> int:
        return sum(len(p) - 1 for p in self.pids.values())


class _CountKills(logging.Handler):
    def __init__(self, watch):
        super().__init__(level=logging.WARNING)
        self.watch = watch

    def emit(self, record):
        if "memory budget" in str(record.getMessage()):
            self.watch.kills += 1


def _digest(value) -> str:
    """A digest of a phase's result that two runs share exactly when the results are identical."""
    import numpy as np

    if isinstance(value, np.ndarray):
        data = value.dtype.str.encode() + repr(value.shape).encode() + value.tobytes()
    else:
        data = repr(value).encode()
    return hashlib.blake2b(data, digest_size=12).hexdigest()


def _cluster(store: str, size: Size, local_directory: str, threads: int = 1, net: str | None = None):
    from distributed import LocalCluster

    import spillway

    if net:
        from netns import NetCluster

        return NetCluster(
            size.workers, size.memory_limit, store, net, local_directory, threads, (SERIAL_COUNTS,)
        )

    kwargs = {}
    if store == "baseline":
        import cluster_bench_baseline

        kwargs["data"] = (cluster_bench_baseline.worker_data, {"memory_limit": size.memory_limit})
    elif store.startswith("spillway"):
        # Built as dask builds its own: the worker's directory, target = memory_limit * target
        # fraction, max_spill from the config (False by default).
        kwargs["data"] = (spillway.worker_data, {"memory_limit": size.memory_limit})
    return LocalCluster(
        n_workers=size.workers,
        threads_per_worker=threads,
        processes=True,
        memory_limit=size.memory_limit,
        dashboard_address=None,
        local_directory=local_directory,
        **kwargs,
    )


def _config(size: Size):
    import dask

    return dask.config.set(
        {
            "array.chunk-size": size.array_chunk_size,
            "array.rechunk.method": "tasks",
            # "shuffle-objects" has a column of Python objects: keep it one (not strings).
            "dataframe.convert-string": False,
            "dataframe.shuffle.method": "tasks",
            # The defaults, spelled out: this harness is about them.
            "distributed.worker.memory.target": 0.6,
            "distributed.worker.memory.spill": 0.7,
            "distributed.worker.memory.pause": 0.8,
            "distributed.worker.memory.terminate": 0.95,
            # Counts each worker's (de)serializations, whatever the store (see serial_counts.py).
            "distributed.worker.preload": [SERIAL_COUNTS],
        }
    )


def _chunk_crcs(array):
    """A dask array of the crc32 of the bytes of each chunk of ``array``."""
    import zlib

    import numpy as np

    return array.map_blocks(
        lambda b: np.full((1,) * b.ndim, zlib.crc32(np.ascontiguousarray(b)), dtype="u4"),
        dtype="u4",
        chunks=tuple((1,) * len(c) for c in array.chunks),
    )


class Graphs:
    """The workload's collections, built the same way for the cluster and for a reference computed
    without one."""

    def __init__(self, size: Size):
        self.size = size
        self.n = int((size.array_bytes // 8) ** 0.5)
        self.side = int((size.chunk_bytes // 8) ** 0.5)  # square chunks of about chunk_bytes

    def x(self):
        import dask.array as da

        return da.random.default_rng(0).random((self.n, self.n), chunks=self.side)

    def y(self):
        import dask.array as da

        m = int((self.size.transfer_bytes // 8) ** 0.5)
        return da.random.default_rng(2).random((m, m), chunks=self.side // 2)

    def frame(self):
        import dask.array as da
        import dask.dataframe as dd

        rows = self.size.frame_bytes // (8 * 4)
        arr = da.random.default_rng(1).random((rows, 4), chunks=(rows // self.partitions, 4))
        df = dd.from_dask_array(arr, columns=["a", "b", "c", "d"])
        df["key"] = (df["a"] * 1000).astype("int64")
        return df

    @property
    def partitions(self) -> int:
        return max(2, self.size.frame_bytes // (16 * MiB))


def _forward_reference(size: Size) -> list:
    import counted

    return [
        counted.digest(counted.make(i, size.forward_bytes))
        for i in range(size.forward_values)
        for _ in range(2)
    ]


def _shuffle_objects_reference(size: Size) -> tuple:
    import counted

    n = (size.object_rows // 16) * 16
    return n, sum(counted.digest(counted.make(i, 1024)) for i in range(n))


def _rows_and_key_sum(df) -> tuple:
    """What a shuffle keeps of a dataframe (computed in this process)."""
    return len(df), int(df["key"].sum().compute())


def reference(size: Size, phases=WORKLOADS["memory"]) -> dict:
    """Each phase's result computed in this process with dask's threaded scheduler (the shuffle's by
    what a shuffle keeps: the number of rows and the sum of its key column)."""
    import dask
    import dask.core

    g = Graphs(size)
    x = g.x()
    out = {}
    with _config(size), dask.config.set(scheduler="threads"):
        table = {
            "persist": lambda: x.chunks,
            "transpose-sum": lambda: (x + x.T).sum().compute(),
            "rechunk": lambda: x.rechunk((g.n, 128)).sum(0).compute(),
            "shuffle": lambda: _rows_and_key_sum(g.frame()),
            "transfer": lambda: _chunk_crcs(g.y()).compute(),
            "replicate": lambda: (len(list(dask.core.flatten(g.y().__dask_keys__()))), size.workers),
            "retire": lambda: _chunk_crcs(x).compute(),
            "forward": lambda: _forward_reference(size),
            "shuffle-objects": lambda: _shuffle_objects_reference(size),
        }
        for name in phases:
            out[name] = table[name]()
    return out


def _keys_per_worker(client, collection) -> dict:
    out: dict = {}
    for key, workers in client.who_has(collection).items():
        for w in workers:
            out.setdefault(w, set()).add(key)
    return out


def _moved(before: dict, after: dict) -> int:
    """Keys held by a worker after that it did not hold before."""
    return sum(len(keys - before.get(w, set())) for w, keys in after.items())


def _phases(client, size: Size, phases, notes: dict):
    """Yield (phase name, a function running it that returns its result); the functions record
    what they observe besides their result in ``notes``."""
    import dask.core
    from distributed import wait

    g = Graphs(size)
    state = {}

    def result(collection):
        return client.compute(collection).result(timeout=PHASE_TIMEOUT)

    def persist():
        state["x"] = client.persist(g.x())
        wait(state["x"], timeout=PHASE_TIMEOUT)
        return state["x"].chunks

    def x():
        if "x" not in state:
            persist()
        return state["x"]

    def transpose_sum():
        a = x()
        return result((a + a.T).sum())

    def rechunk():
        return result(x().rechunk((g.n, 128)).sum(0))

    def shuffle():
        shuffled = client.persist(g.frame().shuffle("key", npartitions=g.partitions))
        wait(shuffled, timeout=PHASE_TIMEOUT)
        out = (len(shuffled), int(result(shuffled["key"].sum())))
        del shuffled
        return out

    def transfer():
        workers = sorted(client.scheduler_info()["workers"])
        y = client.persist(g.y(), workers=workers[:1])
        wait(y, timeout=PHASE_TIMEOUT)
        # Tasks on the other worker need every chunk: each is fetched from the first (a spilled one
        # read back from its disk first). The result is the bytes of every chunk: a float sum
        # depends on the alignment of the buffers it adds up (numpy's pairwise sum), and data
        # received from a peer lands in buffers the comm allocates.
        crcs = client.compute(_chunk_crcs(y), workers=workers[-1:], allow_other_workers=False)
        out = crcs.result(timeout=PHASE_TIMEOUT)
        keys = [str(k) for k in dask.core.flatten(y.__dask_keys__())]
        got = client.run(_bytes_received, keys, workers=workers[-1:])
        notes["transfer received bytes"] = sum(got.values())
        del y, crcs
        return out

    def replicate():
        from distributed import futures_of

        workers = sorted(client.scheduler_info()["workers"])
        y = client.persist(g.y(), workers=workers[:1])
        wait(y, timeout=PHASE_TIMEOUT)
        futures = futures_of(y)
        # A copy of every chunk on every worker, which no task there uses.
        client.replicate(futures, n=len(workers))
        copies = client.who_has(futures)
        # (dask's Worker.gather, which replicate uses, leaves no entry in the transfer logs)
        notes["replicate moved keys"] = sum(len(w) - 1 for w in copies.values())
        out = (len(futures), min(len(w) for w in copies.values()))
        del y, futures
        return out

    def retire():
        a = x()
        workers = sorted(client.scheduler_info()["workers"])
        if len(workers) > 1:
            before = _keys_per_worker(client, a)
            client.sync(
                client.scheduler.retire_workers,
                workers=workers[:1],
                close_workers=True,
                callback_timeout=PHASE_TIMEOUT,
            )
            notes["retire moved keys"] = _moved(before, _keys_per_worker(client, a))
        return result(_chunk_crcs(a))  # (see transfer)

    def forward():
        return _forward(client, size, notes)

    def shuffle_objects():
        return _shuffle_objects(client, size, notes)

    def big_move():
        return _big_move(client, size, notes)

    table = {
        "persist": persist,
        "transpose-sum": transpose_sum,
        "rechunk": rechunk,
        "shuffle": shuffle,
        "transfer": transfer,
        "replicate": replicate,
        "retire": retire,
        "forward": forward,
        "shuffle-objects": shuffle_objects,
        "big-move": big_move,
    }
    for name in phases:
        yield name, table[name]


def _counts(client, workers) -> dict:
    import counted

    return client.run(counted.counts, workers=workers)


def _rss_now(dask_worker) -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _forward(client, size: Size, notes: dict):
    """Values of a Python type that counts its pickles and unpickles (``counted.Counted``, not
    numpy) are made on one worker, which spills most of them; the worker is retired (its data moves
    to the other; it stays up, and known, to be asked its counts), then two tasks per value on the
    other use each value. Notes: per worker and step, the pickles and unpickles; the sender's RSS
    growth during the move; the move's time. The result is what the tasks computed."""
    import counted
    from distributed import wait

    workers = sorted(client.scheduler_info()["workers"])
    sender, receiver = workers[0], workers[-1]
    values = [
        client.submit(counted.make, i, size.forward_bytes, key=f"counted-{i}", workers=[sender])
        for i in range(size.forward_values)
    ]
    wait(values, timeout=PHASE_TIMEOUT)
    before = _counts(client, workers)
    rss = client.run(_rss_now, workers=[sender])[sender]
    client.run(_collect, workers=[sender])  # restart the peak
    t0 = time.perf_counter()
    client.sync(
        client.scheduler.retire_workers,
        workers=[sender],
        close_workers=False,
        remove=False,  # still known to the scheduler: it can be asked its counts
        callback_timeout=PHASE_TIMEOUT,
    )
    notes["forward move seconds"] = time.perf_counter() - t0
    peak = client.run(_collect, workers=[sender])[sender]
    notes["forward sender rss growth"] = (peak or {}).get("rss", rss) - rss
    moved = _counts(client, workers)
    uses = [
        client.submit(counted.digest, v, key=f"use-{j}-{i}", workers=[receiver], pure=False)
        for i, v in enumerate(values)
        for j in range(2)
    ]
    out = client.gather(uses)
    used = _counts(client, workers)
    for name, a, b in (("move", before, moved), ("use", moved, used)):
        for role, w in (("sender", sender), ("receiver", receiver)):
            notes[f"forward {name} {role} pickles"] = b[w][0] - a[w][0]
            notes[f"forward {name} {role} unpickles"] = b[w][1] - a[w][1]
    notes["forward values"] = len(values)
    del values, uses
    return out


def _random_bytes(seed: int, nbytes: int):
    import numpy as np

    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def _spill_all(dask_worker) -> int:
    """Spill every value of the worker's store (dask's and spillway's both have ``evict``; dask's
    raises KeyError once nothing is left in memory)."""
    data = dask_worker.data
    while len(data.fast):
        try:
            if data.evict() <= 0:
                break
        except KeyError:
            break
    return len(data.slow)


def _crc(a) -> int:
    import zlib

    return zlib.crc32(memoryview(a).cast("B"))


def _big_move(client, size: Size, notes: dict):
    """``big_values`` arrays of ``big_bytes`` are made on one worker and all spilled; the other
    worker fills its memory with ``big_filler`` bytes of small arrays (so that it receives over
    its target); the first is retired (its data moves to the other, it stays up). Notes: the
    move's time, both workers' peak RSS growth during it (from their 50 ms samplers), and the
    values spilled before it. The result: the crc of each value, read on the receiver."""
    from distributed import wait

    workers = sorted(client.scheduler_info()["workers"])
    sender, receiver = workers[0], workers[-1]
    values = []
    for i in range(size.big_values):  # one at a time: two being made at once would not fit
        values.append(
            client.submit(_random_bytes, i, size.big_bytes, key=f"big-{i}", workers=[sender])
        )
        wait(values[-1], timeout=PHASE_TIMEOUT)
    fill = 16 * MiB
    filler = [
        client.submit(_random_bytes, 10_000 + i, fill, key=f"filler-{i}", workers=[receiver])
        for i in range(size.big_filler // fill)
    ]
    wait(filler, timeout=PHASE_TIMEOUT)
    notes["big spilled values"] = client.run(_spill_all, workers=[sender])[sender]
    rss = client.run(_rss_now, workers=[sender, receiver])
    client.run(_collect, workers=[sender, receiver])  # restart the peaks
    t0 = time.perf_counter()
    client.sync(
        client.scheduler.retire_workers,
        workers=[sender],
        close_workers=False,
        remove=False,
        callback_timeout=PHASE_TIMEOUT,
    )
    notes["big move seconds"] = time.perf_counter() - t0
    peaks = client.run(_collect, workers=[sender, receiver])
    for role, w in (("sender", sender), ("receiver", receiver)):
        notes[f"big {role} rss growth"] = (peaks[w] or {}).get("rss", rss[w]) - rss[w]
    crcs = [client.submit(_crc, v, workers=[receiver], pure=False) for v in values]
    out = client.gather(crcs)
    del values, filler, crcs
    return out


def _shuffle_objects(client, size: Size, notes: dict):
    """A dataframe with a column of ``counted.Counted`` objects (1 KiB each), shuffled by tasks
    and persisted: every piece that crosses workers is pickled and unpickled as its objects
    count. Notes: the pickles and unpickles of all workers. The result: rows and the sum of the
    objects' crcs."""
    import dask.dataframe as dd
    import pandas as pd

    import counted
    from distributed import wait

    workers = sorted(client.scheduler_info()["workers"])
    parts = 16
    rows = size.object_rows // parts

    def part(i):
        import counted as c

        return pd.DataFrame(
            {
                "key": [(i * rows + r) % 997 for r in range(rows)],
                "payload": [c.make(i * rows + r, 1024) for r in range(rows)],
            }
        )

    meta = pd.DataFrame(
        {"key": pd.Series([], dtype="int64"), "payload": pd.Series([], dtype=object)}
    )
    df = dd.from_delayed([client.submit(part, i, pure=False) for i in range(parts)], meta=meta)
    before = _counts(client, workers)
    shuffled = client.persist(df.shuffle("key", npartitions=parts))
    wait(shuffled, timeout=PHASE_TIMEOUT)
    out = client.compute(
        shuffled["payload"].map(counted.digest, meta=("payload", "int64")).sum()
    ).result(timeout=PHASE_TIMEOUT)
    after = _counts(client, workers)
    notes["shuffle-objects pickles"] = sum(after[w][0] - before[w][0] for w in workers)
    notes["shuffle-objects unpickles"] = sum(after[w][1] - before[w][1] for w in workers)
    notes["shuffle-objects rows"] = parts * rows
    rows_out = len(shuffled)
    del shuffled
    return rows_out, int(out)


def run_one(
    store: str,
    size: Size,
    run: int = 0,
    phases=WORKLOADS["memory"],
    directory: str | None = None,
    threads: int = 1,
    net: str | None = None,
):
    """One store's run of the phases on a fresh cluster of ``size.workers`` workers with ``threads``
    threads each (with ``net``, a rate: ``dask worker`` processes in network namespaces whose
    links are limited to it, ``netns.py``). Never raises for a failed phase: the result says what
    failed."""
    import tempfile

    import cloudpickle
    import psutil
    from distributed import Client

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    result = RunResult(store=store, run=run)
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(
            tempfile.TemporaryDirectory(prefix="cluster-bench-", dir=directory)
        )
        stack.enter_context(_config(size))
        cluster = stack.enter_context(_cluster(store, size, tmp, threads, net))
        client = stack.enter_context(Client(cluster.scheduler_address if net else cluster))
        closed_dir = os.path.join(tmp, "closed-workers")
        os.makedirs(closed_dir)
        client.register_plugin(MemorySampler(closed_dir), name=MemorySampler.name)
        # (The CLI workers of --net get the plugin from their preload, as users' do.)
        if store in ("spillway+plugin", "spillway+inband", "spillway+plugin-loop") and not net:
            import spillway.dask

            settings = {"side_channel": store != "spillway+inband"}
            if store == "spillway+plugin-loop":
                settings.update(loop_read_max_bytes=1 << 62, spill_off_loop=False)
            client.register_plugin(spillway.dask.SpillwayPlugin(**settings))
        watch = Watch(cluster)
        stack.callback(watch.close)
        result.backend = ",".join(sorted({b for b in client.run(_backend).values() if b}))
        try:
            for name, phase in _phases(client, size, phases, result.notes):
                workers0 = client.run(_worker_cpu)
                cpu0 = psutil.cpu_times()
                t0 = time.perf_counter()
                wire0 = cluster.link_bytes() if net else 0
                value = phase()
                result.phase_seconds[name] = time.perf_counter() - t0
                result.cpu[name] = _cpu_spent(cpu0, psutil.cpu_times())
                if net:
                    result.link_bytes[name] = cluster.link_bytes() - wire0
                result.results[name] = _digest(value)
                result.values[name] = value
                result.worker_stats[name] = {
                    w: s for w, s in client.run(_collect).items() if s is not None
                }
                result.worker_cpu[name] = [
                    sum(
                        s["cpu"][i] - workers0.get(w, (0.0, 0.0))[i]
                        for w, s in result.worker_stats[name].items()
                        if s.get("cpu")
                    )
                    for i in (0, 1)
                ]
                previous = list(result.serial.values())[-1] if result.serial else {}
                result.serial[name] = _serial(result.worker_stats[name], previous, closed_dir)
            result.completed = True
        except Exception as error:  # a failed phase (KilledWorker, timeout, ...) ends the run
            result.error = f"{type(error).__name__}: {error}"[:500]
        watch.close()
        result.restarts = watch.restarts
        result.nanny_kills = watch.kills + (cluster.kills() if net else 0)
        result.peak_rss = [watch.rss[k] for k in sorted(watch.rss)]
        result.unmanaged = watch.unmanaged
    return result


def _cpu_spent(before, after) -> dict:
    """The machine's CPU seconds between two ``psutil.cpu_times()``, by kind, with ``busy`` (all
    but idle and iowait), ``total`` and ``cores``."""
    out = {k: getattr(after, k) - getattr(before, k) for k in after._fields}
    out["total"] = sum(out.values())
    out["busy"] = out["total"] - out.get("idle", 0.0) - out.get("iowait", 0.0)
    out["cores"] = os.cpu_count() or 1
    return out


# --------------------------------------------------------------------------------------------------
# Report


def _short(v) -> str:
    if isinstance(v, float):
        return f"{v:.2f}"
    if isinstance(v, int) and abs(v) >= MiB:
        return f"{v / MiB:.0f}MiB"
    return str(v)


def _mib(n: float) -> str:
    return f"{n / MiB:.0f}"


def serial_by_phase(r: RunResult) -> dict:
    """phase -> [serializations, deserializations] in the phase, summed over the workers (a
    worker's count at the end of the phase less its count at the end of the previous one; a worker
    that started in the phase, a restarted one, from zero)."""
    out, before = {}, {}
    for phase, counts in r.serial.items():
        out[phase] = [
            sum(c[i] - before.get(w, (0, 0))[i] for w, c in counts.items()) for i in (0, 1)
        ]
        before = counts
    return out


def _loop_worst(r, phase: str, key: str) -> float:
    """The phase's loop statistic ``key`` of run ``r``: the worst worker's for tick times, the sum
    over the workers for counts and seconds."""
    loops = [s["loop"] for s in r.worker_stats.get(phase, {}).values() if s.get("loop", {}).get("ticks")]
    if not loops:
        return 0
    values = [x.get(key) or 0 for x in loops]
    return max(values) if key.endswith("_ms") else sum(values)


def _long_ticks(r, phase: str) -> dict:
    """cause -> [long ticks, their seconds] in the phase, summed over the workers (LoopWatch)."""
    out: dict = {}
    for s in r.worker_stats.get(phase, {}).values():
        for cause, (n, sec) in s.get("loop", {}).get("long", {}).items():
            entry = out.setdefault(cause, [0, 0.0])
            entry[0] += n
            entry[1] += sec
    return out


def doubts_by_phase(r) -> dict:
    """phase -> what answers the design's doubts, summed over the workers: bytes read from disk
    (dask's ``disk-read`` metric, both stores), values moved between workers and the unpickles in
    the phase (all workers, ``serial_counts``), side-channel sends from disk and those read back
    from disk by their sender within ``LoopWatch.READ_BACK_WINDOW`` (sends near a phase's end are
    judged in the next phase's collection)."""
    out: dict = {}
    before: dict = {}
    serial = serial_by_phase(r)
    for phase, stats in r.worker_stats.items():
        row = {"disk_read_bytes": 0, "moved": 0, "unpickles": serial.get(phase, [0, 0])[1]}
        row["side_sends"] = [0, 0]
        row["side_sends_read_again"] = [0, 0]
        for worker, st in stats.items():
            read = st.get("metrics", {}).get("disk-read bytes", 0)
            row["disk_read_bytes"] += read - before.get(worker, 0)
            before[worker] = read
            row["moved"] += st.get("received_keys", 0)
            loop = st.get("loop", {})
            for k in ("side_sends", "side_sends_read_again"):
                row[k] = [a + b for a, b in zip(row[k], loop.get(k, [0, 0]))]
        # Moves the transfer logs do not see, counted by the phase itself.
        row["moved"] = max(row["moved"], r.notes.get(f"{phase} moved keys", 0))
        out[phase] = row
    return out


def summarize(results: list) -> dict:
    """Per store: runs completed, restarts, peak RSS, over-target peaks, phase medians; and whether
    every phase's result was identical across all runs."""
    out = {"stores": {}, "identical": True, "phases": {}}
    digests: dict = {}
    for r in results:
        for phase, d in r.results.items():
            digests.setdefault(phase, set()).add(d)
    for phase, ds in digests.items():
        out["phases"][phase] = len(ds) == 1
        out["identical"] &= len(ds) == 1
    for store in dict.fromkeys(r.store for r in results):
        rs = [r for r in results if r.store == store]
        done = [r for r in rs if r.completed]
        over = [
            s.get("over_target", 0)
            for r in rs
            for stats in r.worker_stats.values()
            for s in stats.values()
        ]
        out["stores"][store] = {
            "runs": len(rs),
            "completed": len(done),
            "restarts": [r.restarts for r in rs],
            "peak_rss_mib": max((max(r.peak_rss, default=0) for r in rs), default=0) / MiB,
            "max_over_target_mib": max(over, default=0) / MiB,
            "median_seconds": statistics.median(r.total_seconds for r in done) if done else None,
            "phase_median_seconds": {
                p: statistics.median(r.phase_seconds[p] for r in done if p in r.phase_seconds)
                for p in (done[0].phase_seconds if done else {})
            },
            "phase_median_link_mib": {
                p: statistics.median(r.link_bytes[p] for r in done if p in r.link_bytes) / MiB
                for p in (done[0].link_bytes if done else {})
            },
            # CPU seconds over all the machine's cores, medians over the completed runs: busy
            # (every process), its share of the cores' time, and the workers' user and system.
            "phase_median_cpu": {
                p: {
                    "busy": statistics.median(r.cpu[p]["busy"] for r in done if p in r.cpu),
                    "busy_share": statistics.median(
                        r.cpu[p]["busy"] / max(r.cpu[p]["total"], 1e-9) for r in done if p in r.cpu
                    ),
                    "system": statistics.median(r.cpu[p]["system"] for r in done if p in r.cpu),
                    "workers_user": statistics.median(
                        r.worker_cpu[p][0] for r in done if p in r.worker_cpu
                    ),
                    "workers_system": statistics.median(
                        r.worker_cpu[p][1] for r in done if p in r.worker_cpu
                    ),
                }
                for p in (done[0].cpu if done else {})
                if all(p in r.cpu and p in r.worker_cpu for r in done)
            },
            # The event loop, per phase: medians over the completed runs of the worst worker's
            # p99 and longest tick (ms), the unresponsive messages summed over the workers, and
            # the store's time on the loops.
            "phase_loop": {
                p: {
                    k: statistics.median(_loop_worst(r, p, k) for r in done)
                    for k in (
                        "p99_ms",
                        "max_ms",
                        "store_p99_ms",
                        "store_max_ms",
                        "unresponsive",
                        "store_on_loop_s",
                    )
                }
                for p in (done[0].worker_stats if done else {})
                if all(_loop_worst(r, p, "ticks") for r in done)
            },
            # Long ticks by cause, per phase: medians over the completed runs of the count and the
            # seconds (all workers).
            "phase_long_ticks": {
                p: {
                    cause: [
                        statistics.median(_long_ticks(r, p).get(cause, [0, 0.0])[i] for r in done)
                        for i in (0, 1)
                    ]
                    for cause in ("store", "loop", "core", "gil")
                }
                for p in (done[0].worker_stats if done else {})
            },
            # The doubts' counters per phase, medians over the completed runs.
            "phase_doubts": {
                p: {
                    k: statistics.median(
                        (lambda v: v[0] if isinstance(v, list) else v)(doubts_by_phase(r)[p][k])
                        for r in done
                        if p in r.worker_stats
                    )
                    for k in ("disk_read_bytes", "moved", "unpickles", "side_sends", "side_sends_read_again")
                }
                for p in (done[0].worker_stats if done else {})
            },
            # Per worker of the run's start, medians over the completed runs.
            "phase_median_serial_per_worker": {
                p: [
                    statistics.median(
                        serial_by_phase(r)[p][i] / max(1, len(next(iter(r.serial.values()))))
                        for r in done
                        if p in r.serial
                    )
                    for i in (0, 1)
                ]
                for p in (done[0].serial if done else {})
            },
        }
    return out


def time_by_activity(results: list) -> dict:
    """phase -> store -> {"context activity": median over completed runs of the seconds summed over
    the workers} from dask's fine performance metrics, each phase's share (the difference from the
    previous phase's collection on the same worker)."""
    out: dict = {}
    for r in results:
        if not r.completed:
            continue
        before: dict = {}
        for phase, stats in r.worker_stats.items():
            total: dict = {}
            for worker, st in stats.items():
                prev = before.get(worker, {})
                for name, sec in st.get("time", {}).items():
                    total[name] = total.get(name, 0.0) + sec - prev.get(name, 0.0)
                before[worker] = st.get("time", {})
            out.setdefault(phase, {}).setdefault(r.store, []).append(total)
    return {
        phase: {
            store: {
                name: statistics.median(run.get(name, 0.0) for run in runs)
                for name in {n for run in runs for n in run}
            }
            for store, runs in by_store.items()
        }
        for phase, by_store in out.items()
    }


def report(results: list) -> str:
    lines = []
    phases = list(dict.fromkeys(p for r in results for p in r.phase_seconds))
    head = ["store", "run", "ok", "restarts", "kills", "peak RSS MiB (per worker)", "total s"]
    lines.append(" | ".join(head + [f"{p} s" for p in phases]))
    for r in results:
        row = [
            r.store + (f" ({r.backend})" if r.backend else ""),
            str(r.run),
            "yes" if r.completed else "NO",
            str(r.restarts),
            str(r.nanny_kills),
            "/".join(_mib(x) for x in r.peak_rss),
            f"{r.total_seconds:.1f}",
        ] + [f"{r.phase_seconds[p]:.1f}" if p in r.phase_seconds else "-" for p in phases]
        lines.append(" | ".join(row))
        if r.error:
            lines.append(f"    failed: {r.error[:200]}")
        for phase, stats in r.worker_stats.items():
            loops = [s["loop"] for s in stats.values() if s.get("loop", {}).get("ticks")]
            if loops:
                lines.append(
                    f"    {phase} loop (per worker: tick p50/p99/max ms, the store's part of a tick"
                    " p99/max ms, unresponsive, store s on the loop, long ticks by cause): "
                    + ", ".join(
                        f"{x['median_ms']:.0f}/{x['p99_ms']:.0f}/{x['max_ms']:.0f}"
                        f" {x.get('store_p99_ms') or 0:.0f}/{x.get('store_max_ms') or 0:.0f}"
                        f" {x['unresponsive']} {x['store_on_loop_s']:.2f}"
                        f" {' '.join(f'{c}:{n}' for c, (n, _) in sorted(x.get('long', {}).items()))}"
                        f" {' '.join(f'{c}:{n}' for c, n in sorted(x.get('long_store_calls', {}).items()))}"
                        for x in loops
                    )
                )
                lines.append(
                    f"    {phase} the store's calls on the loop (per worker, call: n p99/max ms): "
                    + ", ".join(
                        " ".join(
                            f"{c}:{n} {p99:.0f}/{mx:.0f}" for c, (n, p99, mx) in sorted(x.get("store_calls", {}).items())
                        )
                        for x in loops
                    )
                )
            inner = ", ".join(
                f"rss {_mib(s['rss'])} store {_mib(s['store_memory'])}/{_mib(s.get('target', 0))}"
                f" managed {_mib(s['managed'])} warn {s['unmanaged_warnings']}"
                + (
                    " [at peak: "
                    + " ".join(f"{k} {_mib(v)}" for k, v in s["at_peak"].items())
                    + "]"
                    if s.get("at_peak")
                    else ""
                )
                for s in stats.values()
            )
            lines.append(f"    {phase}: {inner}")
        if r.unmanaged:
            lines.append(
                f"    unmanaged (scheduler, MiB): median {_mib(statistics.median(r.unmanaged))}"
                f" max {_mib(max(r.unmanaged))} over {len(r.unmanaged)} heartbeats"
            )
        if r.serial:
            lines.append(
                "    serializations / deserializations (all workers): "
                + ", ".join(f"{p} {c[0]}/{c[1]}" for p, c in serial_by_phase(r).items())
            )
        if r.worker_stats:
            lines.append(
                "    doubts (disk read MiB, values moved, unpickles, side sends, read again): "
                + ", ".join(
                    f"{p} {_mib(d['disk_read_bytes'])} {d['moved']} {d['unpickles']}"
                    f" {d['side_sends'][0]} {d['side_sends_read_again'][0]}"
                    for p, d in doubts_by_phase(r).items()
                )
            )
        if r.notes:
            lines.append("    notes: " + ", ".join(f"{k} {_short(v)}" for k, v in r.notes.items()))
    s = summarize(results)
    lines.append("")
    lines.append(f"results identical across all runs and stores: {s['identical']} {s['phases']}")
    for store, st in s["stores"].items():
        lines.append(
            f"{store}: {st['completed']}/{st['runs']} completed, restarts {st['restarts']}, "
            f"peak RSS {st['peak_rss_mib']:.0f} MiB, store over target by at most "
            f"{st['max_over_target_mib']:.0f} MiB, median {st['median_seconds']} s"
        )
    stores = s["stores"]
    for other in [st for st in stores if st != "dask" and "dask" in stores]:
        a, b = stores["dask"]["median_seconds"], stores[other]["median_seconds"]
        if a and b:
            lines.append(f"{other} speed-up (median total time, dask / {other}): {a / b:.2f}x")
            for p, t in stores[other]["phase_median_seconds"].items():
                d = stores["dask"]["phase_median_seconds"].get(p)
                if d:
                    wire = stores[other]["phase_median_link_mib"].get(p)
                    dwire = stores["dask"]["phase_median_link_mib"].get(p)
                    moved = f", over the links {dwire:.0f} / {wire:.0f} MiB" if wire is not None else ""
                    lines.append(f"    {p}: dask {d:.1f} s, {other} {t:.1f} s, {d / t:.2f}x{moved}")
    cores = next((c["cores"] for r in results for c in r.cpu.values()), None)
    if cores is not None:
        lines.append("")
        lines.append(
            f"CPU per phase (s over the machine's {cores} cores, median of runs): busy (its share"
            " of the cores' time; system part) = workers user + system + the rest (scheduler,"
            " client, kernel threads)"
        )
    for p in phases if cores is not None else ():
        cells = []
        for store, st in stores.items():
            c = st.get("phase_median_cpu", {}).get(p)
            if c:
                rest = c["busy"] - c["workers_user"] - c["workers_system"]
                cells.append(
                    f"{store} {c['busy']:.1f} ({c['busy_share']:.0%}; sys {c['system']:.1f})"
                    f" = {c['workers_user']:.1f} + {c['workers_system']:.1f} + {rest:.1f}"
                )
        if cells:
            lines.append(f"    {p}: " + ", ".join(cells))
    if any(st.get("phase_loop") for st in stores.values()):
        lines.append("")
        lines.append(
            "event loop per phase (median of runs): the worst worker's tick p99 / longest tick (ms),"
            " the store's part of a tick p99 / longest (ms), 'unresponsive' messages, seconds inside"
            " the store's calls on the loops (all workers), and ticks over"
            f" {LoopWatch.LONG * 1000:.0f} ms by cause (store, loop, core, gil)"
        )
        for p in phases:
            cells = []
            for store, st in stores.items():
                x = st.get("phase_loop", {}).get(p)
                if not x:
                    continue
                causes = st.get("phase_long_ticks", {}).get(p, {})
                cells.append(
                    f"{store} {x['p99_ms']:.0f} / {x['max_ms']:.0f} ms, store"
                    f" {x['store_p99_ms']:.0f} / {x['store_max_ms']:.0f} ms,"
                    f" {x['unresponsive']:.0f}, {x['store_on_loop_s']:.2f} s, long "
                    + "/".join(f"{causes.get(c, [0])[0]:.0f}" for c in ("store", "loop", "core", "gil"))
                )
            if cells:
                lines.append(f"    {p}: " + "; ".join(cells))
    if any(st.get("phase_doubts") for st in stores.values()):
        lines.append("")
        lines.append(
            "doubts per phase (median of runs, all workers): MiB read from disk, values moved"
            " between workers, unpickles, side-channel sends from disk, of them read back from disk"
            f" by their sender within {LoopWatch.READ_BACK_WINDOW:.0f} s"
        )
        for p in phases:
            cells = [
                f"{store} {_mib(d['disk_read_bytes'])} MiB, {d['moved']:.0f} moved,"
                f" {d['unpickles']:.0f} unpickles, {d['side_sends']:.0f} sent /"
                f" {d['side_sends_read_again']:.0f} read again"
                for store, st in stores.items()
                if (d := st.get("phase_doubts", {}).get(p))
            ]
            if cells:
                lines.append(f"    {p}: " + "; ".join(cells))
    lines.append("")
    lines.append("serializations / deserializations per worker (median of runs):")
    for store, st in stores.items():
        cells = ", ".join(
            f"{p} {c[0]:.0f}/{c[1]:.0f}" for p, c in st["phase_median_serial_per_worker"].items()
        )
        lines.append(f"    {store}: {cells or '-'}")
    by_activity = time_by_activity(results)
    if by_activity:
        lines.append("")
        lines.append(
            "where the time goes (dask's fine metrics, s, summed over workers, median of runs):"
        )
        for phase, by_store in by_activity.items():
            names = sorted(
                {n for t in by_store.values() for n in t},
                key=lambda n: -max(t.get(n, 0.0) for t in by_store.values()),
            )[:8]
            lines.append(f"  {phase}:")
            for n in names:
                cells = ", ".join(f"{st} {t.get(n, 0.0):.2f}" for st, t in by_store.items())
                lines.append(f"    {n:28} {cells}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size", choices=sorted(SIZES), default="full")
    p.add_argument("--runs", type=int, default=5, help="runs per store (default 5)")
    p.add_argument(
        "--workload",
        choices=sorted(WORKLOADS),
        default="memory",
        help="memory: the tight-memory phases, dask's store against spillway's (1 thread per "
        "worker); forward: values moved between workers, also with the spillway.dask plugin "
        "(2 threads per worker, so that two tasks can ask for a value at once); big: large "
        "spilled values moved to a peer over its target, dask against the plugin in-band and "
        "by its side channel; moved: values moved between workers and used there at once "
        "(transfer) or never (replicate)",
    )
    p.add_argument("--stores", default=None, help=f"comma-separated, of {','.join(STORES)}")
    p.add_argument("--phases", default=None, help="comma-separated subset, in order")
    p.add_argument(
        "--dir", default=None, help="where the workers' directories go (default: $TMPDIR)"
    )
    p.add_argument("--json", default=None, help="write every run's raw result here")
    p.add_argument(
        "--workers",
        default=None,
        help="comma-separated worker counts (e.g. 2,4,8), each run in turn; the data grows with "
        "the count (the size's array and dataframe are for its own workers), so every worker "
        "holds and spills as much as in the size itself",
    )
    p.add_argument(
        "--net",
        metavar="RATE",
        default=None,
        help="run `dask worker` processes in network namespaces, each link limited to RATE (tc's "
        "syntax: 1gbit, 100mbit; needs root; netns.py) instead of a LocalCluster on loopback",
    )
    p.add_argument("--plot", metavar="FILE", default=None, help="with --workers: a plot of the "
                   "speed-ups by worker count (needs matplotlib)")
    p.add_argument("--replot", metavar="JSON", default=None, help="no runs: --plot (and the "
                   "scaling table) from the --json of an earlier run with --workers")
    p.add_argument(
        "--baseline",
        metavar="FILE",
        help="another build's buffer.py (git show REV:python/spillway/buffer.py > FILE): the "
        "'baseline' store, added to the stores",
    )
    args = p.parse_args(argv)
    if args.replot:
        with open(args.replot) as f:
            summaries = {int(n): v["summary"] for n, v in json.load(f).items()}
        print(scaling_table(summaries))
        if args.plot:
            plot_scaling(summaries, args.plot, args.net)
        return 0
    default_stores = {
        "forward": ("dask", "spillway", "spillway+plugin"),
        "big": ("dask", "spillway+inband", "spillway+plugin"),
    }.get(args.workload, ("dask", "spillway"))
    stores = args.stores.split(",") if args.stores else list(default_stores)
    if args.baseline:
        _install_baseline(args.baseline)
        if "baseline" not in stores:
            stores.append("baseline")
    elif "baseline" in stores:
        p.error("the baseline store needs --baseline FILE")
    phases = args.phases.split(",") if args.phases else list(WORKLOADS[args.workload])
    threads = 2 if args.workload == "forward" else 1
    for x in stores:
        if x not in STORES:
            p.error(f"unknown store {x!r}")
    for x in phases:
        if x not in PHASES:
            p.error(f"unknown phase {x!r}")
    base = SIZES[args.size]
    if args.workload == "big":
        base = dataclasses.replace(base, memory_limit=base.big_memory_limit)
    counts = [int(n) for n in args.workers.split(",")] if args.workers else [base.workers]
    ok = True
    by_count = {}
    for n in counts:
        size = scaled(base, n)
        print(
            f"size {args.size}: {size}; phases {phases}; {args.runs} runs per store, alternating"
            + (f"; links at {args.net}" if args.net else ""),
            flush=True,
        )
        results = []
        for run in range(args.runs):
            order = stores if run % 2 == 0 else stores[::-1]
            for store in order:
                r = run_one(store, size, run, phases, args.dir, threads, args.net)
                results.append(r)
                print(report([r]).split("\n\n")[0], flush=True)
        print()
        print(report(results))
        s = summarize(results)
        by_count[n] = {"size": asdict(size), "runs": results, "summary": s}
        spillway_done = all(r.completed for r in results if r.store.startswith("spillway"))
        ok &= s["identical"] and spillway_done
    if len(counts) > 1:
        print()
        print(scaling_table({n: v["summary"] for n, v in by_count.items()}))
    if args.json:
        with open(args.json, "w") as f:
            out = {
                n: dict(
                    v,
                    runs=[{k: x for k, x in asdict(r).items() if k != "values"} for r in v["runs"]],
                )
                for n, v in by_count.items()
            }
            json.dump(out if len(counts) > 1 else out[counts[0]], f, indent=1)
    if args.plot:
        plot_scaling({n: v["summary"] for n, v in by_count.items()}, args.plot, args.net)
    return 0 if ok else 1


def scaled(size: Size, workers: int) -> Size:
    """``size`` for ``workers`` workers: the array and the dataframe grow with the count, so each
    worker holds (and spills) as much as in ``size`` itself; what one worker sends another
    (``transfer_bytes``) stays."""
    if workers == size.workers:
        return size
    grow = workers / size.workers
    return dataclasses.replace(
        size,
        workers=workers,
        array_bytes=int(size.array_bytes * grow),
        frame_bytes=int(size.frame_bytes * grow),
    )


def scaling_table(summaries: dict) -> str:
    """Workers -> store: completed, restarts, median seconds, and the speed-up over dask's store
    (total and per phase)."""
    lines = [
        "workers | store | completed | restarts | median s | speed-up | per phase (dask / store)"
        " | (de)serializations per worker"
    ]
    for n, s in summaries.items():
        stores = s["stores"]
        dask = stores.get("dask", {})
        for store, st in stores.items():
            total = st["median_seconds"]
            ratio = (
                f"{dask['median_seconds'] / total:.2f}x"
                if store != "dask" and total and dask.get("median_seconds")
                else "-"
            )
            phases = ", ".join(
                f"{p} {dask['phase_median_seconds'][p] / t:.2f}x"
                for p, t in st["phase_median_seconds"].items()
                if store != "dask" and t and p in dask.get("phase_median_seconds", {})
            )
            serial = st.get("phase_median_serial_per_worker", {}).values()
            counts = (
                f"{sum(c[0] for c in serial):.0f} / {sum(c[1] for c in serial):.0f}" if serial else "-"
            )
            lines.append(
                f"{n} | {store} | {st['completed']}/{st['runs']} | {st['restarts']} | "
                f"{total if total is None else round(total, 1)} | {ratio} | {phases or '-'} | {counts}"
            )
    return "\n".join(lines)


def plot_scaling(summaries: dict, path: str, net: str | None) -> None:
    """Speed-up over dask's store by worker count, per store and per phase, to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = sorted(summaries)
    stores = [st for st in summaries[counts[0]]["stores"] if st != "dask"]
    phases = list(summaries[counts[0]]["stores"]["dask"]["phase_median_seconds"])
    fig, axes = plt.subplots(1, len(stores), figsize=(5 * len(stores), 4), squeeze=False)
    for ax, store in zip(axes[0], stores):
        def ratio(n, phase=None):
            d, o = summaries[n]["stores"]["dask"], summaries[n]["stores"][store]
            if phase is None:
                a, b = d["median_seconds"], o["median_seconds"]
            else:
                a, b = d["phase_median_seconds"].get(phase), o["phase_median_seconds"].get(phase)
            return a / b if a and b else float("nan")

        ax.plot(counts, [ratio(n) for n in counts], "k-o", linewidth=2.5, label="total")
        for phase in phases:
            ax.plot(counts, [ratio(n, phase) for n in counts], "--.", label=phase)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        for n in counts:  # where dask's store completed no run there is no ratio: say why
            d = summaries[n]["stores"]["dask"]
            if not d["median_seconds"]:
                ax.annotate(
                    f"dask's store: {d['completed']}/{d['runs']} runs completed,\n"
                    f"restarts {d['restarts']}; {store} {summaries[n]['stores'][store]['completed']}"
                    f"/{summaries[n]['stores'][store]['runs']}, restarts "
                    f"{summaries[n]['stores'][store]['restarts']}",
                    (n, 1.0), xytext=(0, 30), textcoords="offset points", ha="right", fontsize=7,
                    arrowprops={"arrowstyle": "->"},
                )
        ax.set_xticks(counts)
        ax.set_xlabel("workers")
        ax.set_ylabel("speed-up over dask's store (median time)")
        ax.set_title(store + (f", links at {net}" if net else ""))
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())
