"""``SpillBuffer.receive``: values fetched from a spillway transfer server (the side channel of
:mod:`spillway.dask`), into memory or straight into the buffer's log, against real servers and a
scripted one on 127.0.0.1."""

from __future__ import annotations

import gc
import pickle
import socket
import struct
import threading
import zlib

import pytest

import spillway
from spillway._core import TransferServer

MiB = 1 << 20


def _frames(value) -> list:
    buffers = []
    header = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    return [header, *(b.raw() for b in buffers)]


def test_a_granted_value_arrives_in_memory_under_target_and_on_disk_over_it(make_buffer):
    sender = make_buffer(target=1 * MiB, process_target=None)
    receiver = make_buffer(target=8 * MiB, process_target=None)
    value = bytes(range(256)) * (12 * 4096)  # 12 MiB: heavier than the sender's target
    sender["v"] = value
    assert sender.tier("v") == "disk"
    log, log_key, nbytes = sender.disk_record("v")
    with TransferServer() as server:
        small = bytes(7) * 1000
        sender["s"] = small
        sender.evict()
        s_log, s_key, s_bytes = sender.disk_record("s")
        got = receiver.receive("s", server.address, server.grant(s_log, s_key), s_key, s_bytes)
        assert type(got) is spillway.PickledFrames
        receiver["s"] = got
        assert receiver.tier("s") == "frames" and receiver["s"] == small

        ticket = server.grant(log, log_key)
        got = receiver.receive("v", server.address, ticket, log_key, nbytes)
        assert type(got) is spillway.ReceivedRecord and got.__sizeof__() == nbytes
        writes = receiver.cumulative_metrics["disk-write", "count"]
        assert writes == 1, "its arrival wrote it"
        receiver["v"] = got
        assert receiver.tier("v") == "disk"
        assert receiver.spilled_total.disk == nbytes
        assert receiver["v"] == value
        m = receiver.spillway_metrics
        assert m["receive-memory", "count"] == 1 and m["receive-disk", "count"] == 1
        assert m["disk-write", "count"] == writes, "a received value is not written again"

        # Used once: the same ticket again is refused, and nothing is kept.
        before = receiver.log.disk_bytes
        with pytest.raises(spillway.SpillwayError, match="not authorized"):
            receiver.receive("w", server.address, ticket, log_key, nbytes)
        assert "w" not in receiver and receiver.log.disk_bytes == before


def test_a_received_record_never_set_is_deleted(make_buffer):
    sender = make_buffer(target=1 * MiB, process_target=None)
    receiver = make_buffer(target=1 * MiB, process_target=None)
    sender["v"] = bytes(3 * MiB)
    log, log_key, nbytes = sender.disk_record("v")
    with TransferServer() as server:
        got = receiver.receive("v", server.address, server.grant(log, log_key), log_key, nbytes)
    received_log = receiver.log
    assert received_log.disk_bytes == nbytes and "v" not in receiver
    del got  # dask dropped it: its task was released meanwhile
    gc.collect()
    assert received_log.disk_bytes == 0 and "v" not in receiver


def _scripted_server(frames: list, started: threading.Event, go: threading.Event):
    """A one-request transfer server that sends 64 KiB of the value, then waits for ``go``."""
    payload = b"".join(frames)
    assert len(frames) == 1  # (one frame: its layout is the frame itself)
    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = listener.accept()
        with conn, listener:
            conn.recv(8, socket.MSG_WAITALL)
            conn.sendall(b"SPWY" + struct.pack("<HH", 2, 0))
            head = conn.recv(29, socket.MSG_WAITALL)
            conn.recv(struct.unpack("<I", head[25:29])[0], socket.MSG_WAITALL)
            n = len(payload)
            header = struct.pack("<B3xIQQI4x", 0, 1, n, n, zlib.crc32(payload))
            conn.sendall(b"\0" + header + struct.pack("<Q", n) + payload[: 64 << 10])
            started.set()
            go.wait(120)
            conn.sendall(payload[64 << 10 :])
            conn.recv(1)  # until the client hangs up

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return listener.getsockname()[:2], t


