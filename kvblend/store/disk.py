"""Local disk tier: one safetensors file per entry, tensors k.<layer> and v.<layer> (int8 entries
add k_scale.<layer>, v_scale.<layer>; the probe's compact copy pk, pv and their scales), the
entry header (entry_format) in the safetensors metadata. Written to a temporary file and renamed, so a
reader sees a whole entry or none; read lazily, one layer at a time, through safe_open.

Several processes may share a directory: a get looks at the file system, not only at this
process's index, and the index (LRU by bytes, recency kept in file mtimes) is this process's
view for eviction."""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import OrderedDict
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save as safetensors_bytes

from .chunk_kv import ChunkKV
from .entry_format import EntryMeta, EntrySpec, check_meta, describe
from .int8 import QuantKV
from .probe_copy import entry_parts as compact_copy
from .tier import Counters, StoredEntry

log = logging.getLogger(__name__)
SUFFIX = ".safetensors"
META_KEY = "kvblend"
# What a plan asks the kernel to read ahead of each entry: its header (about 20 kB for a
# 700-token chunk); the loader asks for each layer's tensors a few layers before it reads them.
HEADER_READAHEAD = 64 << 10


def will_need(path: Path, ranges: list[tuple[int, int]]) -> None:
    """Ask the kernel to start reading these byte ranges of a file into the page cache, without
    waiting for them. A hint only: a missing file or a refused call changes nothing."""
    if not hasattr(os, "posix_fadvise"):
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        for start, end in ranges:
            os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_WILLNEED)
    except OSError:
        pass
    finally:
        os.close(fd)


