"""A real dask cluster on ``spillway.SpillBuffer`` under memory pressure, as users run it.

A ``LocalCluster`` of Nanny worker processes with real memory limits and dask's default thresholds
runs the cluster harness's workload (``python/bench/cluster_bench.py``, size ``ci``): an array
persisted that does not fit in memory, a transposed sum, a task rechunk, a task shuffle of a
dataframe, tasks on one worker reading an array persisted on the other, and the retirement of a
worker (the last two move spilled data between workers). No
worker may be restarted, and every phase's result must be what dask computes without a cluster.
Speed and the comparison with dask's own store are the harness's business, not this test's.
"""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("distributed")
pytest.importorskip("pandas")
np = pytest.importorskip("numpy")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "bench"))
import cluster_bench

#: Phases whose result is a float sum: the order of the additions is the graph's, but numpy's
#: pairwise sum also depends on the alignment of the buffers (data received from a peer lands in
#: buffers aligned as the comm allocates them). Every other result is compared exactly (the crc32 of
#: every chunk's bytes after the moves).
FLOAT_SUMS = ("transpose-sum", "rechunk")


def test_a_tight_memory_cluster_restarts_no_worker_and_computes_what_dask_computes(tmp_path):
    size = cluster_bench.SIZES["ci"]
    run = cluster_bench.run_one("spillway", size, directory=str(tmp_path))
    assert run.completed, run.error
    assert run.backend, "the workers' data is not a spillway SpillBuffer"
    assert run.restarts == 0 and run.nanny_kills == 0, (run.restarts, run.nanny_kills, run.peak_rss)

    # Memory pressure: most of the persisted array went to disk.
    persisted = run.worker_stats["persist"]
    written = sum(s["metrics"].get("disk-write bytes", 0) for s in persisted.values())
    assert written > size.array_bytes / 3, written
    # The moves moved something.
    assert run.notes["transfer received bytes"] >= size.transfer_bytes, run.notes
    assert run.notes["retire moved keys"] > 0, run.notes

    # The harness counts every worker's (de)serializations, the store's own included: each value
    # the persist wrote to disk was serialized, and each key the retired worker moved was
    # serialized by it (a worker closed in the phase, counted at its close) and deserialized by
    # the worker that took it (dask's comm, no plugin).
    counts = cluster_bench.serial_by_phase(run)
    assert set(run.serial["persist"]) == set(persisted), run.serial
    spilled = sum(s["metrics"].get("disk-write count", 0) for s in persisted.values())
    assert counts["persist"][0] >= spilled > 0, (counts, spilled)
    assert len(run.serial["retire"]) == len(persisted), run.serial  # the retired one too
    moved = run.notes["retire moved keys"]
    assert counts["retire"][0] >= moved and counts["retire"][1] >= moved, (counts, moved)

    # The CPU each phase cost: the machine's busy time covers the workers' own (they run on it),
    # and cannot exceed what its cores had in the phase.
    for phase, cpu in run.cpu.items():
        user, system = run.worker_cpu[phase]
        assert 0 < user + system <= cpu["busy"] + 0.5, (phase, run.worker_cpu[phase], cpu)
        assert cpu["busy"] <= cpu["total"] <= cpu["cores"] * run.phase_seconds[phase] * 1.2 + 0.5, (
            phase,
            cpu,
            run.phase_seconds[phase],
        )

    # The event loop's watch: every worker ticked in every phase; the store's part of a tick is
    # part of it; each long tick is put down to one of the causes.
    for phase, stats in run.worker_stats.items():
        for s in stats.values():
            loop = s["loop"]
            assert loop["ticks"] > 0, (phase, loop)
            assert loop["store_max_ms"] <= loop["max_ms"] + 1e-6, (phase, loop)
            assert set(loop["long"]) <= {"store", "loop", "core", "gil"}, (phase, loop)
            assert sum(n for n, _ in loop["long"].values()) <= loop["ticks"], (phase, loop)
    # The doubts' counters: the values each move moved, and (dask's comm without the plugin
    # unpickles what arrives) at least one unpickle each; the transfer's sender read the chunks it
    # had spilled back from disk to send them.
    doubts = cluster_bench.doubts_by_phase(run)
    assert doubts["retire"]["moved"] >= moved, doubts["retire"]
    assert doubts["retire"]["unpickles"] >= doubts["retire"]["moved"], doubts["retire"]
    assert doubts["transfer"]["moved"] * size.chunk_bytes >= size.transfer_bytes, doubts["transfer"]
    assert doubts["transfer"]["disk_read_bytes"] > 0, doubts["transfer"]

    expected = cluster_bench.reference(size)
    for phase, value in expected.items():
        got = run.values[phase]
        if phase in FLOAT_SUMS:
            np.testing.assert_allclose(got, value, rtol=1e-12, err_msg=phase)
        else:
            np.testing.assert_array_equal(np.asarray(got), np.asarray(value), err_msg=phase)


