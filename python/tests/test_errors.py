"""Failures: max_spill, pickling errors, disk errors. The data stays in memory and the log says why,
in dask's words."""

from __future__ import annotations

import errno
import logging
import multiprocessing
import os
import shutil
import subprocess
import tempfile
import traceback

import pytest

import spillway
from spillway.buffer import DISK_ERROR_MESSAGE, MAX_SPILL_MESSAGE, reset_log_rate_limits

np = pytest.importorskip("numpy")


class Refuses(Exception):
    pass


class Unpicklable:
    def __init__(self, payload: bytes = b""):
        self.payload = payload

    def __reduce__(self):
        raise Refuses("this object refuses to be pickled")

    def __sizeof__(self):
        return object.__sizeof__(self) + len(self.payload)


def messages(caplog, level=None):
    """What spillway's loggers said: the buffer's dask messages (``distributed.spill``) and the
    rest (``distributed.spillway.<module>``; the engine's are emitted by its log thread: flushed
    first)."""
    spillway._core._flush_logs()
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.split(".")[:2] in (["distributed", "spill"], ["distributed", "spillway"])
        and (level is None or r.levelno == level)
    ]


BIG = 3 << 20  # above the log's write-behind budget: each spill is written at once


def big(i):
    return np.full(BIG, i, dtype=np.uint8)


# --------------------------------------------------------------------------------------------------
# max_spill


def test_max_spill_keeps_data_in_memory_with_a_rate_limited_warning(make_buffer, caplog_spillway):
    buf = make_buffer(target=1000, max_spill=7000)
    buf["a"] = bytes(3000)  # heavy: to disk (3000 payload bytes + pickle header)
    buf["b"] = bytes(3000)
    assert set(buf.slow) == {"a", "b"}
    assert messages(caplog_spillway) == []

    buf["c"] = bytes(3000)  # would exceed max_spill
    assert set(buf.fast) == {"c"} and set(buf.slow) == {"a", "b"}
    assert buf.log.disk_bytes <= 7000
    assert messages(caplog_spillway, logging.WARNING) == [MAX_SPILL_MESSAGE]
    assert MAX_SPILL_MESSAGE == "Spill file on disk reached capacity; keeping data in memory"

    buf["d"] = bytes(3000)  # refused again; not logged again within 10 s
    assert set(buf.fast) == {"c", "d"}
    assert buf.evict() == -1
    assert messages(caplog_spillway, logging.WARNING) == [MAX_SPILL_MESSAGE]
    reset_log_rate_limits()
    assert buf.evict() == -1
    assert messages(caplog_spillway, logging.WARNING) == [MAX_SPILL_MESSAGE] * 2

    del buf["a"]  # frees disk space: spilling works again
    assert buf.evict() >= 3000
    assert len(buf.slow) == 2
    assert buf["c"] == bytes(3000) and buf["d"] == bytes(3000)


def test_the_rate_limits_are_distributeds_own_filters(make_buffer, caplog_spillway):
    """The two rate-limited messages go through ``distributed.utils.RateLimiterFilter``, so its
    ``reset_timer`` (which dask's own test suite calls) resets spillway's limits too."""
    utils = pytest.importorskip("distributed.utils")
    buf = make_buffer(target=1000, max_spill=3500)
    patterns = {
        f.pattern.pattern
        for f in logging.getLogger("distributed.spill").filters
        if isinstance(f, utils.RateLimiterFilter)
    }
    assert {p.replace("\\", "") for p in patterns} == {
        "Spill file on disk reached capacity",
        "Spill to disk failed",
    }
    buf["a"] = bytes(3000)  # heavy: to disk
    buf["b"] = bytes(3000)  # refused: max_spill
    assert buf.evict() == -1  # refused again, within 10 s: not logged
    assert messages(caplog_spillway, logging.WARNING) == [MAX_SPILL_MESSAGE]
    utils.RateLimiterFilter.reset_timer("distributed.spill")
    assert buf.evict() == -1
    assert messages(caplog_spillway, logging.WARNING) == [MAX_SPILL_MESSAGE] * 2


