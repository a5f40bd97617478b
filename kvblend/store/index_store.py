"""Each namespace's neighbour index, kept where the chunk store keeps its entries, as text.

Places, read in this order: Redis (a key per namespace, so replicas share one index; one server
or a cluster), the disk tier's directory (a file per namespace), this process's memory (all there
is when neither is configured; the last resort while Redis is down).
An update is a read-modify-write made atomic in the first place that answers (a Redis
transaction watching the key; a lock file beside the file) and copied to the others, so two
processes adding to one namespace never lose each other's chunks. A version per namespace (a
counter in Redis, the file's identity on disk) tells a process that another one changed it.
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import namespace_file
from .tier import TierDown

if TYPE_CHECKING:  # redis is the [redis] extra: imported where a Redis tier is configured, not here
    import redis

    from .redis_tier import RedisTier

log = logging.getLogger(__name__)


class Unreachable(Exception):
    """The place cannot be asked now (Redis down): the next place answers instead."""


def write_atomic(path: Path, text: str) -> None:
    """A reader sees the old text or the new, never half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class MemoryPlace:
    def __init__(self):
        self._texts: dict[str, tuple[str, int]] = {}

    def read(self, ns: str) -> str | None:
        return self._texts.get(ns, (None, 0))[0]

    def version(self, ns: str):
        return self._texts.get(ns, (None, 0))[1]

    def update(self, ns: str, fn: Callable[[str | None], str | None]) -> str | None:
        text = fn(self.read(ns))
        if text is not None:
            self.write(ns, text)
        return text

    def write(self, ns: str, text: str) -> None:
        self._texts[ns] = (text, self.version(ns) + 1)


class FilePlace:
    def __init__(self, path_of: Callable[[str], Path | None]):
        self._path_of = path_of

    def path_of(self, ns: str) -> Path:
        path = self._path_of(ns)
        if path is None:  # this namespace has no file here (no local_disk): another place keeps it
            raise Unreachable
        return path

    def read(self, ns: str) -> str | None:
        try:
            return self.path_of(ns).read_text()
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:  # unreadable bytes are a corrupt index: the caller says so
            return f"unreadable: {type(e).__name__}: {e}"

    def version(self, ns: str):
        path = self.path_of(ns)
        try:
            st = path.stat()
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    def update(self, ns: str, fn: Callable[[str | None], str | None]) -> str | None:
        path = self.path_of(ns)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(f".{path.name}.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # other processes on this directory wait their turn
            text = fn(self.read(ns))
            if text is not None:
                write_atomic(path, text)
        return text

    def write(self, ns: str, text: str) -> None:
        write_atomic(self.path_of(ns), text)


class RedisPlace:
    def __init__(self, tier: RedisTier):
        self.tier = tier

    def _key(self, ns: str) -> str:
        # A hash tag around all but the prefix: the text and its version share a cluster slot (the
        # version key extends this one, so it has the same tag whatever braces `ns` holds), and an
        # update's transaction over both is allowed there.
        return f"{self.tier.prefix}{{neighbours:{ns}}}"

    def _version_key(self, ns: str) -> str:
        return self._key(ns) + ":version"

    def _call(self, ns: str, fn):
        try:
            return self.tier.call(fn, self._key(ns).removeprefix(self.tier.prefix))
        except TierDown:
            raise Unreachable from None

    def read(self, ns: str) -> str | None:
        raw = self._call(ns, lambda c: c.get(self._key(ns)))
        return raw.decode("utf-8", errors="replace") if raw is not None else None

    def version(self, ns: str):
        return self._call(ns, lambda c: c.get(self._version_key(ns)))

    def update(self, ns: str, fn: Callable[[str | None], str | None]) -> str | None:
        key = self._key(ns)

        def change(pipe: redis.client.Pipeline) -> str | None:
            raw = pipe.get(key)  # watched: another writer in between makes this run again
            text = fn(raw.decode("utf-8", errors="replace") if raw is not None else None)
            pipe.multi()
            if text is not None:
                pipe.set(key, text)
                pipe.incr(self._version_key(ns))
            return text

        return self._call(ns, lambda c: c.transaction(change, key, value_from_callable=True))

    def write(self, ns: str, text: str) -> None:
        def put(c):
            p = c.pipeline(transaction=True)
            p.set(self._key(ns), text)
            p.incr(self._version_key(ns))
            p.execute()
        self._call(ns, put)


class IndexStore:
    def __init__(self, places: list):
        self.places = places

    def read(self, ns: str) -> str | None:
        """The text of the first place that holds one (a place that cannot be asked is skipped)."""
        for place in self.places:
            try:
                text = place.read(ns)
            except Unreachable:
                continue
            if text is not None:
                return text
        return None

    def version(self, ns: str) -> tuple:
        """Changes whenever any place's text changes (or a place goes down or comes back)."""
        out = []
        for place in self.places:
            try:
                out.append(place.version(ns))
            except Unreachable:
                out.append("unreachable")
        return tuple(out)

    def update(self, ns: str, fn: Callable[[str | None], str | None]) -> str | None:
        """fn(current text or None) -> new text (None: unchanged, nothing written), atomic in the
        first place that answers, then copied to the others. A place empty where another holds
        the index (Redis restarted without persistence) starts from that other one's text, so
        nothing indexed is lost."""
        for i, place in enumerate(self.places):
            rest = self.places[i + 1:]
            try:
                text = place.update(ns, lambda current: fn(current if current is not None else self._read(rest, ns)))
            except Unreachable:
                continue
            except OSError as e:  # a full or read-only disk: the next place keeps it
                log.warning("neighbour index of %r: cannot write it in %s (%s)", ns, type(place).__name__, e)
                continue
            for other in rest if text is not None else ():
                if isinstance(other, MemoryPlace):  # a copy there would only grow with namespaces
                    continue
                try:
                    other.write(ns, text)
                except (Unreachable, OSError) as e:
                    log.warning("neighbour index of %r: not copied to %s (%s)", ns, type(other).__name__, e)
            return text
        raise OSError(f"no place to keep the neighbour index of {ns!r} answers")

    @staticmethod
    def _read(places, ns: str) -> str | None:
        return IndexStore(places).read(ns)


def build_index_store(redis_tier: RedisTier | None, folder: str | None, own: tuple[str, Path] | None) -> IndexStore:
    """Redis first when configured, then files in `folder` (the disk tier's); `own` names a
    namespace whose file the settings place elsewhere (neighbour_index). This process's memory
    last: all there is without Redis or a folder, and what keeps indexing while Redis is down
    (the next update once it is back starts from it)."""
    places: list = []
    if redis_tier is not None:
        places.append(RedisPlace(redis_tier))
    if folder is not None or own is not None:
        def path_of(ns: str) -> Path | None:
            if own is not None and ns == own[0]:
                return own[1]
            return namespace_file(Path(folder), ns) if folder is not None else None
        places.append(FilePlace(path_of))
    places.append(MemoryPlace())  # the last resort, and all there is without Redis or a folder
    return IndexStore(places)