def tensor_ranges(path: Path) -> dict[str, tuple[int, int]]:
    """Where each tensor of a safetensors file lies in it: name -> (start, end) bytes."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n > os.fstat(f.fileno()).st_size:
            raise ValueError(f"{path}: a header of {n} bytes is longer than the file")
        header = json.loads(f.read(n))
    return {name: (8 + n + t["data_offsets"][0], 8 + n + t["data_offsets"][1])
            for name, t in header.items() if name != "__metadata__"}


class DiskEntry(StoredEntry):
    def __init__(self, meta: EntryMeta, handle, path: Path, meter=None):
        super().__init__(meta, "disk", meter)
        self._f = handle  # safe_open keeps the file mapped: a later rename or unlink can't tear it
        self._path = path
        self._ranges: dict[str, tuple[int, int]] | None = None  # read on the first prefetch

    def prefetch(self, layer: int, compact: bool = False) -> None:
        """A read of this layer (its compact copy's, with `compact`) is coming: have the kernel
        start fetching its bytes now, so that the read finds them in memory."""
        names = self.meta.probe_specs() if compact else self.meta.part_specs()
        try:
            if self._ranges is None:
                self._ranges = tensor_ranges(self._path)
            ranges = [self._ranges[f"{name}.{layer}"] for name in names]
        except (OSError, ValueError, KeyError):  # a hint: the read itself finds what is wrong
            return
        will_need(self._path, ranges)

    def _read_layer(self, layer: int):
        return {name: self._f.get_tensor(f"{name}.{layer}") for name in self.meta.part_specs()}

    def _read_probe_layer(self, layer: int):
        return {name: self._f.get_tensor(f"{name}.{layer}") for name in self.meta.probe_specs()}


class DiskTier(Counters):
    name = "disk"

    def __init__(self, root: str | Path, capacity_bytes: int, spec: EntrySpec | None = None):
        super().__init__()
        if capacity_bytes < 0:
            raise ValueError(f"disk tier capacity must be >= 0 bytes, got {capacity_bytes}")
        self.root = Path(root).expanduser()
        if self.root.exists() and not self.root.is_dir():
            raise ValueError(f"local_disk {self.root} exists and is not a directory")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"local_disk {self.root} cannot be created: {e}") from e
        self.capacity_bytes, self.spec = capacity_bytes, spec
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> bytes, least recent first
        files = []
        for p in self.root.iterdir():
            if p.name.startswith(".") and p.name.endswith(".tmp"):
                p.unlink(missing_ok=True)  # a write that died before its rename
            elif p.suffix == ".safetensors":
                st = p.stat()
                files.append((st.st_mtime, p.name.removesuffix(SUFFIX), st.st_size))
        for _, key, size in sorted(files):
            self._index[key] = size

    @property
    def used_bytes(self) -> int:
        return sum(self._index.values())

    def path(self, key: str) -> Path:
        return self.root / (key + SUFFIX)

    # ---- reading -----------------------------------------------------------------------------

    def _open(self, key: str) -> tuple[EntryMeta, object] | None:
        """The checked header and open file of an entry; None on a miss. A bad entry is deleted,
        counted and logged, and is a miss."""
        path = self.path(key)
        try:
            f = safe_open(str(path), framework="pt")
            meta = EntryMeta.from_json((f.metadata() or {})[META_KEY])
            why = check_meta(meta, key, self.spec)
        except FileNotFoundError:
            with self._lock:
                self._index.pop(key, None)
            return None
        except Exception as e:  # truncated, garbage, no header, unknown version
            why = f"unreadable header ({type(e).__name__}: {e})"
        if why:
            self.discard(key, why)
            return None
        return meta, f

    def get(self, key: str) -> DiskEntry | None:
        opened = self._open(key)
        if opened is None:
            self.misses += 1
            return None
        self.hits += 1
        with self._lock:
            self._index[key] = self._index.get(key) or _size(self.path(key))
            self._index.move_to_end(key)
        try:
            os.utime(self.path(key))  # recency survives a restart
        except OSError:
            pass
        return DiskEntry(*opened, self.path(key), self.meter)

    def prefetch(self, keys: list[str]) -> None:
        """The entries' headers are about to be read: have the kernel fetch them all at once, so
        that a plan's lookups on a cold disk wait for one read rather than one after another.
        A hint only: a missing entry or a failing call changes nothing."""
        for key in keys:
            will_need(self.path(key), [(0, HEADER_READAHEAD)])

    def header(self, key: str) -> EntryMeta | None:
        opened = self._open(key)
        return opened[0] if opened else None

    def __contains__(self, key: str) -> bool:
        return self.path(key).exists()

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._index)

    def __len__(self) -> int:
        return len(self._index)

    # ---- writing -----------------------------------------------------------------------------

    def put(self, key: str, kv: ChunkKV | QuantKV) -> bool:
        """Write an entry; False (counted, logged) when it can't be: too large, disk full,
        read-only. Never raises for I/O: the request that computed the KV has its answer."""
        if kv.nbytes > self.capacity_bytes:
            return False
        if self.spec is None:
            raise ValueError("a disk tier without a model spec is read-only")
        path = self.path(key)
        if path.exists():  # keys name their content: already stored, by us or another process
            with self._lock:
                self._index[key] = self._index.get(key) or _size(path)
                self._index.move_to_end(key)
            return True
        probe = compact_copy(kv) if kv.probe_copy else None
        meta = describe(key, kv, self.spec.fingerprint, probe)
        # safetensors refuses views of one tensor: each layer gets its own copy.
        tensors = {f"{name}.{layer}": t.clone() for layer in range(kv.n_layers)
                   for name, t in (kv.parts(layer) | (probe[layer] if probe else {})).items()}
        data = safetensors_bytes(tensors, metadata={META_KEY: meta.to_json()})
        tmp = self.root / f".{key}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)  # atomic: readers see the old file, the new one, or none
        except OSError as e:
            tmp.unlink(missing_ok=True)
            self.write_errors += 1
            log.warning("disk tier: cannot write %s (%s); going on without it", path.name, e)
            return False
        with self._lock:
            self._index[key] = len(data)
            self._index.move_to_end(key)
            self.puts += 1
            victims = []
            while sum(self._index.values()) > self.capacity_bytes and len(self._index) > 1:
                victim, _ = self._index.popitem(last=False)
                victims.append(victim)
                self.evictions += 1
        for victim in victims:
            self.path(victim).unlink(missing_ok=True)
        return True

    def delete(self, key: str) -> bool:
        with self._lock:
            self._index.pop(key, None)
        try:
            self.path(key).unlink()
            return True
        except FileNotFoundError:
            return False
        except OSError as e:
            log.warning("disk tier: cannot delete %s (%s)", key, e)
            return False

    def discard(self, key: str, reason: str) -> None:
        """Forget a bad entry: logged, counted, deleted."""
        self.bad_entries += 1
        log.warning("disk tier: dropping entry %s: %s", key[:22], reason)
        self.delete(key)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
