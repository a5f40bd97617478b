"""One neighbour index per namespace: a tenant's chunks are precomputed after the most similar
chunk of that tenant's own collection, never another's.

Indexes are kept where the store keeps its entries (store.index_store) and cached here; a cached
index is read again when its version changes (another replica or process added to it). A
corrupt index is logged and read as none (its chunks are served plain, nothing is lost); the
next addition to that namespace rebuilds it from the chunks added then.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from ..store.index_store import IndexStore
from .neighbours import NeighbourIndex

log = logging.getLogger(__name__)
CACHED = 256  # namespaces whose index is kept parsed in memory (least recently used dropped)


class NamespaceIndexes:
    def __init__(self, store: IndexStore, count: int = 1):
        self.store = store
        self.count = count  # chunks a new chunk is precomputed after (NeighbourIndex.add)
        self._cache: OrderedDict[str, tuple[object, NeighbourIndex | None]] = OrderedDict()
        self._lock = threading.Lock()  # the engine thread adds, a background writer may too

    def get(self, ns: str) -> NeighbourIndex | None:
        """The namespace's index as stored now; None when it has none (or an unreadable one)."""
        version = self.store.version(ns)
        with self._lock:
            cached = self._cache.get(ns)
            if cached is not None and cached[0] == version:
                self._cache.move_to_end(ns)
                return cached[1]
        index = self._parse(ns, self.store.read(ns), rebuilding=False)
        self._remember(ns, version, index)
        return index

    def add(self, ns: str, chunks: Iterable[Sequence[int]]) -> tuple[int, NeighbourIndex]:
        """Index these chunks in the namespace's collection (old chunks keep their neighbours; a
        much closer new one becomes pending); returns how many were new and the index now."""
        chunks = [list(c) for c in chunks]
        result: dict = {}

        def grow(text: str | None) -> str | None:
            index = self._parse(ns, text, rebuilding=True)
            rebuilt = index is None
            index = index or NeighbourIndex()
            result["new"], result["index"] = index.add(chunks, self.count), index
            return index.to_json() if result["new"] or rebuilt else None  # None: unchanged, not written

        with self._lock:
            self.store.update(ns, grow)
        self._remember(ns, self.store.version(ns), result["index"])
        return result["new"], result["index"]

    def promote(self, ns: str, pairs: list[tuple[list[int], list[int]]]) -> int:
        """Switch each (chunk, pending neighbour) whose KV after it is stored to that neighbour, in
        one atomic update; returns how many switched (not one that another process switched first)."""
        result = {"promoted": 0}

        def switch(text: str | None) -> str | None:
            index = self._parse(ns, text, rebuilding=False)
            if index is None:
                return None
            result["promoted"] = sum(index.promote(chunk, candidate) for chunk, candidate in pairs)
            result["index"] = index
            return index.to_json() if result["promoted"] else None  # None: unchanged, not written

        if not pairs:
            return 0
        with self._lock:
            self.store.update(ns, switch)
        if "index" in result:
            self._remember(ns, self.store.version(ns), result["index"])
        return result["promoted"]

    def _remember(self, ns: str, version, index: NeighbourIndex | None) -> None:
        with self._lock:
            self._cache[ns] = (version, index)
            self._cache.move_to_end(ns)
            while len(self._cache) > CACHED:
                self._cache.popitem(last=False)

    @staticmethod
    def _parse(ns: str, text: str | None, rebuilding: bool) -> NeighbourIndex | None:
        if text is None:
            return None
        try:
            return NeighbourIndex.from_json(text, f"of namespace {ns!r}")
        except ValueError as e:
            log.warning("%s; %s", e, "rebuilding it from the chunks added now" if rebuilding
                        else "its chunks are served without neighbours until it is rebuilt")
            return None