def test_max_spill_counts_bytes_already_on_disk(make_buffer):
    buf = make_buffer(target=0, max_spill=10_000)
    for i in range(20):
        buf[i] = bytes(1000)
    assert 8 <= len(buf.slow) <= 9
    assert buf.spilled_total.disk <= 10_000 and buf.log.disk_bytes <= 10_000
    assert len(buf.fast) == 20 - len(buf.slow)
    assert all(buf[i] == bytes(1000) for i in range(20))


def test_max_spill_false_and_none_mean_no_limit(make_buffer):
    for limit in (False, None):
        buf = make_buffer(target=0, max_spill=limit)
        for i in range(10):
            buf[i] = bytes(10_000)
        assert len(buf.slow) == 10


# --------------------------------------------------------------------------------------------------
# Pickling errors


def test_unpicklable_value_being_set_raises_and_is_forgotten(make_buffer, caplog_spillway):
    buf = make_buffer(target=100)
    buf["other"] = 1
    with pytest.raises(TypeError, match=r"^Failed to pickle 'x'$") as info:
        buf["x"] = Unpicklable(b"y" * 1000)  # heavier than target: must go to disk
    assert isinstance(info.value, spillway.PickleError)
    # As dask chains it: dask's TypeError("Could not serialize object of type ..."), then the error.
    assert type(info.value.__cause__) is TypeError
    assert str(info.value.__cause__).startswith("('Could not serialize object of type Unpicklable'")
    assert isinstance(info.value.__cause__.__cause__, Refuses)
    assert "x" not in buf and "x" not in buf.fast and "x" not in buf.slow
    assert buf["other"] == 1
    assert len(buf.log) == 0  # nothing of "x" is left, and "other" never went to disk

    with pytest.raises(TypeError, match=r"^Failed to pickle \('x', 1\)$"):
        buf[("x", 1)] = Unpicklable(b"y" * 1000)


def test_unpicklable_evicted_key_stays_in_memory_and_is_logged_once(make_buffer, caplog_spillway):
    buf = make_buffer(target=1000)
    bad = Unpicklable(b"y" * 600)
    buf["bad"] = bad
    buf["good"] = bytes(600)  # pushes "bad" (LRU) out: fails, stays in memory
    assert set(buf.fast) == {"bad", "good"} and not buf.slow
    assert buf["bad"] is bad

    errors = [r for r in caplog_spillway.records if r.name == "distributed.spill"]
    assert [r.getMessage() for r in errors] == ["Failed to pickle 'bad'"]
    assert errors[0].levelno == logging.ERROR
    assert errors[0].exc_info is not None
    text = caplog_spillway.text
    assert "Refuses: this object refuses to be pickled" in text
    assert "Traceback" in text
    assert "bad" in buf.logged_pickle_errors

    buf["more"] = bytes(600)
    assert buf.evict() == -1  # the LRU head is "bad"
    assert len([r for r in caplog_spillway.records if r.name == "distributed.spill"]) == 1  # once per key

    del buf["bad"]
    assert "bad" not in buf.logged_pickle_errors
    assert buf.evict() > 0  # now something can go


def test_unpicklable_key_failing_during_get_is_logged_not_raised(make_buffer, caplog_spillway):
    buf = make_buffer(target=1000)
    buf["x"] = bytes(600)
    buf.evict()
    buf["bad"] = Unpicklable(b"y" * 600)
    assert buf["x"] == bytes(600)  # promotion pushes "bad" out, which fails
    assert set(buf.fast) == {"x", "bad"}
    assert messages(caplog_spillway) == ["Failed to pickle 'bad'"]


def test_cloudpickle_fallback_for_lambdas(make_buffer):
    pytest.importorskip("cloudpickle")
    buf = make_buffer(target=0)
    buf["f"] = lambda x: x + 1
    assert "f" in buf.slow
    assert buf["f"](1) == 2


# --------------------------------------------------------------------------------------------------
# Disk errors (simulated)


