"""Read-only views of a :class:`~spillway.SpillBuffer`: its keys in memory and on disk (``fast``,
``slow``), items and values that peek without moving keys, and the segment log (``log``) that tests
inspect and script faults on."""

from __future__ import annotations

import weakref
from collections.abc import Hashable, ItemsView, Iterator, Mapping, ValuesView
from typing import TYPE_CHECKING, Any

from spillway._core import Store

if TYPE_CHECKING:
    from spillway.buffer import SpillBuffer


class LogView:
    """What the tests see of one of the store's segment logs (number ``index`` of ``Store.logs``)."""

    __slots__ = ("index", "store")

    def __init__(self, store: Store, index: int):
        self.store = store
        self.index = index

    def __len__(self) -> int:
        """Records in the log: values on disk and the copies that values read back keep."""
        return self.store.logs[self.index][2]

    @property
    def disk_bytes(self) -> int:
        """Pickled bytes of the records of every log of the store."""
        return self.store.log_records[1]

    @property
    def read_only(self) -> str | None:
        return self.store.logs[self.index][1]

    @property
    def backend(self) -> str:
        return self.store.backend

    def _inject_fault(self, op: str, after: int, kind: str, sticky: bool = False) -> None:
        """Script a fault of this log's simulated disk (backend="sim")."""
        self.store._inject_fault(op, after, kind, sticky, log=self.index)

    def _clear_faults(self) -> None:
        self.store._clear_faults(log=self.index)

    def sync(self) -> None:
        """Write back what the log spills go to holds, and fdatasync it."""
        self.store.sync()


class TierView(Mapping):
    """Read-only view of the keys of a SpillBuffer in memory (``in_memory=True``) or on disk."""

    def __init__(self, buffer: SpillBuffer, in_memory: bool):
        # A proxy: the buffer holds its views, and a cycle would keep a buffer nobody holds (and
        # its open files) alive until the garbage collector runs.
        self._buffer = weakref.proxy(buffer)
        self._in_memory = in_memory

    def __contains__(self, key: object) -> bool:
        tier = self._buffer.tier_if_present(key)
        return tier is not None and (tier != "disk") == self._in_memory

    def __getitem__(self, key: Hashable) -> object:
        if key not in self:
            raise KeyError(key)
        return self._buffer.peek(key)

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._buffer.keys_by_place()[0 if self._in_memory else 1])

    def __len__(self) -> int:
        return self._buffer.place_counts()[0 if self._in_memory else 1]

    @property
    def total_weight(self) -> int:
        """Sum of the weights of the keys in this view (sizeof for objects, bytes for frames)."""
        b = self._buffer
        return b.memory_weight if self._in_memory else b.spilled_total.memory

    def __repr__(self) -> str:
        return f"<{'fast' if self._in_memory else 'slow'} view of {len(self)} keys>"


class PeekItemsView(ItemsView):
    def __iter__(self) -> Iterator[tuple[Hashable, Any]]:
        for key in self._mapping:
            try:
                yield key, self._mapping.peek(key)
            except KeyError:  # deleted meanwhile
                pass


class PeekValuesView(ValuesView):
    def __iter__(self) -> Iterator[Any]:
        for _, value in PeekItemsView(self._mapping):
            yield value
