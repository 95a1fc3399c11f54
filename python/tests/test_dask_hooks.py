"""Every private part of distributed that spillway uses (``spillway.hooks.HOOKS``), hidden in turn
from ``spillway.dask`` as a dask release without it would hide it: the worker starts, computes right,
says once which part it lacks, and runs without only what needs it (the plugin, spillway's store, or
one of the plugin's extras). Workers are real processes under their nannies: a ``LocalCluster`` for
the worker's hooks, ``dask worker --preload-nanny`` processes for the nanny's."""

from __future__ import annotations

import pytest

distributed = pytest.importorskip("distributed")
np = pytest.importorskip("numpy")

import hook_hiding  # noqa: E402
import spillway.dask  # noqa: E402
from spillway import hooks  # noqa: E402
from test_dask_cli import _workload, dask_cluster  # noqa: E402

MiB = 1 << 20

WORKER_HOOKS = [h for h in hooks.HOOKS if h.on == "worker"]
NANNY_HOOKS = [h for h in hooks.HOOKS if h.on == "nanny"]


def test_every_hook_can_be_hidden_and_is_found_on_this_dask():
    """Each hook has a way to hide it here, and the dask under test has every one."""
    for h in hooks.HOOKS:
        assert hook_hiding.is_module_attribute(h.name) or h.name in hook_hiding.RECIPES, h.name
    assert [h.name for h in hooks.HOOKS if h.check is None and hooks.get(h.name) is None] == []


def _status(dask_worker):
    return spillway.dask.status(dask_worker)


def _warnings_naming(logs: dict, name: str) -> list:
    """How many messages of each server's log name ``name`` as missing."""
    return [
        sum(1 for _level, msg in entries if f"this dask has no {name} " in msg)
        for entries in logs.values()
    ]


def _expected(h) -> tuple[bool, bool]:
    """(spillway's store, the plugin) on a worker without ``h``."""
    if h.needed_for == hooks.STORE:
        return h.on == "nanny", h.on == "nanny"  # (the worker preload still swaps the store)
    if h.needed_for == hooks.PLUGIN:
        return True, False
    return True, True


@pytest.mark.parametrize("hook", WORKER_HOOKS, ids=[h.name for h in WORKER_HOOKS])
def test_a_worker_without_a_hook_starts_and_runs_without_what_needs_it(hook):
    before, after = hook_hiding.preloads()
    with (
        distributed.LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            memory_limit="1GiB",
            dashboard_address=None,
            preload=[before, "spillway.dask", after],
            env={"SPILLWAY_TEST_HIDE": hook.name},
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        status = list(client.run(_status).values())
        store, plugin = _expected(hook)
        assert [(s["store"], s["plugin"]) for s in status] == [(store, plugin)] * 2
        assert [s["missing"] for s in status] == [[hook.name]] * 2
        _workload(client)
        said = _warnings_naming(client.get_worker_logs(), hook.name)
        # One warning per worker, in its log (but where the worker's log is what is missing).
        assert said == ([0, 0] if hook.needed_for == hooks.LOGS else [1, 1])


@pytest.mark.parametrize("hook", NANNY_HOOKS, ids=[h.name for h in NANNY_HOOKS])
def test_a_nanny_without_a_hook_starts_its_worker_and_says_so(tmp_path, hook):
    before, after = hook_hiding.preloads()
    args = ["--preload-nanny", before, "--preload-nanny", "spillway.dask", "--preload-nanny", after]
    with dask_cluster(tmp_path, args, env={"SPILLWAY_TEST_HIDE": hook.name}) as client:
        status = list(client.run(_status).values())
        store, plugin = _expected(hook)
        assert [(s["store"], s["plugin"]) for s in status] == [(store, plugin)] * 2
        _workload(client)
        assert _warnings_naming(client.get_worker_logs(nanny=True), hook.name) == [1, 1]


def test_spillways_messages_are_in_the_workers_logs():
    """``Client.get_worker_logs()`` has what spillway says on the worker, as it has dask's own."""
    with (
        distributed.LocalCluster(
            n_workers=1, memory_limit="1GiB", dashboard_address=None, preload=["spillway.dask"]
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        client.run(lambda: __import__("logging").getLogger("distributed.spillway.dask").warning("probe 17"))
        [logs] = client.get_worker_logs().values()
        assert [msg for _level, msg in logs if "probe 17" in msg], logs