def test_disk_error_keeps_data_in_memory_and_logs(make_buffer, caplog_spillway):
    """A full disk (ENOSPC on every write of the simulated disk: the log stays writable, unlike
    after an EIO) keeps the values in memory, and says so with the error, rate-limited."""
    buf = make_buffer(target=4 << 20, backend="sim")
    buf.log._inject_fault("write", 0, "enospc", sticky=True)
    buf["a"] = big(1)
    buf["b"] = big(2)  # "a" fails to spill
    assert set(buf.fast) == {"a", "b"} and not buf.slow
    assert messages(caplog_spillway, logging.ERROR) == [DISK_ERROR_MESSAGE]
    assert DISK_ERROR_MESSAGE == "Spill to disk failed; keeping data in memory"
    errors = [r for r in caplog_spillway.records if r.getMessage() == DISK_ERROR_MESSAGE]
    assert errors[0].exc_info[1].errno == errno.ENOSPC

    buf["big"] = np.full(5 << 20, 3, dtype=np.uint8)  # heavy, fails too: in memory, no exception
    assert "big" in buf.fast
    assert buf.evict() == -1
    assert len(messages(caplog_spillway, logging.ERROR)) == 1  # rate-limited

    buf.log._clear_faults()
    assert buf.evict() > 0
    assert (buf["big"] == 3).all()


def test_heavy_key_that_cannot_be_spilled_spills_the_others_as_dask(make_buffer):
    buf = make_buffer(target=1000, backend="sim")
    buf["first"] = bytes(300)
    assert buf.evict() > 0  # the log's first segment is written now
    buf["a"] = bytes(300)
    buf["b"] = bytes(300)
    # The small spills are written behind (in the log's tail, not yet on the device); the heavy
    # value is written at once, and the disk refuses it.
    buf.log._inject_fault("write", 0, "enospc", sticky=True)
    buf["big"] = big(1)
    assert set(buf.fast) == {"big"} and set(buf.slow) == {"first", "a", "b"}


def test_evict_never_raises(make_buffer):
    buf = make_buffer(backend="sim")
    buf["a"] = big(1)
    buf.log._inject_fault("write", 0, "enospc", sticky=True)
    assert buf.evict() == -1
    assert "a" in buf.fast
    buf.close()
    assert buf.evict() == -1  # (closed)


# --------------------------------------------------------------------------------------------------
# A failed write on the simulated disk (backend="sim": the log's own I/O fails)

def test_a_failed_write_moves_the_spills_to_a_fresh_log(make_buffer, caplog_spillway):
    """One EIO: the log it hit is read-only for good (it cannot tell what reached the file). The
    spill that met it is written to a fresh log, and so are the later ones; what the first log
    holds stays readable, and deleting it needs no write."""
    buf = make_buffer(target=1000, backend="sim")
    first = buf.log
    buf["a"] = big(1)
    assert "a" in buf.slow
    first._inject_fault("write", 0, "eio")
    buf["b"] = big(2)
    assert set(buf.slow) == {"a", "b"}, "the spill that met the EIO went to the fresh log"
    assert first.read_only is not None and buf.log is not first and buf.log.read_only is None
    assert len(first) == 1 and len(buf.log) == 1
    buf["c"] = big(3)
    assert set(buf.slow) == {"a", "b", "c"} and len(buf.log) == 2
    for k, i in (("a", 1), ("b", 2), ("c", 3)):
        assert (buf[k] == i).all(), k
    del buf["a"]
    assert len(first) == 0
    fresh = [m for m in messages(caplog_spillway, logging.ERROR) if "fresh log" in m]
    assert len(fresh) == 1 and "(1 of 3)" in fresh[0] and "read-only" in fresh[0], fresh
    assert DISK_ERROR_MESSAGE not in messages(caplog_spillway)


