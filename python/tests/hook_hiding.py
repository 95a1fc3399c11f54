"""For test_dask_hooks.py: hide one of distributed's private parts that spillway uses
(``spillway.hooks.HOOKS``) from ``spillway.dask`` in a dask process, as a dask release without it
would, and put it back right after, so that dask itself keeps working.

``SPILLWAY_TEST_HIDE`` names the hook (its ``Hook.name``). Two preloads bracket ``spillway.dask``
(:func:`preloads`): the first hides the part (a module attribute as the preloads are imported, an
attribute of the worker or nanny as their ``dask_setup`` runs), the last puts it back. dask imports
and starts preloads in order, without running anything else between them.
"""

from __future__ import annotations

import importlib
import os

NAME = os.environ.get("SPILLWAY_TEST_HIDE", "")

_saved: dict = {}


def _owner(name: str) -> tuple[object, str]:
    """(the object that holds a module attribute, its attribute name), as ``spillway.hooks.owner``
    finds it. (Not that function: importing ``spillway.hooks`` here would resolve the hooks before
    the part is hidden.)"""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:-1]:
            obj = getattr(obj, attr)
        return obj, parts[-1]
    raise LookupError(name)


def _task_state_fields():
    from distributed.worker_state_machine import TaskState

    return TaskState.__dataclass_fields__


#: How each instance hook is hidden and put back: (hide(server) -> saved, restore(server, saved)).
RECIPES = {
    'Worker.handlers["get_data"]': (
        lambda w: w.handlers.pop("get_data"),
        lambda w, v: w.handlers.__setitem__("get_data", v),
    ),
    "Worker.execute(key, stimulus_id=...)": (
        lambda w: setattr(w, "execute", None),
        lambda w, v: delattr(w, "execute"),
    ),
    "Worker.rpc.connect/reuse": (
        lambda w: setattr(w.rpc, "reuse", None),
        lambda w, v: delattr(w.rpc, "reuse"),
    ),
    "Worker.state.tasks": (
        lambda w: (w.state.tasks, setattr(w.state, "tasks", None))[0],
        lambda w, v: setattr(w.state, "tasks", v),
    ),
    "TaskState.type": (
        lambda w: _task_state_fields().pop("type"),
        lambda w, v: _task_state_fields().__setitem__("type", v),
    ),
    "Worker.plugins": (
        lambda w: (w.plugins, setattr(w, "plugins", None))[0],
        lambda w, v: setattr(w, "plugins", v),
    ),
    "Worker.memory_manager.data": (
        lambda w: (w.memory_manager.data, setattr(w.memory_manager, "data", None))[0],
        lambda w, v: setattr(w.memory_manager, "data", v),
    ),
    "Worker.state.data": (
        lambda w: (w.state.data, setattr(w.state, "data", None))[0],
        lambda w, v: setattr(w.state, "data", v),
    ),
    "Worker._deque_handler": (
        lambda w: (w._deque_handler, delattr(w, "_deque_handler"))[0],
        lambda w, v: setattr(w, "_deque_handler", v),
    ),
    "Worker.bandwidth_types": (
        lambda w: (w.bandwidth_types, setattr(w, "bandwidth_types", None))[0],
        lambda w, v: setattr(w, "bandwidth_types", v),
    ),
    "Worker.listeners[].comm_handler": (
        lambda w: (w.listeners, setattr(w, "listeners", None))[0],
        lambda w, v: setattr(w, "listeners", v),
    ),
    "Worker._comms": (
        lambda w: (w._comms, setattr(w, "_comms", None))[0],
        lambda w, v: setattr(w, "_comms", v),
    ),
    "Nanny.worker_kwargs": (
        lambda n: (n.worker_kwargs, setattr(n, "worker_kwargs", None))[0],
        lambda n, v: setattr(n, "worker_kwargs", v),
    ),
    "Nanny.preload": (
        lambda n: (n.preload, delattr(n, "preload"))[0],
        lambda n, v: setattr(n, "preload", v),
    ),
}


def is_module_attribute(name: str) -> bool:
    return name.startswith("distributed.")


def hide_module_attribute() -> None:
    # (dask imports a preload's file twice: once, then a reload)
    if is_module_attribute(NAME) and "module" not in _saved:
        owner, attr = _owner(NAME)
        _saved["module"] = (owner, attr, owner.__dict__[attr])
        delattr(owner, attr)


def restore_module_attribute() -> None:
    if "module" in _saved:
        owner, attr, value = _saved.pop("module")
        setattr(owner, attr, value)


def hide(server) -> None:
    if NAME in RECIPES:
        _saved["server"] = RECIPES[NAME][0](server)


def restore(server) -> None:
    if NAME in RECIPES and "server" in _saved:
        RECIPES[NAME][1](server, _saved.pop("server"))


def preloads() -> tuple[str, str]:
    """The preloads (as dask takes the text of a script) that go before and after
    ``spillway.dask``."""
    here = os.path.dirname(os.path.abspath(__file__))
    head = f"import sys; sys.path.insert(0, {here!r}); import hook_hiding as h"
    return (
        f"{head}; h.hide_module_attribute(); dask_setup = h.hide",
        f"{head}; h.restore_module_attribute(); dask_setup = h.restore",
    )

