"""The parts of distributed that spillway uses beyond its public API, each checked before use.

A dask release may rename or drop any of them. Each is named here once, with what spillway does
without it; :func:`missing` lists the ones a process, worker or nanny lacks, and :mod:`spillway.dask`
warns once per missing name and turns off only what needs it: the plugin (the worker then runs on
spillway's store alone), the store swap (the worker keeps dask's store), or one of the plugin's
extras. Nothing here ever stops a worker from starting. docs/dask.md, "The hooks", lists them with
the distributed versions they were checked against.

Module-level names are resolved once, when this module is imported (as ``spillway.dask`` imports
it in each worker process); the attributes of a worker or nanny are checked on the instance.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable

__all__ = ["HOOKS", "Hook", "get", "missing", "owner"]

#: What a hook is needed for; a missing hook turns off that, and nothing else.
PLUGIN = "plugin"  # the plugin: values move between workers pickled (the store stays)
STORE = "store"  # spillway's store as the worker's data (the worker keeps dask's store)
LOGS = "logs"  # spillway's log messages in Client.get_worker_logs()
BANDWIDTH = "bandwidth"  # the dashboard's bandwidth by type records the values' types
SCATTER = "scatter"  # values scattered to the worker stay pickled


@dataclasses.dataclass(frozen=True)
class Hook:
    """One private part of distributed that spillway relies on."""

    #: How warnings and docs name it: a module attribute (``distributed.utils.offload``, resolved
    #: when this module is imported), or an attribute of a worker or nanny
    #: (``Worker.handlers["get_data"]``, checked on the instance by ``check``).
    name: str
    #: What turns off without it (``PLUGIN``, ``STORE``, ``LOGS``, ``BANDWIDTH``, ``SCATTER``).
    needed_for: str
    #: What spillway uses it for, for the warning.
    use: str
    #: Where it is needed: ``"worker"`` (the plugin, as it installs) or ``"nanny"`` (the nanny
    #: preload, as it sets up the worker it starts).
    on: str = "worker"
    #: For an instance's attribute: whether ``server`` has it.
    check: Callable[[object], bool] | None = None

    @property
    def without(self) -> str:
        """What spillway does without it."""
        return _WITHOUT[self.needed_for, self.on]


_WITHOUT = {
    (PLUGIN, "worker"): "the plugin is off; the worker runs on spillway's store alone",
    (PLUGIN, "nanny"): "the nanny does not add the plugin to its worker's preloads",
    (STORE, "worker"): "the worker keeps dask's own store",
    (STORE, "nanny"): "the nanny does not give its worker spillway's store (a worker preload still can)",
    (LOGS, "worker"): "spillway's messages are not in Client.get_worker_logs()",
    (SCATTER, "worker"): "values scattered to the worker are unpickled as they arrive, as on stock dask",
    (BANDWIDTH, "worker"): (
        "the dashboard's bandwidth by type shows spillway's own types for values received pickled"
    ),
}


def _has(obj: object, *names: str) -> bool:
    """Whether ``obj.a.b...`` exists (not None)."""
    for name in names:
        obj = getattr(obj, name, None)
        if obj is None:
            return False
    return True


def _coroutine_method(server: object, name: str, *params: str) -> bool:
    f = getattr(server, name, None)
    if not inspect.iscoroutinefunction(f):
        return False
    try:
        names = inspect.signature(f).parameters
    except (TypeError, ValueError):
        return False
    return all(p in names for p in params)


def _task_state_type(worker: object) -> bool:
    from distributed.worker_state_machine import TaskState

    return dataclasses.is_dataclass(TaskState) and "type" in {
        f.name for f in dataclasses.fields(TaskState)
    }


def _handler(worker: object, name: str) -> bool:
    handlers = getattr(worker, "handlers", None)
    return isinstance(handlers, dict) and callable(handlers.get(name))


HOOKS: tuple[Hook, ...] = (
    # Module attributes (resolved at import).
    Hook("distributed.worker.get_data_from_worker", PLUGIN,
         "replaced for plugged workers' requests, which then read replies without unpickling"),
    Hook("distributed.comm.utils.OFFLOAD_THRESHOLD", PLUGIN,
         "the size above which received values are merged and unpickled off the event loop"),
    Hook("distributed.utils.offload", PLUGIN, "dask's offload thread, for reads and unpickling"),
    Hook("distributed.protocol.compression.decompress", PLUGIN, "received frames decompressed"),
    Hook("distributed.protocol.serialize.merge_and_deserialize", PLUGIN,
         "a stock sender's values deserialized as dask's comm would"),
    Hook("distributed.protocol.utils.merge_memoryviews", PLUGIN, "received split frames merged"),
    Hook("distributed.protocol.utils.host_array_from_buffers", PLUGIN,
         "received split frames merged"),
    Hook("distributed.protocol.Serialized", PLUGIN, "frames sent and received as they are"),
    # On a worker (checked at install).
    Hook('Worker.handlers["get_data"]', PLUGIN, "replaced: values sent as the frames the store holds",
         check=lambda w: _handler(w, "get_data")),
    Hook("Worker.execute(key, stimulus_id=...)", PLUGIN,
         "wrapped: a task's pickled inputs unpickled off the event loop before it runs",
         check=lambda w: _coroutine_method(w, "execute", "key", "stimulus_id")),
    Hook("Worker.rpc.connect/reuse", PLUGIN,
         "the worker's connection pool, whose comms read replies without unpickling",
         check=lambda w: callable(getattr(getattr(w, "rpc", None), "connect", None))
         and callable(getattr(getattr(w, "rpc", None), "reuse", None))),
    Hook("Worker.state.tasks", PLUGIN, "the worker's tasks (their type, nbytes, dependencies)",
         check=lambda w: isinstance(getattr(getattr(w, "state", None), "tasks", None), dict)),
    Hook("TaskState.type", PLUGIN, "the type a worker records for a value received pickled",
         check=_task_state_type),
    Hook("Worker.plugins", PLUGIN, "the plugin's transition hook",
         check=lambda w: isinstance(getattr(w, "plugins", None), dict)),
    Hook("Worker.memory_manager.data", STORE, "where a preload puts spillway's store",
         check=lambda w: _has(w, "memory_manager", "data")),
    Hook("Worker.state.data", STORE, "where a preload puts spillway's store",
         check=lambda w: _has(w, "state", "data")),
    Hook("Worker._deque_handler", LOGS, "spillway's messages in Client.get_worker_logs()",
         check=lambda w: _has(w, "_deque_handler")),
    Hook("Worker.bandwidth_types", BANDWIDTH,
         "the dashboard's bandwidth by type names the types of values received pickled",
         check=lambda w: isinstance(getattr(w, "bandwidth_types", None), dict)),
    Hook("Worker.listeners[].comm_handler", SCATTER,
         "the comms clients and the scheduler open read scattered values without unpickling",
         check=lambda w: isinstance(getattr(w, "listeners", None), list)
         and all(callable(getattr(x, "comm_handler", None)) for x in w.listeners)),
    Hook("Worker._comms", SCATTER, "the comms already open read scattered values without unpickling",
         check=lambda w: isinstance(getattr(w, "_comms", None), dict)),
    # On a nanny (checked by the nanny preload).
    Hook("distributed.worker.Worker._instances", STORE,
         "a buffer made by worker_data finds its worker (its memory limit, target and metrics)",
         "nanny"),
    Hook("Nanny.worker_kwargs", STORE, "the worker's data= set before its process starts", "nanny",
         check=lambda n: isinstance(getattr(n, "worker_kwargs", None), dict)),
    Hook("Nanny.preload", PLUGIN, "the worker's preloads, to which the plugin is added", "nanny",
         check=lambda n: hasattr(n, "preload") and hasattr(n, "preload_argv")),
)

_MISSING = object()


def owner(name: str) -> tuple[object, str]:
    """(the object that holds the module attribute ``name``, that attribute's name): the deepest
    importable module of the dotted name, then its attributes but the last. ``LookupError`` if
    there is none."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:-1]:
            obj = getattr(obj, attr, _MISSING)
            if obj is _MISSING:
                raise LookupError(name)
        return obj, parts[-1]
    raise LookupError(name)


def _resolve(name: str) -> object:
    """The object a dotted module-attribute name names, or ``_MISSING``."""
    try:
        obj, attr = owner(name)
    except LookupError:
        return _MISSING
    return getattr(obj, attr, _MISSING)


#: The module attributes as this process found them.
_FOUND: dict[str, object] = {h.name: _resolve(h.name) for h in HOOKS if h.check is None}


def get(name: str) -> object:
    """The module attribute ``name`` (a ``Hook.name``) as found at import; None if missing."""
    value = _FOUND[name]
    return None if value is _MISSING else value


def missing(server: object) -> list[Hook]:
    """The hooks the worker or nanny ``server`` needs and lacks (in this process)."""
    on = "nanny" if _is_nanny(server) else "worker"
    found = []
    for h in HOOKS:
        if h.on != on:
            continue
        if h.check is None:
            ok = _FOUND[h.name] is not _MISSING
        else:
            try:
                ok = bool(h.check(server))
            except Exception:
                ok = False
        if not ok:
            found.append(h)
    return found


def _is_nanny(server: object) -> bool:
    try:
        from distributed import Nanny
    except ImportError:  # pragma: no cover
        return False
    return isinstance(server, Nanny)
