"""A plugged worker's event loop is not held by the store: the spilling a set on the loop causes is
left to a thread of the store's own (bounded: past ``DEFER_SLACK`` the setter spills too), and a
task's inputs on disk are read off the loop past ``spillway.loop-read-max``. Shown on the buffer
and on a real cluster, against the plugin set to leave that work on the loop as stock dask does."""

from __future__ import annotations

import threading

import pytest

distributed = pytest.importorskip("distributed")

import dask  # noqa: E402
import spillway  # noqa: E402
import spillway.dask  # noqa: E402
import tracked  # noqa: E402  (worker processes import it by name: they inherit sys.path)
from spillway.buffer import DEFER_SLACK  # noqa: E402

MiB = 1 << 20


def _wait_for(condition, seconds: float = 30.0) -> None:
    """Poll ``condition`` until it holds (a bounded wait for another thread's work, not a timing)."""
    done = threading.Event()
    for _ in range(int(seconds / 0.01)):
        if condition():
            return
        done.wait(0.01)
    raise AssertionError("condition not met in time")


def _pickled_on(key_prefix: str = "") -> set:
    events = tracked.EVENTS
    return {name for event, key, name, _ in events if event == "pickle" and key.startswith(key_prefix)}


def test_a_set_that_defers_its_spilling_leaves_it_to_the_stores_thread(make_buffer):
    target = 16 * MiB
    buf = make_buffer(target=target, process_target=None, compression=None)
    tracked.EVENTS.clear()
    buf.defer_spills(threading.get_ident())
    # 18 MiB: over the target, within its slack: the set returns without spilling.
    for i in range(9):
        buf[f"a{i}"] = tracked.Tracked(f"a{i}", 2 * MiB)
    _wait_for(lambda: buf.fast.total_weight <= target and len(buf.slow) > 0)
    assert _pickled_on() == {"spillway-spiller"}, tracked.EVENTS
    assert all(buf[f"a{i}"].payload == bytearray(2 * MiB) for i in range(9))

    # Back to spilling on the setter's thread.
    buf.defer_spills(None)
    tracked.EVENTS.clear()
    for i in range(9):
        buf[f"b{i}"] = tracked.Tracked(f"b{i}", 2 * MiB)
    assert buf.fast.total_weight <= target * (1 + DEFER_SLACK)
    assert _pickled_on() == {threading.current_thread().name}, tracked.EVENTS


def test_a_setter_spills_itself_when_the_stores_thread_falls_behind(make_buffer):
    """The spilling thread is held (a value whose pickling waits); the sets go on past the slack:
    the setter then spills for itself."""
    target = 16 * MiB
    buf = make_buffer(target=target, process_target=None, compression=None)
    release = threading.Event()
    slow = _Slow(release)
    buf["slow"] = slow  # the least recently used: the spilling thread's first
    buf.defer_spills(threading.get_ident())
    tracked.EVENTS.clear()
    try:
        for i in range(8):  # 18 MiB: the spilling thread starts, on "slow"
            buf[f"c{i}"] = tracked.Tracked(f"c{i}", 2 * MiB)
        assert slow.pickling.wait(30), "the spilling thread never started"
        assert _pickled_on() == set(), tracked.EVENTS
        for i in range(8, 16):
            buf[f"c{i}"] = tracked.Tracked(f"c{i}", 2 * MiB)
        assert _pickled_on() == {threading.current_thread().name}, tracked.EVENTS
        # (without the setter's own spilling, all 17 values would be in memory)
        assert buf.fast.total_weight < 17 * 2 * MiB
    finally:
        release.set()
    _wait_for(lambda: buf.tier("slow") == "disk" and buf.fast.total_weight <= target)
    assert all(buf[f"c{i}"].payload == bytearray(2 * MiB) for i in range(16))


class _Slow:
    """A value whose pickling waits for ``release`` (it says when it started)."""

    def __init__(self, release: threading.Event):
        self.release = release
        self.pickling = threading.Event()

    def __sizeof__(self):
        return 2 * MiB

    def __reduce__(self):
        self.pickling.set()
        assert self.release.wait(60)
        return bytes, (b"slow",)


