"""A randomized race of one ``SpillBuffer`` against a plain dict: several threads set, read,
delete, evict and receive values (the plugin's receive path, into memory and straight to disk, from
a real ``TransferServer``: transfers that succeed, fail, and records never set) on a few shared
keys, and after every step the key touched reads back its last value (or is absent); at the end the
buffer holds exactly the model's keys, the engine's accounting adds up and no store key is left
reserved.

Each step on a key holds that key's lock in the model, so the model knows the key's value; what
runs outside any key's lock is what a dask worker runs outside it too: evictions, the memory
monitor's pressure, and the clean-up of received records nobody set (their finalizers, run by a
janitor thread at random moments, as the garbage collector runs them on whichever thread).

    python python/bench/races.py --seconds 600      # the soak (docs/benchmarks.md)

``python/tests/test_races.py`` runs it briefly.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
import threading
import time
from collections import Counter

import spillway
from spillway import codec
from spillway._core import TransferServer

KiB = 1 << 10

OPS = ("set", "set_serialized", "get", "delete", "evict", "receive", "receive_failed", "receive_orphaned")


class Race:
    """The buffer under test, its source of received values, and the model."""

    def __init__(self, directory: str, keys: int, seed: int):
        self.buf = spillway.SpillBuffer(os.path.join(directory, "buf"), 256 * KiB, backend="portable")
        self.src = spillway.SpillBuffer(os.path.join(directory, "src"), 1 << 30, backend="portable")
        self.server = TransferServer("127.0.0.1", 0, lifetime=60.0)
        self.keys = [f"k{i}" for i in range(keys)] + [("t", i) for i in range(keys // 2)]
        self.locks = {k: threading.Lock() for k in self.keys}
        self.model: dict = {}
        self.counts: Counter = Counter()
        self.graveyard: list = []
        self.graveyard_lock = threading.Lock()
        self.serial = 0
        self.serial_lock = threading.Lock()
        self.seed = seed

    def close(self) -> None:
        self.server.close()
        self.buf.close()
        self.src.close()

    def value(self, rng: random.Random, key) -> bytes:
        """A fresh value for ``key``: 1-64 KiB, or now and then heavier than the target."""
        with self.serial_lock:
            self.serial += 1
            n = self.serial
        size = rng.choice((KiB, 16 * KiB, 64 * KiB, 300 * KiB))
        head = repr((key, n)).encode()
        return (head * (size // len(head) + 1))[:size]

    def grant(self, value: bytes) -> tuple:
        """``value`` granted by the source's transfer server: (ticket, its store key, its bytes)."""
        with self.serial_lock:
            self.serial += 1
            name = f"src-{self.serial}"
        self.src[name] = value
        skey = self.src._keys[name]
        nbytes = codec.frame_bytes(self.src.get_serialized(name))
        ticket = self.server.grant(self.src._store, skey, "127.0.0.1")
        del self.src[name]  # the grant pins what it sends
        return ticket, skey, nbytes

    def step(self, rng: random.Random) -> None:
        op = rng.choice(OPS)
        self.counts[op] += 1
        if op == "evict":
            try:
                self.buf.evict()
            except KeyError:
                pass  # nothing in memory
            return
        key = rng.choice(self.keys)
        with self.locks[key]:
            self._on_key(op, key, rng)
            self._check(key)

    def _on_key(self, op: str, key, rng: random.Random) -> None:
        buf, model = self.buf, self.model
        if op == "set":
            v = self.value(rng, key)
            buf[key] = v
            model[key] = v
        elif op == "set_serialized":
            v = self.value(rng, key)
            buf.set_serialized(key, codec.dumps(v))
            model[key] = v
        elif op == "get":
            pass  # (the check reads it)
        elif op == "delete":
            try:
                del buf[key]
            except KeyError:
                assert key not in model, f"{key!r} could not be deleted"
            else:
                assert model.pop(key, None) is not None, f"{key!r} deleted but absent"
        elif op in ("receive", "receive_orphaned"):
            v = self.value(rng, key)
            ticket, skey, nbytes = self.grant(v)
            got = buf.receive(key, self.server.address, ticket, skey, nbytes, timeout=30.0)
            if op == "receive":
                buf[key] = got
                model[key] = v
            else:
                with self.graveyard_lock:
                    self.graveyard.append(got)
        elif op == "receive_failed":
            v = self.value(rng, key)
            _, skey, nbytes = self.grant(v)
            try:
                buf.receive(key, self.server.address, os.urandom(24), skey, nbytes, timeout=30.0)
            except Exception:
                pass
            else:
                raise AssertionError("a forged ticket was served")

    def _check(self, key) -> None:
        """Under the key's lock: it reads back its last value, or is absent."""
        expected = self.model.get(key)
        if expected is None:
            assert key not in self.buf, f"{key!r} is in the buffer, not in the model"
            return
        assert key in self.buf, f"{key!r} was lost"
        try:
            got = self.buf[key]
        except KeyError:
            raise AssertionError(f"{key!r} is listed but does not read back") from None
        assert got == expected, f"{key!r} reads back another value"

    def janitor(self, rng: random.Random, stop: threading.Event) -> None:
        """Let go of unset received records at random moments (their finalizers delete them)."""
        while not stop.is_set():
            with self.graveyard_lock:
                dead, self.graveyard[:] = list(self.graveyard), []
            rng.shuffle(dead)
            while dead:
                dead.pop()
                if rng.random() < 0.3:
                    time.sleep(0)  # let a worker thread in between two finalizers
            time.sleep(rng.random() * 0.002)

    def check_all(self) -> None:
        """Quiescent: exactly the model's keys, each its value; the accounting adds up; no store key
        reserved or retiring."""
        with self.graveyard_lock:
            self.graveyard.clear()
        gc.collect()
        assert set(self.buf) == set(self.model), (set(self.buf) ^ set(self.model))
        for key, v in self.model.items():
            assert self.buf[key] == v, f"{key!r} reads back another value"
        self.buf._store.check_accounting()
        assert self.buf._keys.reserved == frozenset(), "received records left reserved"
        in_memory, on_disk = self.buf._store.keys_by_place()
        assert {self.buf._keys[k] for k in self.buf} == set(in_memory) | set(on_disk)


