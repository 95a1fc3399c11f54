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