def test_a_disk_that_keeps_failing_leaves_the_data_in_memory_after_three_fresh_logs(
    make_buffer, caplog_spillway
):
    """Each log fails its next write once it is the one spills go to (each fresh log is a fresh
    simulated disk: the fault is scripted on each). After three fresh logs the buffer keeps the
    last, read-only one, says so once, and spills fail as disk errors do: the keys stay in memory.
    Every value reads back."""
    buf = make_buffer(target=1000, backend="sim")
    buf["x"] = big(9)
    logs = []
    for i in range(5):
        if buf.log not in logs:
            logs.append(buf.log)
            buf.log._inject_fault("write", 0, "eio", sticky=True)
        buf[i] = big(i)
    assert len(logs) == 4, "the first log and three fresh ones"
    assert all(log.read_only is not None for log in logs)
    assert set(buf.slow) == {"x", 0, 1, 2} and set(buf.fast) == {3, 4}
    assert (buf["x"] == 9).all()
    for i in range(5):
        assert (buf[i] == i).all()
    errors = messages(caplog_spillway, logging.ERROR)
    assert sum("fresh log in" in m for m in errors) == 3, errors
    assert sum("keeping data in memory from now on" in m for m in errors) == 1, errors
    assert DISK_ERROR_MESSAGE in errors
    # The keys in memory stay there: the last log is read-only, and no other is opened.
    for log in logs:
        log._clear_faults()
    buf.evict()
    assert set(buf.fast) == {3, 4} and buf.log is logs[-1]


# --------------------------------------------------------------------------------------------------
# Disk errors (real)

NOBODY = 65534


def _spill_into_readonly_directory(directory: str, conn) -> None:
    """Child process: drop root (which ignores permissions), spill, chmod the log's directories
    read-only, spill more. Sends back what happened."""
    try:
        if os.geteuid() == 0:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
        records = []

        class Keep(logging.Handler):
            def emit(self, record):
                records.append((record.getMessage(), record.exc_info and record.exc_info[1]))

        logging.getLogger("distributed.spill").addHandler(Keep())
        logging.getLogger("distributed.spillway").addHandler(Keep())
        reset_log_rate_limits()
        buf = spillway.SpillBuffer(directory, target=0, segment_bytes=64 * 1024, backend="portable")
        buf["first"] = np.full(40_000, 1, dtype=np.uint8)
        spilled_before = set(buf.slow)
        for root, dirs, _ in os.walk(buf.directory):
            for d in [root, *(os.path.join(root, d) for d in dirs)]:
                os.chmod(d, 0o500)
        kept = None
        for i in range(8):  # the log needs a new segment file within a few records
            buf[i] = np.full(40_000, i, dtype=np.uint8)
            if i in buf.fast:
                kept = i
                break
        value_ok = kept is not None and bool((buf[kept] == kept).all())
        errors = [(msg, type(exc).__name__, getattr(exc, "errno", None)) for msg, exc in records]
        conn.send(
            dict(
                spilled_before=spilled_before,
                kept=kept,
                value_ok=value_ok,
                errors=errors,
                first_ok=bool((buf["first"] == 1).all()),
            )
        )
    except BaseException:
        conn.send(dict(crash=traceback.format_exc()))
    finally:
        conn.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_readonly_directory_keeps_data_in_memory(tmp_path):
    """A chmod'ed spill directory (root ignores chmod: the child drops to nobody)."""
    directory = tempfile.mkdtemp(prefix="spillway-chmod-")
    try:
        if os.geteuid() == 0:
            os.chown(directory, NOBODY, NOBODY)
        ctx = multiprocessing.get_context("fork")
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_spill_into_readonly_directory, args=(directory, child))
        proc.start()
        child.close()
        answered = parent.poll(120)
        if not answered:
            proc.kill()
        assert answered, "the child process did not answer within 120 s"
        result = parent.recv()
        proc.join(30)
    finally:
        for root, dirs, _ in os.walk(directory):
            for d in dirs:
                os.chmod(os.path.join(root, d), 0o700)
        shutil.rmtree(directory, ignore_errors=True)
    assert "crash" not in result, result.get("crash")
    assert result["spilled_before"] == {"first"}
    assert result["kept"] is not None, "no spill failed in a read-only directory"
    assert result["value_ok"] and result["first_ok"]
    assert result["errors"], "nothing logged"
    msg, exc_type, err = result["errors"][0]
    assert msg == DISK_ERROR_MESSAGE
    assert err in (errno.EACCES, errno.EPERM, errno.EROFS), result["errors"]


@pytest.fixture
def tiny_tmpfs():
    """A 512 KiB tmpfs (needs mount rights; skipped otherwise)."""
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    directory = tempfile.mkdtemp(prefix="spillway-tmpfs-")
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", directory],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        os.rmdir(directory)
        pytest.skip(f"cannot mount a tmpfs: {proc.stderr.strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", directory], check=False)
        os.rmdir(directory)