def run(*, ops: int | None = None, seconds: float | None = None, threads: int = 4, keys: int = 8,
        seed: int = 0) -> dict:
    """Race ``threads`` threads for ``ops`` steps in all (or ``seconds``); returns the counts. An
    AssertionError (with the seed) if the buffer and the model ever disagree."""
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # many more thread switches, so many more interleavings
    with tempfile.TemporaryDirectory() as d:
        race = Race(d, keys, seed)
        stop = threading.Event()
        errors: list = []
        done = [0]
        deadline = None if seconds is None else time.monotonic() + seconds
        per_thread = None if ops is None else max(1, ops // threads)

        def work(i: int) -> None:
            rng = random.Random(f"{seed}-{i}")
            n = 0
            try:
                while not stop.is_set():
                    if per_thread is not None and n >= per_thread:
                        break
                    if deadline is not None and time.monotonic() >= deadline:
                        break
                    race.step(rng)
                    n += 1
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
                stop.set()
            finally:
                done[0] += n

        janitor = threading.Thread(target=race.janitor, args=(random.Random(seed), stop))
        janitor.start()
        workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
        start = time.monotonic()
        try:
            for t in workers:
                t.start()
            for t in workers:
                t.join()
        finally:
            stop.set()
            janitor.join()
            sys.setswitchinterval(switch)
        try:
            if errors:
                raise AssertionError(f"seed {seed}: {errors[0]}") from errors[0]
            race.check_all()
        finally:
            race.close()
        return {"seed": seed, "ops": done[0], "seconds": round(time.monotonic() - start, 1),
                "lost": 0, "by_op": dict(race.counts)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=60.0, help="how long to race (default 60)")
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--keys", type=int, default=8)
    p.add_argument("--seed", type=int, default=None, help="default: a new one each round")
    p.add_argument("--round-seconds", type=float, default=20.0, help="a full check every this often")
    args = p.parse_args()
    total: Counter = Counter()
    rounds = 0
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        seed = args.seed if args.seed is not None else random.randrange(1 << 30)
        r = run(seconds=min(args.round_seconds, end - time.monotonic()), threads=args.threads,
                keys=args.keys, seed=seed)
        rounds += 1
        total["ops"] += r["ops"]
        total.update({f"op {k}": v for k, v in r["by_op"].items()})
    print(json.dumps({"rounds": rounds, "ops": total["ops"], "lost": 0, "seconds": args.seconds,
                      "by_op": {k[3:]: v for k, v in total.items() if k.startswith("op ")}}))


if __name__ == "__main__":
    main()