def test_spills_go_on_while_a_value_arrives_straight_to_disk(make_buffer):
    """A value received straight to disk goes to a log of its own: while its peer holds it back
    mid-value, the buffer spills (into its log) as usual."""
    buf = make_buffer(target=1 * MiB, process_target=None)
    value = bytes(range(256)) * (16 * 4096)  # 16 MiB, in one frame
    frames = [pickle.dumps(value, protocol=4)]
    started, go = threading.Event(), threading.Event()
    address, server = _scripted_server(frames, started, go)
    got = []
    receiving = threading.Thread(
        target=lambda: got.append(buf.receive("k", address, bytes(24), b"k", len(frames[0]))),
        daemon=True,
    )
    receiving.start()
    try:
        assert started.wait(60), "the scripted server never sent"
        spill = threading.Thread(target=buf.__setitem__, args=("a", bytes(3 * MiB)), daemon=True)
        spill.start()
        spill.join(60)
        assert not spill.is_alive(), "a spill waited for the value arriving"
        assert buf.tier("a") == "disk"
    finally:
        go.set()
    receiving.join(60)
    server.join(60)
    assert type(got[0]) is spillway.ReceivedRecord
    buf["k"] = got[0]
    assert buf.tier("k") == "disk" and buf["k"] == value and buf["a"] == bytes(3 * MiB)


def test_a_grant_made_for_one_peer_address_is_refused_from_another(make_buffer):
    sender = make_buffer(target=1 * MiB, process_target=None)
    receiver = make_buffer(target=64 * MiB, process_target=None)
    sender["v"] = bytes(5 * MiB)
    log, log_key, nbytes = sender.disk_record("v")
    with TransferServer() as server:
        elsewhere = server.grant(log, log_key, "10.9.8.7")
        with pytest.raises(spillway.SpillwayError, match="not authorized"):
            receiver.receive("v", server.address, elsewhere, log_key, nbytes)
        here = server.grant(log, log_key, "127.0.0.1")
        receiver["v"] = receiver.receive("v", server.address, here, log_key, nbytes)
        assert receiver["v"] == bytes(5 * MiB)
        with pytest.raises(ValueError, match="not an IP address"):
            server.grant(log, log_key, "localhost")


def test_a_value_that_is_not_the_size_announced_is_refused_and_not_kept(make_buffer):
    sender = make_buffer(target=1 * MiB, process_target=None)
    sender["v"] = bytes(range(256)) * (20 * 4096)  # 20 MiB
    log, log_key, nbytes = sender.disk_record("v")
    with TransferServer() as server:
        for target in (64 * MiB, 1 * MiB):  # into memory, then straight to disk
            receiver = make_buffer(target=target, process_target=None)
            ticket = server.grant(log, log_key)
            with pytest.raises(spillway.SpillwayError, match="announced"):
                receiver.receive("v", server.address, ticket, log_key, nbytes - 1)
            assert receiver.log.disk_bytes == 0 and len(receiver.log) == 0
            # Far larger than announced: refused by the header's bound, before it is read.
            ticket = server.grant(log, log_key)
            with pytest.raises(spillway.SpillwayError, match="over the limit"):
                receiver.receive("v", server.address, ticket, log_key, 1000)
            assert receiver.log.disk_bytes == 0 and len(receiver.log) == 0


def test_a_fetch_into_a_key_that_fails_leaves_its_old_value_and_its_accounting(make_buffer, tmp_path):
    """``fetch_into`` (a ``Log``) and ``fetch_into_store`` (a ``Store``) of a value whose size is not
    what was announced: refused as its header arrives, so the key's old value stays (on a durable
    log, across a reopen too) and the log's accounting is what it was."""
    from spillway._core import Store, fetch_into, fetch_into_store

    sender = make_buffer(target=1 * MiB, process_target=None)
    sender["v"] = bytes(range(256)) * (4 * 4096)  # 4 MiB
    log_, log_key, nbytes = sender.disk_record("v")
    with TransferServer() as server:
        path = str(tmp_path / "log")
        log = spillway.Log(path, durable=True, max_disk_bytes=64 * MiB, backend="portable")
        log.put(b"k", [b"old value"])
        before = (log.disk_bytes, log.stored_bytes(b"k"))
        for wrong in (nbytes - 1, nbytes + 1):
            with pytest.raises(spillway.SpillwayError, match="announced"):
                fetch_into(log, server.address, server.grant(log_, log_key), log_key, b"k", wrong)
            assert [bytes(f) for f in log.get(b"k")] == [b"old value"]
            assert (log.disk_bytes, log.stored_bytes(b"k")) == before
        # The right size replaces it.
        assert fetch_into(log, server.address, server.grant(log_, log_key), log_key, b"k", nbytes) == nbytes
        assert b"".join(bytes(f) for f in log.get(b"k")) == b"".join(bytes(f) for f in sender.get_serialized("v"))
        log.close()

        log = spillway.Log(path, durable=True, backend="portable")
        log.put(b"j", [b"kept"])
        log.sync()
        with pytest.raises(spillway.SpillwayError, match="announced"):
            fetch_into(log, server.address, server.grant(log_, log_key), log_key, b"j", nbytes - 1)
        log.close()
        log = spillway.Log(path, durable=True, backend="portable")  # what a reopen finds
        assert [bytes(f) for f in log.get(b"j")] == [b"kept"]
        log.close()

        store = Store(str(tmp_path / "store"), 1 << 30)
        try:
            store.put(b"s", b"old")
            with pytest.raises(spillway.SpillwayError, match="announced"):
                fetch_into_store(store, server.address, server.grant(log_, log_key), log_key, b"s", nbytes + 1)
            assert store.get(b"s") == b"old"
            store.check_accounting()
        finally:
            store.close()


