"""The Rust core directly: frames in and out, both backends, typed errors, limits."""

from __future__ import annotations

import errno
import os
import shutil
import threading

import numpy as np
import pytest

from spillway import Corrupt, DiskFull, Log, ReadOnly, SpillwayError


def uring_required() -> bool:
    return os.environ.get("SPILLWAY_REQUIRE_URING") == "1"


@pytest.mark.parametrize("backend", ["portable", "uring"])
@pytest.mark.parametrize("compression", ["none", "lz4"])
def test_frames_round_trip_aligned_and_writable(tmp_path, backend, compression):
    try:
        log = Log(str(tmp_path / "log"), backend=backend, compression=compression)
    except OSError as e:
        if backend == "uring" and not uring_required():
            pytest.skip(f"io_uring unavailable: {e}")
        raise
    assert log.backend == backend
    frames = [b"header", bytearray(b"x" * 100_001), memoryview(b"tail" * 1000), b""]
    assert log.put(b"k", frames) == sum(len(f) for f in frames)
    got = log.get(b"k")
    assert [bytes(g) for g in got] == [bytes(f) for f in frames]
    for g in got:
        assert isinstance(g, memoryview) and not g.readonly
        if len(g):
            # Frames come back 64-byte aligned: numpy wraps them without a copy.
            assert np.frombuffer(g, dtype=np.uint8).ctypes.data % 64 == 0
    got[1][0] = ord("y")  # writable, and private to this result
    assert bytes(log.get(b"k")[1][:1]) == b"x"
    assert log.stored_bytes(b"k") == log.disk_bytes == sum(len(f) for f in frames)
    assert b"k" in log and len(log) == 1 and log.keys() == [b"k"]
    assert log.delete(b"k") is True and log.delete(b"k") is False
    with pytest.raises(KeyError):
        log.get(b"k")
    assert log.disk_bytes == 0
    log.close()
    log.close()  # idempotent
    with pytest.raises(ValueError):
        log.get(b"k")


def test_numpy_buffers_go_in_without_joining(tmp_path):
    log = Log(str(tmp_path / "log"))
    a = np.arange(1_000_000, dtype=np.float64)
    log.put(b"a", [memoryview(a).cast("B")])
    (back,) = log.get(b"a")
    assert np.array_equal(np.frombuffer(back, dtype=np.float64), a)
    # Non-contiguous exports are accepted too (copied once).
    log.put(b"b", [memoryview(np.arange(10, dtype=np.uint8))[::2]])
    assert bytes(log.get(b"b")[0]) == bytes(range(0, 10, 2))


def test_max_disk_bytes_refuses_whole_values(tmp_path):
    log = Log(str(tmp_path / "log"), max_disk_bytes=1000)
    log.put(b"a", [b"x" * 600])
    with pytest.raises(DiskFull):
        log.put(b"b", [b"x" * 600])
    assert issubclass(DiskFull, SpillwayError)
    assert b"b" not in log and log.disk_bytes == 600
    log.put(b"a", [b"x" * 900])  # replacing counts the old value out
    assert log.disk_bytes == 900


def test_bad_arguments_and_os_errors_are_typed(tmp_path):
    with pytest.raises(ValueError):
        Log(str(tmp_path / "a"), compression="zstd")
    with pytest.raises(ValueError):
        Log(str(tmp_path / "b"), backend="fast")
    (tmp_path / "file").write_bytes(b"not a directory")
    with pytest.raises(OSError) as e:
        Log(str(tmp_path / "file" / "log"))
    assert e.value.errno in (errno.ENOTDIR, errno.EEXIST)
    log = Log(str(tmp_path / "c"))
    with pytest.raises(ValueError):
        log.put(b"k" * (64 * 1024 + 1), [b"v"])


def test_concurrent_puts_and_gets_from_threads(tmp_path):
    log = Log(str(tmp_path / "log"))
    errors = []

    def work(t):
        try:
            for i in range(200):
                key = b"%d-%d" % (t, i)
                val = bytes([t]) * (i * 37 % 5000)
                log.put(key, [val])
                assert bytes(log.get(key)[0]) == val
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(log) == 1600


