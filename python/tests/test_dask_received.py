"""What a client, a stock peer and a task receive from a spillway worker with the plugin is what
they receive from a stock worker: the same types, the same values, writeable arrays.

One cluster holds both: two spillway workers with the plugin (``s1``, ``s2``) and two stock workers
(``k1``, ``k2``). The same values are made on ``s1`` and on ``k1`` and spilled there; everything a
caller can see of them (type, dtype, shape, flags, equality) is recorded when they reach a client,
a stock peer, a peer of the same kind, and a task on their own worker, and the two records must be
equal.
"""

from __future__ import annotations

import threading

import pytest

distributed = pytest.importorskip("distributed")
np = pytest.importorskip("numpy")
pd = pytest.importorskip("pandas")

import spillway  # noqa: E402
import spillway.dask  # noqa: E402

MiB = 1 << 20


class Where:
    """A value of 11 MiB (above dask's ``distributed.comm.offload`` threshold) that remembers
    whether it was unpickled on its process's main thread (a worker's event loop)."""

    def __init__(self, payload: bytes):
        self.payload = payload
        self.on_main_thread = None

    def __reduce__(self):
        return _rebuild_where, (self.payload,)

    def __sizeof__(self):
        return len(self.payload)


def _rebuild_where(payload):
    w = Where(payload)
    w.on_main_thread = threading.current_thread() is threading.main_thread()
    return w


def make(kind: str, i: int):
    rng = np.random.default_rng(i)
    if kind == "array":  # 8 MiB: the side channel's size between spillway peers
        return rng.random(MiB)
    if kind == "small-array":
        return rng.integers(0, 100, 1000)
    if kind == "readonly-array":
        a = rng.random(1000)
        a.flags.writeable = False
        return a
    if kind == "frame":
        return pd.DataFrame(
            {"x": rng.random(20_000), "y": rng.integers(0, 9, 20_000), "s": ["a"] * 20_000}
        )
    if kind == "dict":
        return {"a": rng.random(100_000), "b": [1, 2, 3]}
    if kind == "large-object":
        return Where(rng.bytes(11 * MiB))
    raise ValueError(kind)


KINDS = ("array", "small-array", "readonly-array", "frame", "dict", "large-object")


def describe(value) -> tuple:
    """What a caller sees of ``value``, with its identity left out."""
    if isinstance(value, np.ndarray):
        return (
            "ndarray",
            value.dtype.str,
            value.shape,
            value.flags.writeable,
            value.flags.c_contiguous,
        )
    if isinstance(value, pd.DataFrame):
        cols = tuple(
            (c, str(value[c].dtype), value[c].to_numpy().flags.writeable) for c in value.columns
        )
        return ("DataFrame", value.shape, cols)
    if isinstance(value, dict):
        return ("dict", tuple((k, describe(v)) for k, v in sorted(value.items())))
    if isinstance(value, Where):
        return ("Where", len(value.payload), value.on_main_thread)
    return (type(value).__name__,)


def use(value) -> tuple:
    """A task's view of its input, and that it can change it in place (``x += 1``) when the input
    is writeable."""
    seen = describe(value)
    if isinstance(value, np.ndarray) and value.flags.writeable:
        value += 1
        value -= 1
    return seen


def _spill_all(dask_worker):
    while dask_worker.data.fast and dask_worker.data.evict() > 0:
        pass
    return len(dask_worker.data.slow)


def test_what_peers_clients_and_tasks_receive_is_what_a_stock_worker_gives(plugged_cluster):
    spillway_worker = {"data": spillway.worker_data}
    spec = {"s1": spillway_worker, "s2": spillway_worker, "k1": {}, "k2": {}}
    with plugged_cluster(spec) as (client, addr):
        plugged = client.run(
            lambda dask_worker: getattr(dask_worker.handlers["get_data"], "stock", None) is not None
        )
        assert {n: plugged[a] for n, a in addr.items()} == {
            "s1": True,
            "s2": True,
            "k1": False,
            "k2": False,
        }

        seen = {}
        for source, peer in (("s1", "s2"), ("k1", "k2")):
            values = {
                kind: client.submit(
                    make, kind, i, key=f"{source}-{kind}-{i}", workers=[addr[source]]
                )
                for i, kind in enumerate(KINDS)
            }
            distributed.wait(list(values.values()))
            assert client.run(_spill_all, workers=[addr[source]])[addr[source]] == len(KINDS)
            record = {}
            for kind, fut in values.items():
                got = fut.result()  # the client
                record[kind, "client"] = describe(got)
                for where, worker in (
                    ("stock peer", "k2"),
                    ("same kind", peer),
                    ("own worker", source),
                ):
                    task = client.submit(use, fut, workers=[addr[worker]], pure=False)
                    record[kind, where] = task.result()
                    # The type the receiving worker records for the value (dask's TaskState.type).
                    record[kind, where, "type"] = client.run(
                        lambda dask_worker, k=fut.key: str(dask_worker.state.tasks[k].type),
                        workers=[addr[worker]],
                    )[addr[worker]]
                if kind in ("array", "small-array", "readonly-array"):
                    np.testing.assert_array_equal(got, make(kind, KINDS.index(kind)))
                elif kind == "frame":
                    pd.testing.assert_frame_equal(got, make(kind, KINDS.index(kind)))
            seen[source] = record
        # Where a value was unpickled is the same, but on its own worker: there spillway has
        # unpickled it off the event loop (the client's gather brought it into memory as frames,
        # and the task's input is unpickled in dask's offload thread) where stock dask unpickled it
        # on the event loop when it read it back for the gather. Not something to copy.
        own = ("large-object", "own worker")
        assert seen["k1"][own][2] is True and seen["s1"][own][2] is False
        del seen["s1"][own], seen["k1"][own]
        assert seen["s1"] == seen["k1"]
        # The point of it: an array a stock client gathers, or a task receives, is writeable.
        assert seen["s1"]["array", "client"][3] is True
        assert all(
            seen["s1"]["array", w][3] is True for w in ("stock peer", "same kind", "own worker")
        )
        # A large value received still pickled is unpickled off the event loop, as stock dask does.
        assert seen["s1"]["large-object", "same kind"][2] is False
        assert seen["s1"]["dict", "same kind", "type"] == str(dict)