def test_closing_a_buffer_ends_its_spilling_thread(make_buffer):
    buf = make_buffer(target=4 * MiB, process_target=None)
    buf.defer_spills(threading.get_ident())
    thread = buf._spiller._thread
    buf.close()
    thread.join(10)
    assert not thread.is_alive()


def _status(dask_worker):
    return spillway.dask.status(dask_worker)


def _cluster(memory_limit="512MiB"):
    """One Nanny worker on spillway and its plugin, turned on as users do."""
    return distributed.LocalCluster(
        n_workers=1,
        threads_per_worker=1,
        memory_limit=memory_limit,
        dashboard_address=None,
        preload_nanny=["spillway.dask"],
    )


@pytest.mark.parametrize("off_loop", [True, False])
def test_a_plugged_workers_loop_neither_spills_nor_reads_inputs_from_disk(off_loop):
    """Values set on the worker's event loop (task results) past its target are spilled off the
    loop; a task's inputs on disk (more than ``loop-read-max`` of them) are read off the loop
    (dask's memory monitor, which spills on the loop, is off: only the target spills). With
    ``spill-off-loop: False`` and ``loop-read-max: null``, both happen on the loop, as on stock
    dask."""
    settings = {
        "distributed.worker.memory.spill": False,
        "distributed.worker.memory.pause": False,
        "distributed.worker.memory.terminate": False,
    }
    if not off_loop:
        settings.update({"spillway.spill-off-loop": False, "spillway.loop-read-max": None})
    with dask.config.set(settings), _cluster() as cluster, distributed.Client(cluster) as client:
        values = [client.submit(tracked.make, f"v{i}", 16 * MiB, key=f"v{i}") for i in range(24)]
        distributed.wait(values)

        def tiers(dask_worker):
            buf = dask_worker.data
            if buf._spiller is not None:
                _wait_for(lambda: buf.fast.total_weight <= buf.target)
            return {k: buf.tier(k) for k in buf}

        (tiers,) = client.run(tiers).values()
        spilled = [f"v{i}" for i in range(24) if tiers[f"v{i}"] == "disk"]
        assert len(spilled) >= 4, tiers
        (events,) = client.run(tracked.events).values()
        pickles = {on_main for event, _, _, on_main in events if event == "pickle"}
        assert pickles == {not off_loop}, events

        inputs = [values[int(k[1:])] for k in spilled[:4]]
        assert client.submit(tracked.total, *inputs).result() == 4 * 16 * MiB
        (events,) = client.run(tracked.events).values()
        read = set(spilled[:4])
        unpickles = {on_main for event, key, _, on_main in events if event == "unpickle" and key in read}
        assert unpickles == {not off_loop}, events


def test_a_pressed_process_spills_on_the_setters_thread(make_buffer):
    """While ``pressed()`` says the process is short of memory, a set spills for itself, as
    without deferral (the setter waits for the writes); once it is not, the spilling thread does."""
    target = 16 * MiB
    buf = make_buffer(target=target, process_target=None, compression=None)
    pressed = [True]
    buf.defer_spills(threading.get_ident(), pressed=lambda: pressed[0])
    tracked.EVENTS.clear()
    for i in range(9):
        buf[f"p{i}"] = tracked.Tracked(f"p{i}", 2 * MiB)
    assert buf.fast.total_weight <= target
    assert _pickled_on() == {threading.current_thread().name}, tracked.EVENTS
    pressed[0] = False
    tracked.EVENTS.clear()
    for i in range(9, 11):  # (within the slack)
        buf[f"p{i}"] = tracked.Tracked(f"p{i}", 2 * MiB)
    _wait_for(lambda: buf.fast.total_weight <= target and buf.tier("p0") == "disk")
    assert _pickled_on() == {"spillway-spiller"}, tracked.EVENTS