def test_impossible_durations_are_a_value_error_not_a_panic():
    from spillway._core import fetch

    for bad in (1e19, float("inf"), float("nan"), -1.0, 0.0, 366 * 24 * 3600.0):
        with pytest.raises(ValueError, match="seconds"):
            TransferServer(lifetime=bad)
        with pytest.raises(ValueError, match="seconds"):
            TransferServer(timeout=bad)
        with pytest.raises(ValueError, match="seconds"):
            fetch(("127.0.0.1", 1), bytes(24), b"k", 1, timeout=bad)
        with pytest.raises(ValueError, match="seconds"):
            fetch(("127.0.0.1", 1), bytes(24), b"k", 1, connect_timeout=bad)


def test_a_key_the_buffer_holds_is_received_by_the_same_rule_as_any_other(make_buffer):
    """Over the target, a second fetch of a key the buffer has goes straight to disk, as a first
    one does (it used to come into memory whatever the target); the key keeps its old value
    until the new one is set."""
    sender = make_buffer(target=1 * MiB, process_target=None)
    sender["v"] = bytes(range(256)) * (8 * 4096)  # 8 MiB
    log, log_key, nbytes = sender.disk_record("v")
    receiver = make_buffer(target=4 * MiB, process_target=None)
    receiver["v"] = b"old"
    with TransferServer() as server:
        got = receiver.receive("v", server.address, server.grant(log, log_key), log_key, nbytes)
        assert type(got) is spillway.ReceivedRecord, "over the target: straight to disk"
        assert receiver["v"] == b"old", "the old value until the new one is set"
        receiver["v"] = got
    assert receiver.tier("v") == "disk" and receiver["v"] == sender["v"]
    assert len(receiver) == 1


def test_a_value_received_into_memory_holds_its_room_until_it_is_set_or_dropped(make_buffer):
    """Where a value goes is the store's rule (``Store.admit``): a value received into memory counts
    against the next arrivals until it is set (then its frames count, once) or dropped."""
    sender = make_buffer(target=1 * MiB, process_target=None)
    for name in "abcd":
        sender[name] = bytes([ord(name)]) * (3 * MiB // 2)  # heavier than the sender's target
    receiver = make_buffer(target=4 * MiB, process_target=None)
    with TransferServer() as server:

        def receive(name):
            log, log_key, nbytes = sender.disk_record(name)
            return receiver.receive(name, server.address, server.grant(log, log_key), log_key, nbytes)

        a = receive("a")
        b = receive("b")
        assert type(a) is type(b) is spillway.PickledFrames, "3 MiB fit under 4 MiB"
        c = receive("c")
        assert type(c) is spillway.ReceivedRecord, "a and b not yet set hold their room"
        del c
        receiver["a"] = a
        assert receiver.tier("a") == "frames"
        del b
        gc.collect()
        d = receive("d")
        assert type(d) is spillway.PickledFrames, "b, dropped, and a, set, no longer hold room twice"
        receiver["d"] = d
    assert receiver["a"] == sender["a"] and receiver["d"] == sender["d"]
    assert "b" not in receiver and "c" not in receiver