def test_full_disk_keeps_data_in_memory(tiny_tmpfs, caplog_spillway):
    buf = spillway.SpillBuffer(tiny_tmpfs, target=0, segment_bytes=64 * 1024, backend="portable")
    try:
        for i in range(40):
            buf[i] = np.full(40_000, i, dtype=np.uint8)
        assert buf.slow, "nothing was spilled"
        assert buf.fast, "the 1.6 MB never filled the 512 KiB tmpfs"
        for i in range(40):
            assert (buf[i] == i).all()
        errors = [r for r in caplog_spillway.records if r.name == "distributed.spill"]
        assert errors and errors[0].getMessage() == DISK_ERROR_MESSAGE
        assert errors[0].exc_info[1].errno == errno.ENOSPC
        # A full disk is not a broken one: deleting spilled keys frees space, and spilling resumes.
        caplog_spillway.clear()
        for key in list(buf.slow):
            del buf[key]
        assert not [r for r in caplog_spillway.records if r.levelno >= logging.WARNING]
        for i in range(40, 44):
            buf[i] = np.full(40_000, i, dtype=np.uint8)
        assert buf.slow, "nothing spilled after space was freed"
        for key in list(buf.fast) + list(buf.slow):
            assert (buf[key] == key).all()
    finally:
        buf.close()


def test_a_value_the_log_refuses_is_a_disk_error_not_an_exception(make_buffer, caplog_spillway):
    # More out-of-band buffers than one record holds (65535 frames): the log refuses the value with
    # a ValueError. As any other failure to write, that keeps the key in memory and is logged; it
    # must not escape from the set of this key, nor from later sets whose eviction retries it.
    buf = make_buffer(target=1000)
    many = [np.zeros(1, dtype="u1") for _ in range(70_000)]
    buf["many"] = many  # heavier than the target: spilled at once, which fails
    assert "many" in buf.fast
    buf["x"] = bytes(600)
    buf["y"] = bytes(600)
    assert messages(caplog_spillway, logging.ERROR) == [DISK_ERROR_MESSAGE]
    assert "frames" in caplog_spillway.text
    assert len(buf["many"]) == 70_000
    assert buf["x"] == bytes(600)


def test_keys_can_be_deleted_after_close(make_buffer):
    """After ``close()`` (the log and its directory are gone), deleting a spilled key or clearing
    the buffer forgets the keys without raising: ``del`` raises no ValueError ("closed") once the
    key is gone, and ``clear()`` does not stop at the first spilled key."""
    buf = make_buffer(target=1 << 20)
    for k in "abc":
        buf[k] = bytes(1000)
    assert buf.evict() > 0 and buf.evict() > 0
    assert buf.tier("a") == "disk" and buf.tier("b") == "disk"
    buf.close()
    del buf["a"]
    assert "a" not in buf
    buf.clear()
    assert len(buf) == 0
    assert buf.spilled_total == (0, 0)


def test_a_damaged_record_names_its_key_and_what_else_reads_so(make_buffer):
    """A record that fails its checksum (damage on disk, or an object changed in place while it was
    being spilled: the same bytes-against-crc mismatch) raises Corrupt with the key, for every
    reader, and the other keys read on."""
    buf = make_buffer(target=1000, backend="portable")
    buf["a"] = b"\xab" * (3 << 20)  # bytes: no weak reference, so a read goes to the record
    buf["b"] = b"\xcd" * (3 << 20)
    assert set(buf.slow) == {"a", "b"}
    buf.log.sync()
    (segment,) = [
        os.path.join(root, f) for root, _, files in os.walk(buf.directory) for f in files if f.endswith(".seg")
    ]
    with open(segment, "r+b") as f:
        data = f.read()
        at = data.index(b"\xab" * 4096) + 100_000
        f.seek(at)
        f.write(b"\x00")
    for _ in range(2):
        with pytest.raises(spillway.Corrupt) as info:
            buf["a"]
        assert "'a'" in str(info.value) and "changed in place" in str(info.value), info.value
    assert buf["b"] == b"\xcd" * (3 << 20)