@pytest.mark.parametrize("write_behind_bytes", [None, 0, 1 << 20])
def test_small_puts_written_behind_read_back_and_survive_close(tmp_path, write_behind_bytes):
    path = str(tmp_path / "log")
    log = Log(path, write_behind_bytes=write_behind_bytes)
    values = {b"k%d" % i: [b"h" * (i % 50), bytes([i % 251]) * (i * 53 % 3000)] for i in range(500)}
    for key, frames in values.items():
        log.put(key, frames)
        assert [bytes(f) for f in log.get(key)] == frames  # readable at once, pending or not
    log.put(b"k0", [b"newer"])
    values[b"k0"] = [b"newer"]
    log.close()  # writes whatever is pending
    log = Log(path)
    assert len(log) == len(values)
    for key, frames in values.items():
        assert [bytes(f) for f in log.get(key)] == frames
    log.close()


def test_write_behind_budget_is_validated(tmp_path):
    with pytest.raises(ValueError):
        Log(str(tmp_path / "log"), write_behind_bytes=1 << 40)


def test_a_damaged_record_fails_its_own_get_not_the_reopen(tmp_path):
    path = str(tmp_path / "log")
    log = Log(path, durable=True)
    values = {b"k%d" % i: [b"h", bytes([i]) * 5000] for i in range(40)}
    for key, frames in values.items():
        log.put(key, frames)
    log.close()
    # Flip one bit in the middle of one value's payload.
    segment = os.path.join(path, "segments", sorted(os.listdir(os.path.join(path, "segments")))[0])
    with open(segment, "r+b") as f:
        data = f.read()
        at = data.index(bytes([7]) * 5000) + 2500
        f.seek(at)
        f.write(bytes([data[at] ^ 0x10]))
    log = Log(path, durable=True)  # reads heads only: the damage does not stop the open
    assert len(log) == len(values)
    assert log.stored_bytes(b"k3") == 5001
    with pytest.raises(Corrupt, match="segment 1 at offset"):
        log.get(b"k7")
    assert issubclass(Corrupt, SpillwayError) and issubclass(ReadOnly, SpillwayError)
    for key, frames in values.items():
        if key != b"k7":
            assert [bytes(f) for f in log.get(key)] == frames
    log.close()


def test_log_has_its_docstring():
    assert "append-only segment log" in (Log.__doc__ or "")


def test_close_waits_for_a_put_running_on_another_thread(tmp_path):
    """``close()`` returns only once the log is closed, after the operations already running on
    other threads: SpillBuffer removes the directory right after ``close()``, so a close that
    returned earlier would have it removed under a running put, which would then fail to create its
    segment file."""
    path = tmp_path / "log"
    log = Log(str(path), segment_bytes=64 << 10)
    started, release = threading.Event(), threading.Event()

    def frames():  # the put holds the log while it iterates the frames
        yield b"x" * 1000
        started.set()
        release.wait(30)
        yield b"y" * (256 << 10)  # larger than a segment: the put creates a new segment file

    result = {}

    def put():
        try:
            result["put"] = log.put(b"k", frames())
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            result["put"] = e

    def close():  # as SpillBuffer.close does
        log.close()
        shutil.rmtree(path)

    putter = threading.Thread(target=put)
    putter.start()
    assert started.wait(30)
    closer = threading.Thread(target=close)
    closer.start()
    second = threading.Thread(target=log.close)  # a second close waits as well
    second.start()
    closer.join(timeout=0.5)  # a close that did not wait would be done by now, the removal too
    second.join(timeout=0.5)
    closed_under_the_put = not closer.is_alive()
    second_returned_early = not second.is_alive()
    release.set()
    putter.join(30)
    closer.join(30)
    second.join(30)
    assert not closed_under_the_put, "close() returned while a put was running"
    assert not second_returned_early, "a second close() returned while a put was running"
    assert result["put"] == 1000 + (256 << 10)
    assert not path.exists()
    with pytest.raises(ValueError, match="closed"):
        log.get(b"k")


def test_close_from_inside_a_put_on_the_same_thread_does_not_hang(tmp_path):
    """A ``close()`` called from inside an operation on the same thread (here the frame iterator of
    a put) cannot wait for that operation: it returns, the put completes, and the log closes when
    the put returns."""
    log = Log(str(tmp_path / "log"))

    def frames():
        yield b"x" * 10
        log.close()
        yield b"y" * 10

    result = {}
    putter = threading.Thread(target=lambda: result.setdefault("put", log.put(b"k", frames())))
    putter.start()
    putter.join(30)
    assert not putter.is_alive(), "close() inside the put waited for the put"
    assert result["put"] == 20
    with pytest.raises(ValueError, match="closed"):
        log.get(b"k")