def _can_make_namespaces() -> bool:
    """Whether this process may build what ``netns.py`` builds: a namespace, a veth pair into it
    and a token-bucket qdisc on it (root, ``ip`` and ``tc``, a kernel with veth and tbf)."""
    import shutil
    import subprocess

    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        return False
    steps = [
        ["ip", "netns", "add", "spwb-probe"],
        ["ip", "link", "add", "spwb-probe0", "type", "veth", "peer", "name", "spwb-probe1"],
        ["ip", "link", "set", "spwb-probe1", "netns", "spwb-probe"],
        ["tc", "qdisc", "add", "dev", "spwb-probe0", "root", "tbf", "rate", "1gbit", "burst",
         "256kb", "latency", "50ms"],
    ]
    ok = all(subprocess.run(step, capture_output=True).returncode == 0 for step in steps)
    subprocess.run(["ip", "link", "del", "spwb-probe0"], capture_output=True)
    subprocess.run(["ip", "netns", "del", "spwb-probe"], capture_output=True)
    return ok


@pytest.mark.skipif(not _can_make_namespaces(), reason="needs root, ip and tc (network namespaces)")
def test_cli_workers_in_network_namespaces_move_spilled_data_over_their_links(tmp_path):
    """The harness's honest network (``cluster_bench.py --net``): ``dask worker`` processes with
    spillway's preload, each in a network namespace on a rate-limited link. What one worker reads
    from the other crosses both links (and nothing else carries it), no worker restarts, and the
    result is what dask computes without a cluster."""
    size = cluster_bench.SIZES["ci"]
    phases = ("persist", "transfer")
    run = cluster_bench.run_one(
        "spillway+plugin", size, phases=phases, directory=str(tmp_path), net="1gbit"
    )
    assert run.completed, run.error
    assert run.backend, "the CLI workers' data is not a spillway SpillBuffer"
    assert run.restarts == 0 and run.nanny_kills == 0, (run.restarts, run.nanny_kills)
    moved = run.notes["transfer received bytes"]
    assert moved >= size.transfer_bytes, run.notes
    # Sent over the sender's link and received over the receiver's.
    assert run.link_bytes["transfer"] >= 2 * moved, (run.link_bytes, moved)
    expected = cluster_bench.reference(size, phases)
    np.testing.assert_array_equal(np.asarray(run.values["transfer"]), np.asarray(expected["transfer"]))
    assert not any(n.startswith("spwb-") for n in os.listdir("/sys/class/net")), "links left behind"


@pytest.mark.skipif(
    not _can_make_namespaces() or not __import__("shutil").which("nft"),
    reason="needs root, ip, tc and nft (network namespaces, packets dropped by nftables)",
)
def test_the_fault_run_completes_with_identical_results_on_both_stores(tmp_path):
    """``python/bench/faults.py``: spilled values moving between ``dask worker`` processes in
    network namespaces while the sender is killed with SIGKILL, 1% of packets are dropped and a
    receiver's link goes down for a second: on dask's store and on spillway + plugin, every run
    completes within its deadline with the results computed without a cluster."""
    import argparse
    import random

    import faults

    args = argparse.Namespace(workers=3, memory_limit=600 << 20, values=12, value_mib=8,
                              drop_per_mille=10, flap_seconds=1.0, deadline=300.0)
    rng = random.Random(7)
    for store in ("dask", "spillway+plugin"):
        r = faults.one_run(store, args, rng, str(tmp_path))
        assert r["completed"] and r["identical"], r
        assert r["faults"]["sigkill"] == 1 and r["faults"]["flaps"] == 1, r


def test_values_copied_to_a_worker_that_never_uses_them_stay_pickled_with_the_plugin(tmp_path):
    """The harness's ``replicate`` phase (the ``moved`` workload): a copy of every chunk of an array
    on every worker, which no task there uses. On dask's store each copy that arrives is unpickled;
    with spillway's plugin it stays pickled until a task asks for it, so none is. Both stores hold
    every copy, and the phase's result is the one computed without a cluster."""
    size = cluster_bench.SIZES["ci"]
    phases = ("replicate",)
    expected = cluster_bench.reference(size, phases)["replicate"]
    chunks, workers = expected
    unpickles = {}
    for store in ("dask", "spillway+plugin"):
        directory = tmp_path / store
        directory.mkdir()
        run = cluster_bench.run_one(store, size, phases=phases, directory=str(directory))
        assert run.completed, run.error
        assert tuple(run.values["replicate"]) == tuple(expected), run.values
        doubts = cluster_bench.doubts_by_phase(run)["replicate"]
        assert doubts["moved"] == chunks * (workers - 1), doubts
        unpickles[store] = doubts["unpickles"]
    assert unpickles["dask"] >= chunks * (workers - 1), unpickles
    assert unpickles["spillway+plugin"] == 0, unpickles
