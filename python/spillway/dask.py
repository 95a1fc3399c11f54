"""spillway inside dask: workers on spillway's store, and values that move between them pickled.

Turn it on with dask's own means (docs/dask.md, "Running workers on spillway")::

    dask worker SCHED --preload-nanny spillway.dask      # or --preload spillway.dask
    # dask's config: distributed.worker.preload: [spillway.dask]; spillway: {...} for the settings
    # Python: LocalCluster(..., preload_nanny=["spillway.dask"]), or on workers whose data is a
    #         spillway.SpillBuffer: client.register_plugin(spillway.dask.SpillwayPlugin())

What the plugin changes on a worker (what its peers, clients and the scheduler receive is what stock
dask gives them):

* **Sending** (``Worker.get_data``: task dependencies, the Active Memory Manager, ``rebalance``,
  ``replicate``, ``client.gather``): a value the store holds pickled, in memory or on disk, is sent
  as the frames it holds (read off the event loop, in dask's offload thread, once dask's handler
  has decided to answer: a refused request reads nothing), never unpickled and pickled again; the
  key moves as stock ``get_data``'s read moves it (to the end of the LRU, a
  spilled value back into memory, as its frames). A stock receiver reads them with dask's
  ``pickle_loads`` (writeable arrays where stock dask gives writeable arrays); frames only spillway
  unpickles (its numpy fast path) go to it as numpy's own pickle of the array.
* **Receiving** (``distributed.worker.get_data_from_worker``, through which all of those acquire
  data): this worker's requests name a marker (:data:`MARKER`) so a spillway sender knows it, and
  read the reply without deserializing it. Frames a spillway sender marked (``SENT_BY``) are stored
  pickled (:class:`~spillway.PickledFrames`, or on disk under pressure) with the type the sender
  reports (dask's ``TaskState.type``); everything else is deserialized as stock dask does (in its
  offload thread when large). A task's inputs held pickled are unpickled once, just before it runs
  (large ones in the offload thread), exactly once however many threads ask.
* **The side channel** (``tcp://`` clusters without required encryption): a value on disk of at
  least ``spillway.side-channel-min-bytes`` (4 MiB) asked for by a plugged peer is answered with a
  reference to a transfer server of this worker's (a one-time ticket; the record pinned until the
  reply is acknowledged); the peer fetches it (file -> pipe -> socket on this side, straight into its
  own log if it is over its target) before it acknowledges. A fetch that fails is asked for again
  in-band, and the peer's side channel is not tried again for ``side-channel-retry-after`` seconds;
  a server that does not answer costs ``side-channel-connect-timeout`` (2 s), once per peer.
* **Scattering** (``client.scatter``, directly or through the scheduler): the large plain pickle
  values of an ``update_data`` whose bytes are nearly all out-of-band buffers stay pickled on
  arrival, as values from a spillway peer do (:func:`_keeps_its_size`).
* **Failures** fall back to stock behaviour: a send whose preparation fails goes the stock way, a
  receive whose unusual path fails before data arrives asks again the stock way, an input that
  cannot be unpickled errs its task with the unpickling error, and errors stock dask would raise
  are raised as stock dask raises them.
* **Metrics**: the store's work goes to dask's fine performance metrics under the activity that
  caused it, with dask's labels; the plugin's own counts (``send-serialized``,
  ``receive-serialized``, ``receive-scattered``, ``send-side``, ``receive-memory``, ``receive-disk``,
  ``receive-side-failed``, ``unpickle-avoided``, ``pickle-avoided``) are in the buffer's
  ``spillway_metrics``.

The plugin checks that the worker's ``data`` is a :class:`~spillway.SpillBuffer` and that dask has
the hooks it uses (:mod:`spillway.hooks`); otherwise it logs why, once per missing hook, and turns
off only what needs it. :func:`status` says what runs on a worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import functools
import ipaddress
import logging
import os
import pickle
import threading
import weakref
from collections import defaultdict
from collections.abc import Collection, Hashable
from time import monotonic

import distributed.worker
from distributed import Nanny, WorkerPlugin
from distributed.comm.addressing import get_address_host, parse_address
from distributed.metrics import time
from distributed.comm.core import CommClosedError as _CommClosedError
from distributed.protocol import to_serialize

import spillway.worker
from spillway import codec, config, hooks
from spillway._core import TransferServer
from spillway.buffer import SpillBuffer
from spillway.messages import LOGGER
from spillway.received import PickledFrames, ReceivedRecord

# distributed's private names (spillway.hooks): None where this dask lacks one, and then the plugin
# does not install, so that nothing below runs with one missing.
Serialized = hooks.get("distributed.protocol.Serialized")
_OFFLOAD_THRESHOLD = hooks.get("distributed.comm.utils.OFFLOAD_THRESHOLD")
_offload = hooks.get("distributed.utils.offload")
_decompress = hooks.get("distributed.protocol.compression.decompress")
_merge_and_deserialize = hooks.get("distributed.protocol.serialize.merge_and_deserialize")
_merge_memoryviews = hooks.get("distributed.protocol.utils.merge_memoryviews")
_host_array_from_buffers = hooks.get("distributed.protocol.utils.host_array_from_buffers")


def _offloaded(nbytes: int) -> bool:
    """Whether dask would deserialize ``nbytes`` in its offload thread (``distributed.comm.offload``;
    False there: never)."""
    return bool(_OFFLOAD_THRESHOLD) and nbytes > _OFFLOAD_THRESHOLD

__all__ = [
    "MARKER",
    "SIDE_MARKER",
    "SpillwayPlugin",
    "dask_setup",
    "dask_teardown",
    "install",
    "status",
    "uninstall",
]

logger = logging.getLogger(f"{LOGGER}.dask")

#: Named last among the deserializers of a spillway worker's data requests. A stock sender tries
#: the families in order and stops at "pickle", so it never looks this name up; a spillway sender
#: reads it as "the requester runs spillway and can take frames only spillway unpickles".
MARKER = "spillway-frames-1"

#: Also named by a requester that fetches references by the side channel (see the module's
#: documentation). A sender answers with references only to requests that name it.
SIDE_MARKER = "spillway-side-1"

#: The header key of a side-channel reference: ``[host, port, ticket, record key, nbytes]``.
SIDE = "spillway-side"

#: Seconds a side-channel ticket stays valid (it is revoked as soon as the reply is acknowledged).
SIDE_TICKET_SECONDS = 60.0


@dataclasses.dataclass(frozen=True)
class Settings:
    """The plugin's settings on one worker: ``spillway:`` in dask's config (``spillway.yaml``), or
    :class:`SpillwayPlugin`'s arguments."""

    #: Spilled values go to plugged peers by a transfer server of this worker's.
    side_channel: bool
    #: Values on disk of at least this many bytes go by the side channel (smaller ones in-band: a
    #: connection of their own costs more than their read).
    side_channel_min_bytes: int
    #: Seconds connecting to a peer's server (and its greeting) may take. A peer whose server does
    #: not answer within this is not tried again for ``side_channel_retry_after`` seconds: its
    #: values come in-band meanwhile.
    side_channel_connect_timeout: float
    side_channel_retry_after: float
    #: Seconds each network call of a fetch may take (the whole value must also arrive at 1 MiB/s).
    side_channel_timeout: float
    #: The port the transfer server listens on: 0 (a free one), a port, or ``"first:last"`` (the
    #: first free one of that range, as dask's ``--worker-port`` takes it).
    side_channel_port: int | str = 0
    #: A task's inputs to read from disk or unpickle, past this many bytes in all, are read in
    #: dask's offload thread instead of on the event loop (None: always on the loop).
    loop_read_max_bytes: int | None = 4 * 2**20
    #: Sets on the event loop leave the spilling they cause to a thread of the buffer's own
    #: (``SpillBuffer.defer_spills``).
    spill_off_loop: bool = True

    @classmethod
    def from_config(cls, **overrides) -> Settings:
        values = {
            "side_channel": bool(config.get("side-channel")),
            "side_channel_min_bytes": config.get_bytes("side-channel-min-bytes"),
            "side_channel_connect_timeout": config.get_seconds("side-channel-connect-timeout"),
            "side_channel_retry_after": config.get_seconds("side-channel-retry-after"),
            "side_channel_timeout": config.get_seconds("side-channel-timeout"),
            "side_channel_port": config.get("side-channel-port"),
            "loop_read_max_bytes": config.get_bytes_or_none("loop-read-max"),
            "spill_off_loop": bool(config.get("spill-off-loop")),
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        _ports(values["side_channel_port"])  # a ValueError now, not when the server starts
        return cls(**values)


def _ports(spec: int | str) -> range:
    """The ports ``side_channel_port`` allows, in the order they are tried."""
    if isinstance(spec, int) and not isinstance(spec, bool) and 0 <= spec <= 65535:
        return range(spec, spec + 1)
    if isinstance(spec, str):
        first, sep, last = spec.partition(":")
        try:
            lo, hi = int(first), int(last if sep else first)
        except ValueError:
            lo, hi = -1, -1
        if 0 <= lo <= hi <= 65535:
            return range(lo, hi + 1)
    raise ValueError(f"spillway.side-channel-port={spec!r}: a port (0: any free one) or 'first:last'")


#: A key in the header of the frames a spillway sender sends as they are (stock receivers ignore it):
#: only those are kept pickled on arrival. Values from stock senders are deserialized as stock dask
#: does, even plain pickle ones.
SENT_BY = "spillway"

#: A key in the header of frames a spillway sender sends: the pickled type of the value (as dask's
#: worker sends a task's type to the scheduler), so that the receiver records the right type without
#: unpickling the value.
TYPE = "spillway-type"


class _Plug:
    """What the plugin keeps for one plugged worker, and what it replaced there (put back by
    :func:`uninstall` where nothing replaced it since)."""

    def __init__(self, worker, settings: Settings):
        #: the worker, weakly (this object is found from its connection pool too: ``_by_rpc``)
        self.worker = weakref.ref(worker)
        self.settings = settings
        #: (its transfer server, values of at least this many bytes go by it), with the side channel
        self.side: tuple | None = None
        #: {key: the type of the value received for it still pickled}, until the key reaches memory
        self.types: dict = {}
        #: the worker's get_data handler and execute as they were (weakly, where they are the
        #: worker's own methods: this object must not keep the worker alive), and whether execute
        #: was the instance's own attribute
        self._stock_handler = _weakly(worker.handlers["get_data"])
        self._stock_execute = _weakly(worker.execute)
        self.own_execute = "execute" in worker.__dict__
        #: the worker's bandwidth-by-type table as it was (None: left alone)
        self.stock_bandwidth_types = None
        #: the worker's listeners whose comm handler the plugin wraps (scattered values), weakly
        self.listeners: list = []

    @property
    def stock_handler(self):
        return self._stock_handler()

    @property
    def stock_execute(self):
        return self._stock_execute()


def _weakly(f):
    """A callable's reference that does not keep its object alive when it is a bound method."""
    if hasattr(f, "__self__") and hasattr(f, "__func__"):
        return weakref.WeakMethod(f)
    return lambda: f


#: Each plugged worker -> its :class:`_Plug`.
_plugs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

#: Each plugged worker's connection pool (``worker.rpc``) -> the worker's :class:`_Plug`: requests
#: made through any other pool (clients, schedulers, stock workers in the same process) stay stock.
_by_rpc: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

#: ``distributed.worker.get_data_from_worker`` as it was before the first install (put back when the
#: last plugged worker of the process uninstalls).
_stock_get_data_from_worker = hooks.get("distributed.worker.get_data_from_worker")


class _Unreachable:
    """Peers (by worker address) whose side channel failed, and until when it is not used for
    them: their values come in-band meanwhile. A blocked port costs one connect timeout per peer,
    not one per value."""

    def __init__(self):
        self._lock = threading.Lock()
        self._until: dict = {}

    def blocked(self, peer: str) -> bool:
        with self._lock:
            until = self._until.get(peer)
            if until is not None and monotonic() >= until:
                del self._until[peer]
                until = None
        return until is not None

    def failed(self, peer: str, seconds: float) -> bool:
        """Note a failure; whether the peer was not noted already."""
        with self._lock:
            new = peer not in self._until
            self._until[peer] = monotonic() + seconds
        return new


_unreachable = _Unreachable()


class SpillwayPlugin(WorkerPlugin):
    """A ``distributed.WorkerPlugin`` that turns on :mod:`spillway.dask` on each worker (see the
    module's documentation): ``client.register_plugin(SpillwayPlugin())``. Each argument left None
    is taken from dask's config on the worker (``spillway.side-channel``, ...: :class:`Settings`);
    ``side_channel=False`` sends every value in-band."""

    name = "spillway"

    def __init__(
        self,
        side_channel: bool | None = None,
        side_channel_min_bytes: int | None = None,
        **settings: float,
    ):
        self.side_channel = side_channel
        self.side_channel_min_bytes = side_channel_min_bytes
        self.settings = settings
        self._worker = None

    def setup(self, worker: distributed.Worker) -> None:
        self._worker = weakref.ref(worker)
        install(
            worker,
            Settings.from_config(
                side_channel=self.side_channel,
                side_channel_min_bytes=self.side_channel_min_bytes,
                **self.settings,
            ),
        )

    def teardown(self, worker: distributed.Worker) -> None:
        uninstall(worker)

    def transition(self, key: Hashable, start: str, finish: str, **kwargs) -> None:
        """A value received still pickled reached memory: the worker's record of its type (dask
        sets the type of what it stored, frames here) is the value's own, as on a stock worker."""
        worker = self._worker() if self._worker is not None else None
        plug = _plugs.get(worker) if worker is not None else None
        if plug is None or key not in plug.types:
            return
        t = plug.types.pop(key)
        ts = worker.state.tasks.get(key) if finish == "memory" else None
        if t is not None and ts is not None and ts.type in (PickledFrames, ReceivedRecord):
            ts.type = t


def status(worker: distributed.Worker) -> dict:
    """What spillway does on ``worker``: ``{"store": the worker's data is a spillway.SpillBuffer,
    "plugin": the plugin is on, "side_channel": its transfer server's (host, port) or None,
    "missing": the names of the hooks it was found to lack as spillway set it up (spillway.hooks)}``."""
    plug = _plugs.get(worker)
    side = plug.side if plug is not None else None
    return {
        "store": isinstance(getattr(worker, "data", None), SpillBuffer),
        "plugin": plug is not None,
        "side_channel": tuple(side[0].address) if side is not None else None,
        "missing": list(_lacks.get(worker, ())),
    }


#: Each worker or nanny -> the names of the hooks it was found to lack (each warned about once).
_lacks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _missing(server, needed_for: str | None = None) -> list:
    """The hooks ``server`` (a worker or nanny) lacks in this process, each warned about once (per
    server) with what turns off without it; only those needed for ``needed_for`` if given."""
    found = hooks.missing(server)
    try:
        lacks = _lacks.setdefault(server, [])
    except TypeError:  # (not weakly referenceable: warned about every time)
        lacks = []
    for h in found:
        if h.name not in lacks:
            lacks.append(h.name)
            logger.warning(
                "spillway.dask: this dask has no %s (%s): %s (%s)",
                h.name,
                h.use,
                h.without,
                _name(server),
            )
    return [h for h in found if needed_for is None or h.needed_for == needed_for]


def dask_setup(server) -> None:
    """Run a worker on spillway with dask's own means: ``dask worker ... --preload-nanny
    spillway.dask`` (a nanny) or ``--preload spillway.dask`` (a worker), or the same module in
    dask's config (``distributed.nanny.preload``, ``distributed.worker.preload``).

    * A nanny gives the worker it starts ``data=spillway.worker_data`` (with ``spillway.data``,
      unless it was given a ``data`` of its own) and this module as a worker preload (with
      ``spillway.plugin``), before the worker process starts.
    * A worker whose ``data`` is dask's own (empty) ``SpillBuffer`` gets a ``spillway.SpillBuffer``
      in its place (with ``spillway.data``), made as :func:`spillway.worker_data` makes it, and the
      plugin (with ``spillway.plugin``).

    It never stops a server from starting: whatever fails is logged and the server runs stock (a
    missing hook turns off only what needs it: :mod:`spillway.hooks`)."""
    try:
        if isinstance(server, Nanny):
            _setup_nanny(server)
        elif isinstance(server, distributed.Worker):
            _setup_worker(server)
        else:
            logger.warning(
                "spillway.dask: a preload of %s, neither a nanny nor a worker: nothing to do",
                _name(server),
            )
    except Exception:
        logger.exception("spillway.dask: left %s as stock dask", _name(server))


def _name(server) -> str:
    """How the logs name ``server`` (its address, when it has one yet)."""
    try:
        return str(server.address)
    except Exception:
        return type(server).__name__


def dask_teardown(server) -> None:
    """The end of the preload."""
    if isinstance(server, distributed.Worker):
        uninstall(server)
    else:
        _hide_logs(server)


#: What a preload names to run this module (as a nanny's worker preload).
PRELOAD = "spillway.dask"


def _setup_nanny(nanny) -> None:
    _show_logs(nanny)
    missing = {h.needed_for for h in _missing(nanny)}
    if config.get("data") and hooks.STORE not in missing and "data" not in nanny.worker_kwargs:
        nanny.worker_kwargs["data"] = spillway.worker.worker_data
    if config.get("plugin") and hooks.PLUGIN not in missing:
        preload = [nanny.preload] if isinstance(nanny.preload, str) else list(nanny.preload or ())
        if PRELOAD not in preload:
            argv = nanny.preload_argv
            if argv and not isinstance(argv[0], str):  # one list of arguments per preload
                nanny.preload_argv = [*argv, []]
            elif argv:  # one list for every preload: now one each
                nanny.preload_argv = [list(argv)] * len(preload) + [[]]
            nanny.preload = [*preload, PRELOAD]


def _setup_worker(worker) -> None:
    _show_logs(worker)
    if config.get("data"):
        reason = _use_spillway_data(worker)
        if reason:
            logger.warning("spillway.dask: %s keeps its data: %s", _name(worker), reason)
    if config.get("plugin"):
        install(worker, Settings.from_config())


def _use_spillway_data(worker) -> str:
    """Give ``worker`` a ``spillway.SpillBuffer`` where it has dask's own empty one (as at a
    preload, before it has any data); why not, or "" if it did."""
    import distributed.spill

    missing = [h.name for h in _missing(worker, hooks.STORE)]
    if missing:
        return f"this dask has no {', '.join(missing)}"
    data = getattr(worker, "data", None)
    if isinstance(data, SpillBuffer):
        return ""
    if type(data) is not distributed.spill.SpillBuffer:
        return f"it is a {type(data).__name__}, not dask's SpillBuffer (dask was given data= or spills nothing)"
    if len(data):
        return "it already holds data"
    manager, state = worker.memory_manager, worker.state
    if manager.data is not data or state.data is not data:
        return "this dask keeps its data elsewhere than memory_manager.data and state.data"
    buf = spillway.worker.worker_data(worker.local_directory)
    buf._attach(worker)
    manager.data = buf
    state.data = buf
    with contextlib.suppress(OSError):  # dask's store's empty directory
        os.rmdir(os.path.join(worker.local_directory, "storage"))
    return ""


def _side_channel_off(worker) -> str:
    """Why the side channel cannot run on ``worker`` ("" if it can)."""
    scheme = parse_address(getattr(worker, "address", "") or "tcp://")[0]
    if scheme != "tcp":
        return f"its address is {scheme}://, not tcp://"
    security = getattr(worker, "security", None)
    if security is not None and getattr(security, "require_encryption", False):
        return "dask requires encryption, which the side channel does not do"
    return ""


def _side_channel_server(worker, settings: Settings) -> TransferServer | None:
    """A transfer server on the worker's host, on the first free port ``settings`` allow (None,
    logged, if none is)."""
    host = get_address_host(worker.address)
    error = None
    for port in _ports(settings.side_channel_port):
        try:
            return TransferServer(host, port, lifetime=SIDE_TICKET_SECONDS)
        except OSError as e:  # in use: the next one
            error = e
    logger.error(
        "spillway.dask: no side channel on %s: no port of %s is free on %s (%s)",
        worker.address,
        settings.side_channel_port,
        host,
        error,
    )
    return None


def install(worker: distributed.Worker, settings: Settings | None = None) -> bool:
    """Turn the plugin on for ``worker`` (``settings``: from dask's config by default); False
    (logged) when it stays off: the worker's data is not a spillway.SpillBuffer, or this dask lacks
    a hook the plugin needs (:mod:`spillway.hooks`; one warning names each)."""
    if settings is None:
        settings = Settings.from_config()
    if not isinstance(getattr(worker, "data", None), SpillBuffer):
        logger.warning(
            "spillway.dask is off on %s: its data is a %s, not a spillway.SpillBuffer",
            _name(worker),
            type(getattr(worker, "data", None)).__name__,
        )
        return False
    _show_logs(worker)
    missing = {h.needed_for for h in _missing(worker)}
    if hooks.PLUGIN in missing:
        return False
    if worker in _plugs:
        return True
    plug = _Plug(worker, settings)
    if settings.side_channel:
        off = _side_channel_off(worker)
        if off:
            logger.info("spillway.dask: the side channel is off on %s: %s", worker.address, off)
        else:
            try:
                server = _side_channel_server(worker, settings)
            except Exception:
                logger.exception("spillway.dask: no side channel on %s", worker.address)
                server = None
            if server is not None:
                plug.side = (server, settings.side_channel_min_bytes)
    _plugs[worker] = plug
    _by_rpc[worker.rpc] = plug
    worker.handlers["get_data"] = _handler(worker, plug.stock_handler)
    worker.execute = _execute(worker, plug.stock_execute)
    if distributed.worker.get_data_from_worker is not get_data_from_worker:
        # What is there now is what the process's first plugged worker found: dask's function, or
        # another library's wrapper of it. (Taken only then: a wrapper put over this module's
        # function later must not become what this module calls.)
        global _stock_get_data_from_worker
        if len(_plugs) == 1:
            _stock_get_data_from_worker = distributed.worker.get_data_from_worker
        distributed.worker.get_data_from_worker = get_data_from_worker
    if hooks.BANDWIDTH not in missing:
        plug.stock_bandwidth_types = worker.bandwidth_types
        worker.bandwidth_types = _BandwidthByType(worker.bandwidth_types)
    if hooks.SCATTER not in missing:
        _wrap_listeners(worker, plug)
    if settings.spill_off_loop and isinstance(worker.data, SpillBuffer):
        _on_loop(worker, _defer_spills, weakref.ref(worker))
    if "spillway" not in worker.plugins:
        # (a preload: the transition hook needs a plugin; close removes it, calling teardown)
        plugin = SpillwayPlugin(**dataclasses.asdict(settings))
        plugin._worker = weakref.ref(worker)
        worker.plugins["spillway"] = plugin
    return True


def _on_loop(worker, f, *args) -> None:
    """Call ``f(*args)`` on ``worker``'s event loop: now if this is its thread, else soon."""
    try:
        here = asyncio.get_running_loop() is worker.loop.asyncio_loop
    except (RuntimeError, AttributeError):
        here = False
    if here:
        f(*args)
    else:
        worker.loop.add_callback(f, *args)


def _defer_spills(worker_ref: weakref.ref) -> None:
    """On the worker's event loop: the sets made there leave their spilling to the buffer's own
    thread (``SpillBuffer.defer_spills``), whose work shows in dask's fine metrics as the memory
    monitor's (the other spilling that runs beside the tasks), while the process is under dask's
    spill threshold."""
    worker = worker_ref()
    if worker is None or worker not in _plugs or not isinstance(worker.data, SpillBuffer):
        return

    def digest(label: str, value: float, unit: str) -> None:
        w = worker_ref()
        if w is not None and hasattr(w, "digest_metric"):
            w.loop.add_callback(w.digest_metric, ("memory-monitor", label, unit), value)

    def pressed() -> bool:
        # Above dask's spill threshold (where its memory monitor spills), sets spill as on stock
        # dask: the loop waits for the writes, which holds back transfers and tasks meanwhile.
        w = worker_ref()
        mm = w.memory_manager
        if not mm.memory_limit or mm.memory_spill_fraction is False:
            return False
        return w.monitor.get_process_memory() > mm.memory_limit * mm.memory_spill_fraction

    worker.data.defer_spills(threading.get_ident(), digest, pressed)


def uninstall(worker: distributed.Worker) -> None:
    """Turn the plugin off for ``worker``: what it replaced is put back where nothing replaced it
    since (a wrapper another library put over the plugin's stays, and calls the stock function
    through it), and ``distributed.worker.get_data_from_worker`` once no worker of the process is
    plugged."""
    _hide_logs(worker)
    plug = _plugs.pop(worker, None)
    if plug is None:
        return
    _by_rpc.pop(worker.rpc, None)
    if plug.side is not None:
        plug.side[0].close()
    if isinstance(worker.data, SpillBuffer):
        worker.data.defer_spills(None)
    if getattr(worker.handlers.get("get_data"), "plug_of", None) is worker:
        worker.handlers["get_data"] = plug.stock_handler
    if getattr(worker.__dict__.get("execute"), "plug_of", None) is worker:
        if plug.own_execute:
            worker.execute = plug.stock_execute
        else:
            del worker.execute
    _unwrap_listeners(worker, plug)
    if plug.stock_bandwidth_types is not None and isinstance(worker.bandwidth_types, _BandwidthByType):
        plug.stock_bandwidth_types.update(worker.bandwidth_types)
        worker.bandwidth_types = plug.stock_bandwidth_types
    if not _plugs and distributed.worker.get_data_from_worker is get_data_from_worker:
        distributed.worker.get_data_from_worker = _stock_get_data_from_worker


def _show_logs(server) -> None:
    """spillway's messages in the worker's (or nanny's) log (``Client.get_worker_logs()``), as its
    own: its log handler on spillway's loggers too, as dask puts it on ``distributed.worker``."""
    handler = getattr(server, "_deque_handler", None)
    if handler is not None:
        logging.getLogger(LOGGER).addHandler(handler)  # (a handler is added once)


def _hide_logs(server) -> None:
    handler = getattr(server, "_deque_handler", None)
    if handler is not None:
        logging.getLogger(LOGGER).removeHandler(handler)


def _peer_ip(comm) -> str | None:
    """The IP address the requester's comm comes from (its side-channel tickets are good from there
    only), or None if it is not one."""
    try:
        host = get_address_host(comm.peer_address)
        return str(ipaddress.ip_address(host.strip("[]")))
    except (ValueError, TypeError, AttributeError):
        return None


def _in_process(comm) -> bool:
    """An in-process comm hands messages over as objects, without serializing them."""
    return parse_address(getattr(comm, "peer_address", "") or "tcp://")[0] == "inproc"


#: The type of a value received pickled, for the dashboard's bandwidth by type
#: (:class:`_BandwidthByType`): set by :func:`get_data_from_worker` for the reply it returns.
_received_type: contextvars.ContextVar = contextvars.ContextVar("spillway_received_type", default=None)


class _BandwidthByType(defaultdict):
    """A plugged worker's ``bandwidth_types``: dask records a transfer under the type of the values
    it received when they are all of one type; those received pickled are recorded under the
    values' own type (the sender's, as the reply named it), as on a stock worker, or not at all
    where the reply's values are of several types."""

    def __init__(self, stock: dict):
        super().__init__(getattr(stock, "default_factory", None) or (lambda: (0, 0)), stock)

    def _real(self, typ):
        if typ in (PickledFrames, ReceivedRecord):
            return _received_type.get()
        return typ

    def __getitem__(self, typ):
        real = self._real(typ)
        return super().__getitem__(typ if real is None else real)

    def __setitem__(self, typ, value) -> None:
        real = self._real(typ)
        if real is not None:
            super().__setitem__(real, value)
        elif typ in (PickledFrames, ReceivedRecord):
            super().pop(typ, None)  # several types in the reply: stock records nothing either

# --------------------------------------------------------------------------------------------------
# Sending


class _Deferred:
    """Stands for a value in a ``get_data`` reply until the reply is written: the stock handler
    decides whether to answer (its throttle: busy, paused) before anything is read, pickled or
    moved for it. Never serialized: a reply still holding one is a bug, and fails loudly."""

    __slots__ = ()

    def __reduce__(self):
        raise RuntimeError("spillway.dask: a get_data reply was written before its values were read")


_DEFERRED = _Deferred()


def _handler(worker, stock_handler):
    """The plugged worker's ``get_data`` handler: the stock one, whose reply carries the frames the
    store holds (read as the reply is written, after the stock handler decided to answer)."""

    async def get_data(
        comm,
        keys: Collection[Hashable] = (),
        who: str | None = None,
        serializers: list | None = None,
        **kwargs,
    ):
        plug = _plugs.get(worker)
        if plug is None or _in_process(comm) or (serializers is not None and "pickle" not in serializers):
            # An in-process comm hands values over without serializing them: a Serialized would
            # reach the requester as it is. The stock way is the cheap one here. (And a requester
            # that does not take pickle gets what dask would send it.)
            return await stock_handler(comm, keys=keys, who=who, serializers=serializers, **kwargs)
        peer_runs_spillway = bool(serializers) and MARKER in serializers
        side = plug.side if serializers and SIDE_MARKER in serializers else None
        if side is not None:
            side = (*side, _peer_ip(comm))
        buf: SpillBuffer = worker.data
        tiers = {}
        for key in keys:
            tier = buf.tier_if_present(key)
            if tier is not None and (tier != "object" or peer_runs_spillway):
                tiers[key] = tier
        if not tiers:
            return await stock_handler(comm, keys=keys, who=who, serializers=serializers, **kwargs)
        deferred = dict.fromkeys(tiers, _DEFERRED)
        tickets: list = []
        had_write = "write" in comm.__dict__
        stock_write = comm.write

        async def write(msg, *args, **kw):
            # The stock handler decided to answer: now read what the reply carries.
            await _fill(worker, msg, deferred, tiers, peer_runs_spillway, side, tickets)
            return await stock_write(msg, *args, **kw)

        try:
            comm.write = write
        except AttributeError:  # a comm whose write cannot be wrapped: the stock way
            return await stock_handler(comm, keys=keys, who=who, serializers=serializers, **kwargs)
        try:
            with buf.serving(deferred):
                return await stock_handler(comm, keys=keys, who=who, serializers=serializers, **kwargs)
        finally:
            if had_write:
                comm.write = stock_write
            else:
                comm.__dict__.pop("write", None)
            # The reply was acknowledged (or failed): the requester has fetched what it will.
            for ticket in tickets:
                side[0].revoke(ticket)

    get_data.stock = stock_handler
    get_data.plug_of = worker
    return get_data


async def _fill(worker, msg, deferred: dict, tiers: dict, peer_runs_spillway: bool, side, tickets):
    """Replace the deferred values of the reply ``msg`` with what they are sent as: their frames
    (read in dask's offload thread), a side-channel reference, or (where that fails) the object,
    read the stock way."""
    data = msg.get("data") if isinstance(msg, dict) else None
    if not isinstance(data, dict):
        return
    keys = [k for k, v in data.items() if _is_deferred(v)]
    if not keys:
        return
    try:
        prepared = await _prepare(worker, keys, tiers, peer_runs_spillway, side, tickets)
    except Exception:  # the stock way, then
        logger.exception("spillway.dask: could not prepare %d keys for a peer", len(keys))
        prepared = {}
    for key in keys:
        if key in prepared:
            data[key] = to_serialize(prepared[key])
            continue
        deferred.pop(key, None)  # (so that the buffer reads the value itself)
        try:
            data[key] = to_serialize(worker.data[key])
        except KeyError:  # deleted meanwhile: the requester asks elsewhere, as for any missing key
            del data[key]


def _is_deferred(value) -> bool:
    return value is _DEFERRED or getattr(value, "data", None) is _DEFERRED


def _execute(worker, stock_execute):
    """The plugged worker's ``execute``: a task's inputs held pickled or on disk are read first
    (off the event loop past ``loop_read_max_bytes``), then the stock ``execute`` runs the task."""

    async def execute(key: Hashable, *, stimulus_id: str):
        plug = _plugs.get(worker)
        if plug is not None:
            try:
                await _read_inputs(worker, key, plug.settings.loop_read_max_bytes)
            except Exception:  # (whatever failed, the stock execute runs the task, or errs it)
                logger.debug("spillway.dask: inputs of %r left to execute", key, exc_info=True)
        return await stock_execute(key, stimulus_id=stimulus_id)

    execute.stock = stock_execute
    execute.plug_of = worker
    return execute


async def _prepare(
    worker, keys: list, tiers: dict, peer_runs_spillway: bool, side, tickets: list
) -> dict:
    """The values of ``keys`` as a reply sends them: ``Serialized`` frames of the keys the store
    holds (read in dask's offload thread; within the stock handler, so that what the store does
    shows in dask's fine metrics under get-data, as dask's own reads for a peer do) and, with
    ``side`` (this worker's transfer server, threshold and the requester's IP address), references
    for the large values on disk, whose tickets go into ``tickets``. A key deleted meanwhile is
    left out."""
    buf: SpillBuffer = worker.data
    out = await _offload(_serialized_values, buf, keys, tiers, peer_runs_spillway, side, tickets)
    if peer_runs_spillway:
        for key, value in out.items():
            ts = worker.state.tasks.get(key)
            if isinstance(value, Serialized) and ts is not None and ts.type is not None:
                with contextlib.suppress(Exception):  # (a type that does not pickle: left out)
                    value.header[TYPE] = pickle.dumps(ts.type)
    return out


def _serialized_values(
    buf: SpillBuffer, keys: list, tiers: dict, peer_runs_spillway: bool, side, tickets: list
) -> dict:
    out = {}
    sent = nbytes = side_sent = side_bytes = 0
    for key in keys:
        if side is not None and tiers[key] == "disk":
            ref = _grant(buf, key, side, tickets)
            if ref is not None:
                out[key] = ref
                sent += 1
                side_sent += 1
                side_bytes += ref.header[SIDE][4]
                nbytes += ref.header[SIDE][4]
                continue
        try:
            # As stock get_data's data[key]: the key moves in the LRU order and, if it was spilled
            # and is not heavier than the target, comes back into memory (as frames, unpickled).
            frames = buf.get_serialized(key, as_read=True)
        except KeyError:  # deleted meanwhile: the stock handler skips it too
            continue
        except Exception:  # (logged as stock dask would: the stock handler reads it and fails)
            continue
        if not peer_runs_spillway and codec.spillway_only(frames):
            stock = codec.stock_frames(frames)
            if stock is None:
                out[key] = codec.loads(frames, True)  # the object: dask serializes it
                continue
            frames = stock  # the array as numpy's own pickle of it
        out[key] = _to_serialized(frames)
        if tiers[key] != "object":
            sent += 1
            nbytes += codec.frame_bytes(frames)
    if side_sent:
        buf.peers.count("send-side", side_sent, "count")
        buf.peers.count("send-side", side_bytes, "bytes")
    if sent:
        buf.peers.count("send-serialized", sent, "count")
        buf.peers.count("send-serialized", nbytes, "bytes")
        buf.peers.count("unpickle-avoided", sent, "count")
        buf.peers.count("pickle-avoided", sent, "count")
    return out


def _grant(buf: SpillBuffer, key: Hashable, side, tickets: list) -> Serialized | None:
    """A side-channel reference to ``key``'s record, if it is on disk and large enough (None
    otherwise, or if the grant fails: the value then goes in-band)."""
    server, min_bytes, peer = side
    try:
        record = buf.disk_record(key)
        if record is None or record[2] < min_bytes:
            return None
        log, log_key, nbytes = record
        ticket = server.grant(log, log_key, peer)
    except Exception:  # deleted meanwhile, a closed log, grants used up: in-band
        return None
    if ticket is None:  # moved (read back and deleted, replaced) meanwhile
        return None
    tickets.append(ticket)
    host, port = _advertised(server)
    header = {"serializer": "pickle", SENT_BY: True, SIDE: [host, port, ticket, log_key, nbytes]}
    return Serialized(header, [])


def _advertised(server: TransferServer) -> tuple:
    """The address a reference names for ``server``: where it listens (the worker's own host)."""
    return server.address


def _to_serialized(frames: list) -> Serialized:
    """Frames as dask's ``Serialized`` with the pickle header a stock receiver reads: one writeable
    flag per out-of-band buffer. A fresh header for each send (dask adds to it as it writes).

    Every flag is True: dask's flag says whether the object's buffer was writeable, and pickle's
    own stream already says which were not (protocol 5 marks a read-only buffer), so the receiver
    makes exactly those read-only. (The frames sent may be read-only views of what the store holds
    or read; that says nothing about the object.)"""
    header = {"serializer": "pickle", "writeable": (True,) * (len(frames) - 1), SENT_BY: True}
    return Serialized(header, list(frames))


# --------------------------------------------------------------------------------------------------
# Receiving


async def get_data_from_worker(
    rpc, keys, worker, *, who=None, serializers=None, deserializers=None, _side_channel=True
):
    """``distributed.worker.get_data_from_worker`` for all: plugged workers' requests keep plain
    pickle frames pickled (see the module's documentation), every other request is stock."""
    plug = _by_rpc.get(rpc)
    me = plug.worker() if plug is not None else None
    if me is None or deserializers is not None or parse_address(worker)[0] == "inproc":
        return await _stock_get_data_from_worker(
            rpc, keys, worker, who=who, serializers=serializers, deserializers=deserializers
        )
    stock_deserializers = getattr(rpc, "deserializers", None)
    # What a stock request accepts (the default families when the pool names none), and the markers.
    accepted = [*(stock_deserializers or ("dask", "pickle")), MARKER]
    settings = plug.settings
    side = (
        _side_channel
        and settings.side_channel
        and not _side_channel_off(me)
        and parse_address(worker)[0] == "tcp"
        and not _unreachable.blocked(worker)
    )
    if side:
        accepted.append(SIDE_MARKER)
    try:
        response = await _stock_get_data_from_worker(
            _UndeserializedPool(rpc, plug if side else None, me.data),
            keys,
            worker,
            who=who,
            serializers=serializers,
            deserializers=accepted,
        )
    except OSError:
        raise  # a peer that hung up: as stock dask sees it
    except Exception:
        logger.exception(
            "spillway.dask: a request to %s failed; asking again the stock way", worker
        )
        return await _stock_get_data_from_worker(
            rpc, keys, worker, who=who, serializers=serializers
        )
    if response.get("status") != "OK":
        return response
    data = response["data"]
    again = [key for key, value in data.items() if value is _IN_BAND]
    for key in again:
        del data[key]
    received = {k: v for k, v in data.items() if isinstance(v, Serialized)}
    # Merged, decompressed (and a stock sender's values deserialized) in dask's offload thread when
    # they are large, as dask's comm does for a large message.
    if _offloaded(sum(codec.frame_bytes(v.frames) for v in received.values())):
        converted = await _offload(_convert_all, received, stock_deserializers)
    else:
        converted = _convert_all(received, stock_deserializers)
    data.update(converted)
    kept = nbytes = 0
    for key, value in data.items():
        if type(value) in (PickledFrames, ReceivedRecord):
            kept += 1
            nbytes += value.__sizeof__()
            if type(value) is PickledFrames and key in received:
                _note_type(plug, key, received[key].header)
    if kept:
        buf = me.data
        buf.peers.count("receive-serialized", kept, "count")
        buf.peers.count("receive-serialized", nbytes, "bytes")
        buf.peers.count("unpickle-avoided", kept, "count")
    if again:
        # Side-channel fetches that failed: the same values in-band (the sender's pins are gone
        # with its tickets). Keys the second answer lacks are missing, as for any reply without
        # them: dask asks the scheduler where else they are.
        try:
            retry = await get_data_from_worker(
                rpc, again, worker, who=who, serializers=serializers, _side_channel=False
            )
        except Exception:  # the values that did arrive stand; these keys are missing
            logger.info("spillway.dask: asking %s again in-band failed", worker, exc_info=True)
        else:
            if retry.get("status") == "OK":
                data.update(retry["data"])
    _received_type.set(_one_type(plug, data))
    return response


def _one_type(plug: _Plug, data: dict):
    """The type of the values of a reply, if they are all of one (those received pickled counted
    as the type their sender named); else None."""
    types = set()
    for key, value in data.items():
        t = plug.types.get(key, type(value)) if type(value) in (PickledFrames, ReceivedRecord) else type(value)
        if t in (PickledFrames, ReceivedRecord):
            return None
        types.add(t)
    return types.pop() if len(types) == 1 else None


def _convert_all(values: dict, deserializers: list | None) -> dict:
    """Each value read without deserializing, as it is kept: the frames a spillway sender sent as
    they are (a :class:`PickledFrames`), or what stock dask's comm would have made of the others."""
    out = {}
    for key, value in values.items():
        frames = _pickle_frames(value)
        out[key] = PickledFrames(frames) if frames is not None else _deserialize(value, deserializers)
    return out


#: Stands for a value whose side-channel fetch failed, until it is asked for again in-band.
_IN_BAND = object()


class _UndeserializedPool:
    """A worker's connection pool whose comms read messages without deserializing their values
    (``comm.deserialize = False``) until they go back to the pool. With ``plug``, a reply's
    side-channel references are fetched into ``buf`` as the reply is read, before the caller
    acknowledges it."""

    def __init__(self, pool, plug: _Plug | None, buf: SpillBuffer):
        self.pool = pool
        self.plug = plug
        self.buf = buf
        self.serializers = pool.serializers
        self.deserializers = pool.deserializers

    async def connect(self, addr, *args, **kwargs):
        comm = await self.pool.connect(addr, *args, **kwargs)
        comm.deserialize = False
        if self.plug is not None:
            read, plug, buf = comm.read, self.plug, self.buf

            async def read_and_fetch(*args, **kwargs):
                msg = await read(*args, **kwargs)
                await _fetch_references(plug, buf, msg, addr)
                return msg

            comm.read = read_and_fetch
        return comm

    def reuse(self, addr, comm) -> None:
        comm.deserialize = True
        comm.__dict__.pop("read", None)
        self.pool.reuse(addr, comm)


async def _fetch_references(plug: _Plug, buf: SpillBuffer, msg, peer: str) -> None:
    """Replace each side-channel reference in the ``get_data`` reply ``msg`` from ``peer`` with
    the value, fetched into ``buf`` (off the event loop, in this context: what it costs goes to the
    metrics of the activity that asked, gather-dep), or with ``_IN_BAND`` if the fetch failed."""
    if not isinstance(msg, dict) or msg.get("status") != "OK" or not isinstance(msg.get("data"), dict):
        return
    refs = {}
    for key, value in msg["data"].items():
        if isinstance(value, Serialized) and SIDE in value.header:
            ref = value.header[SIDE]
            ok = isinstance(ref, (list, tuple)) and len(ref) == 5
            # (a reference this version cannot read: the value in-band)
            refs[key] = tuple(ref) if ok else None
    for key in refs:
        _note_type(plug, key, msg["data"][key].header)
    if refs:
        loop = asyncio.get_running_loop()
        fetch = functools.partial(_fetch_all, buf, refs, peer, plug.settings)
        msg["data"].update(await loop.run_in_executor(None, contextvars.copy_context().run, fetch))


def _note_type(plug: _Plug, key: Hashable, header: dict) -> None:
    """Remember the type a spillway sender says a value received still pickled has, for the
    worker's record of it (``SpillwayPlugin.transition``)."""
    raw = header.get(TYPE)
    if not raw:
        return
    try:
        plug.types[key] = pickle.loads(raw)
    except Exception:  # a type this process cannot import: dask's record says frames
        pass


async def _read_inputs(worker, key: Hashable, loop_max: int | None) -> None:
    """Before a task runs: its inputs that are not objects in memory are made so now. Those held
    pickled in memory (received from a peer, or read back for one) are unpickled where stock dask
    unpickled them as they arrived: those larger than dask's ``distributed.comm.offload``
    threshold in dask's offload thread, the others on the event loop. When the inputs to read
    from disk or unpickle add up to more than ``loop_max`` bytes (None: no limit), all of them
    are read in dask's offload thread instead, so that the event loop is not held for the read
    (stock ``execute`` reads them on the loop). ``Worker.execute`` then finds them in memory; the
    task stream shows the time as ``disk-read`` when some came from disk (as dask names a slow
    read of an input), else as ``deserialize``.

    An input that fails to unpickle is left as it is: the stock ``execute`` then reads it inside its
    own error handling, and the task errs with the unpickling error, as any task whose input cannot
    be read."""
    ts = worker.state.tasks.get(key)
    buf = worker.data
    if ts is None or not isinstance(buf, SpillBuffer):
        return
    tiers = {d.key: buf.tier_if_present(d.key) for d in ts.dependencies}
    held = [d for d in ts.dependencies if tiers[d.key] in ("frames", "disk")]
    if not held:
        return
    start = time()
    try:
        if loop_max is not None and sum(d.nbytes or 0 for d in held) > loop_max:
            await _offload(_read_all, buf, [d.key for d in held])
        else:
            frames = [d for d in held if tiers[d.key] == "frames"]
            _read_all(buf, [d.key for d in frames if not _offloaded(d.nbytes or 0)])
            large = [d.key for d in frames if _offloaded(d.nbytes or 0)]
            if large:
                await _offload(_read_all, buf, large)
    except Exception:  # (the stock execute meets it again, and errs the task with it)
        return
    stop = time()
    if stop - start > 0.005:  # (dask's own threshold for recording a read of an input)
        action = "disk-read" if "disk" in tiers.values() else "deserialize"
        ts.startstops.append({"action": action, "start": start, "stop": stop})


def _read_all(buf: SpillBuffer, keys: list) -> None:
    for key in keys:
        with contextlib.suppress(KeyError):  # (released meanwhile: execute sees to it)
            buf[key]


def _fetch_all(buf: SpillBuffer, refs: dict, peer: str, settings: Settings) -> dict:
    """Each reference's value, or ``_IN_BAND``. After a failed fetch, the peer's side channel is
    not used for ``side_channel_retry_after`` seconds: the remaining references of this reply go
    in-band at once, and so do the peer's later values."""
    out = {}
    for key, ref in refs.items():
        if ref is None or _unreachable.blocked(peer):
            out[key] = _IN_BAND
            continue
        host, port, ticket, log_key, nbytes = ref
        try:
            out[key] = buf.receive(
                key,
                (host, port),
                ticket,
                log_key,
                nbytes,
                timeout=settings.side_channel_timeout,
                connect_timeout=settings.side_channel_connect_timeout,
            )
        except Exception as error:
            buf.peers.count("receive-side-failed", 1, "count")
            if _unreachable.failed(peer, settings.side_channel_retry_after):
                logger.warning(
                    "spillway.dask: fetching %r from %s's side channel (%s:%d) failed (%s); its "
                    "values come in-band for the next %.0f s",
                    key,
                    peer,
                    host,
                    port,
                    error,
                    settings.side_channel_retry_after,
                )
            out[key] = _IN_BAND
    return out


def _pickle_frames(value: Serialized, sent_by_spillway: bool = True) -> list | None:
    """The plain pickle frames ``[header, *buffers]`` of a value read without deserializing (its
    compression undone, its split frames merged as dask merges them), or None if it is not plain
    pickle frames (dask's own serializers, a header without one writeable flag per buffer) or, with
    ``sent_by_spillway``, not frames a spillway sender sent as they are."""
    header, frames = value.header, list(value.frames)
    if header.get("serializer") != "pickle" or (sent_by_spillway and not header.get(SENT_BY)):
        return None
    if any(header.get("compression") or ()):
        frames = _decompress(header, frames)
    if "split-num-sub-frames" in header:
        merged = []
        for n, at in zip(header["split-num-sub-frames"], header["split-offsets"]):
            parts = frames[at : at + n]
            try:
                merged.append(_merge_memoryviews(parts))
            except (ValueError, TypeError):
                merged.append(_host_array_from_buffers(parts))
        frames = merged
    writeable = header.get("writeable")
    if not frames or writeable is None or len(writeable) != len(frames) - 1:
        return None
    return frames


def _deserialize(value: Serialized, deserializers: list | None):
    """What stock dask's comm would have made of this value."""
    header, frames = value.header, list(value.frames)
    if "compression" in header:
        frames = _decompress(header, frames)
    return _merge_and_deserialize(header, frames, deserializers=deserializers)


# --------------------------------------------------------------------------------------------------
# Values scattered to the worker


def _wrap_listeners(worker, plug: _Plug) -> None:
    """The comms clients and the scheduler open to ``worker`` read messages without deserializing
    their values (:func:`_read_undeserialized`): ``scatter``'s values stay pickled."""
    for listener in list(getattr(worker, "listeners", ())):
        stock = listener.comm_handler
        if getattr(stock, "plug_of", None) is worker:
            continue

        async def handle(comm, stock=stock):
            if worker in _plugs and not _in_process(comm):
                try:
                    _read_undeserialized(worker, comm)
                except Exception:  # (a comm whose read cannot be wrapped: read the stock way)
                    logger.debug("spillway.dask: a comm read the stock way", exc_info=True)
            return await stock(comm)

        handle.plug_of = worker
        handle.stock = stock
        listener.comm_handler = handle
        plug.listeners.append(weakref.ref(listener))
    # The comms already open (the one that carried a registered plugin, the scheduler's pooled
    # ones) read the same way from their next message.
    for comm in list(getattr(worker, "_comms", ())):
        if not _in_process(comm) and getattr(comm.read, "plug_of", None) is not worker:
            with contextlib.suppress(Exception):  # (as above)
                _read_undeserialized(worker, comm)


def _unwrap_listeners(worker, plug: _Plug) -> None:
    for ref in plug.listeners:
        listener = ref()
        if listener is None:
            continue
        handler = listener.comm_handler
        if getattr(handler, "plug_of", None) is worker:
            listener.comm_handler = handler.stock


def _read_undeserialized(worker, comm) -> None:
    """``comm`` (one a peer opened to ``worker``) reads each message without deserializing it, then
    settles it (:func:`_settle_message`): what stock dask's comm would have made of it, but for the
    plain pickle values of an ``update_data`` (``scatter``), kept pickled."""
    stock_read = comm.read

    async def read(deserializers=None):
        if worker not in _plugs or not comm.deserialize:
            return await stock_read(deserializers=deserializers)
        comm.deserialize = False
        try:
            msg = await stock_read(deserializers=deserializers)
        finally:
            comm.deserialize = True
        try:
            return await _settle_message(worker, msg, deserializers)
        except EOFError:  # truncated or garbled frames: as dask's comm takes them
            comm.abort()
            raise _CommClosedError("aborted stream on truncated data") from None

    read.plug_of = worker
    comm.read = read


async def _settle_message(worker, msg, deserializers):
    """A message read without deserializing, as stock dask's comm would have read it (its values
    deserialized, in dask's offload thread when they add up to more than its threshold), but for the
    plain pickle values of an ``update_data``, which become :class:`PickledFrames`."""
    found: list = []
    _find_serialized(msg, found)
    if not found:
        return msg
    keep = set()
    if isinstance(msg, dict) and msg.get("op") == "update_data" and isinstance(msg.get("data"), dict):
        keep = {id(v) for v in msg["data"].values() if isinstance(v, Serialized)}
    settle = functools.partial(_settle_values, worker.data, msg, keep, deserializers)
    if _offloaded(sum(codec.frame_bytes(v.frames) for v in found)):
        return await _offload(settle)
    return settle()


def _holds_serialized(obj) -> bool:
    if isinstance(obj, Serialized):
        return True
    if type(obj) is dict:
        return any(_holds_serialized(v) for v in obj.values())
    if type(obj) in (list, tuple):
        return any(_holds_serialized(v) for v in obj)
    return False


def _find_serialized(obj, found: list) -> None:
    if isinstance(obj, Serialized):
        found.append(obj)
    elif type(obj) is dict:  # (msgpack's containers; what a pickled payload holds stays as it is)
        for v in obj.values():
            _find_serialized(v, found)
    elif type(obj) in (list, tuple):
        for v in obj:
            _find_serialized(v, found)


def _keeps_its_size(frames: list) -> bool:
    """Whether a scattered value is kept pickled: one of at least ``distributed.comm.offload`` bytes
    (where dask unpickles it off the event loop, for the cost it has) whose bytes are nearly all
    out-of-band buffers (arrays, blocks, bytes: a pickle header of at most 1% of them). The size the
    worker reports to the scheduler for it is then its pickled size, which differs from what dask's
    ``sizeof`` says of the object by about its header; smaller values, and values mostly made of
    Python objects (whose ``sizeof`` can be many times their pickle), are unpickled as dask does."""
    total = codec.frame_bytes(frames)
    return _offloaded(total) and memoryview(frames[0]).nbytes * 100 <= total


def _settle_values(buf: SpillBuffer, msg, keep: set, deserializers):
    kept = nbytes = 0

    def settle(obj):
        nonlocal kept, nbytes
        if not _holds_serialized(obj):
            return obj
        if isinstance(obj, Serialized):
            frames = _pickle_frames(obj, sent_by_spillway=False) if id(obj) in keep else None
            if frames is None or not _keeps_its_size(frames):
                return _deserialize(obj, deserializers)
            kept += 1
            nbytes += codec.frame_bytes(frames)
            return PickledFrames(frames)
        if type(obj) is dict:
            return {k: settle(v) for k, v in obj.items()}
        if type(obj) is list:
            return [settle(v) for v in obj]
        return tuple(settle(v) for v in obj)

    out = settle(msg)
    if kept and isinstance(buf, SpillBuffer):
        buf.peers.count("receive-scattered", kept, "count")
        buf.peers.count("receive-scattered", nbytes, "bytes")
        buf.peers.count("unpickle-avoided", kept, "count")
    return out