def test_close_of_another_log_from_inside_a_put_waits_for_that_log(tmp_path):
    """Only operations on the log being closed are exempt from waiting: a ``close()`` of log 2
    called from inside a put on log 1 still waits for the put running on log 2 (on another thread),
    or SpillBuffer would remove log 2's directory under it."""
    log1 = Log(str(tmp_path / "one"))
    log2 = Log(str(tmp_path / "two"))
    started, release = threading.Event(), threading.Event()
    order = []

    def frames2():
        yield b"x" * 10
        started.set()
        release.wait(30)
        order.append("put on log 2 done")
        yield b"y" * 10

    putter = threading.Thread(target=lambda: log2.put(b"k", frames2()))
    putter.start()
    assert started.wait(30)
    # Lets the put on log 2 go on a little later: by then, a close that did not wait has returned.
    threading.Timer(0.5, release.set).start()

    def frames1():
        yield b"a" * 10
        log2.close()
        order.append("log 2 closed")

    log1.put(b"k", frames1())
    putter.join(30)
    assert order == ["put on log 2 done", "log 2 closed"]
    log1.close()


def test_sync_makes_puts_durable_and_fails_after_close(tmp_path):
    log = Log(str(tmp_path / "log"), durable=True)
    log.put(b"k", [b"v" * 100])
    log.sync()
    assert log.read_only is None  # writable (a failed write or fdatasync would give the reason)
    log.close()
    with pytest.raises(ValueError, match="closed"):
        log.sync()
    log = Log(str(tmp_path / "log"), durable=True)
    assert bytes(log.get(b"k")[0]) == b"v" * 100
    log.close()


def test_concurrent_puts_and_deletes_of_one_key_keep_sizes_with_the_log(tmp_path):
    """A put and a delete of the same key on two threads: whatever order they take, the sizes the
    log reports agree with what it holds (a delete between a put's write and its bookkeeping must
    not leave a size for a key the log no longer has)."""
    log = Log(str(tmp_path / "log"), max_disk_bytes=1 << 30)
    for i in range(300):
        barrier = threading.Barrier(2)

        def put(n=i):
            barrier.wait()
            log.put(b"k", [b"p" * (100 + n)])

        def delete():
            barrier.wait()
            log.delete(b"k")

        threads = [threading.Thread(target=put), threading.Thread(target=delete)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        if b"k" in log:
            assert log.stored_bytes(b"k") == 100 + i
            assert log.disk_bytes == 100 + i
        else:
            with pytest.raises(KeyError):
                log.stored_bytes(b"k")
            assert log.disk_bytes == 0
    log.close()


def test_empty_frames_are_stored(tmp_path):
    log = Log(str(tmp_path / "log"))
    assert log.put(b"k", [b"", bytearray(), memoryview(b"")]) == 0
    assert [bytes(f) for f in log.get(b"k")] == [b"", b"", b""]
    log.close()


def test_a_forked_child_can_read_and_close_its_parents_io_uring_log(tmp_path):
    """A process forked while a log runs on io_uring (a task that forks, multiprocessing's fork
    start method) inherits the log but not its driver thread, and maps the parent's ring. Reads and
    writes run inline (pread/pwrite), so they work. Closing the log (as the child's exit does, in
    the buffer's finalizer) must not join the driver thread, which does not exist in the child: the
    join would never return. A child's close leaves the parent's ring and thread alone, anything the
    child's copy would send to the ring fails at once instead (the engine's async reads), the
    parent's log is untouched, and a log the child opens itself works."""
    import select
    import signal

    try:
        log = Log(str(tmp_path / "log"), backend="uring", write_behind_bytes=0)
    except OSError as e:
        if uring_required():
            raise
        pytest.skip(f"io_uring unavailable: {e}")
    value = [b"v" * 100_000]
    log.put(b"k", value)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, and leave without running the parent's cleanup
        try:
            os.close(r)
            report = "read" if bytes(log.get(b"k")[0]) == value[0] else "read other bytes"
            log.close()
            report += " | closed"
            own = Log(str(tmp_path / "child"), backend="uring", write_behind_bytes=0)
            own.put(b"c", value)
            report += " | own log " + ("works" if bytes(own.get(b"c")[0]) == value[0] else "differs")
            own.close()
            os.write(w, report.encode())
        finally:
            os._exit(0)
    os.close(w)
    ready, _, _ = select.select([r], [], [], 60)
    if not ready:
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    report = os.read(r, 4096).decode() if ready else "the child hung"
    os.close(r)
    assert report == "read | closed | own log works", report
    assert bytes(log.get(b"k")[0]) == value[0], "the parent's log still reads"
    log.put(b"k2", value)
    assert bytes(log.get(b"k2")[0]) == value[0]
    log.close()
