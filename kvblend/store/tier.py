"""The interface every storage tier keeps, and the lazily read entry of the slower tiers.

A tier maps keys to chunk KV with a capacity in bytes and LRU eviction. `get` returns a ChunkKV
(memory) or a StoredEntry that reads its layers when asked (disk, Redis), or None on a miss.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch

from .chunk_kv import ChunkKV
from .entry_format import BadEntry, EntryMeta, check_layer, dtype_of
from .half import HalfKV
from .int8 import QuantKV, dequantize_tensor


class TierDown(Exception):
    """A shared tier that cannot be reached now (Redis down): reads miss, writes wait."""


class Tier(Protocol):
    name: str
    capacity_bytes: int

    @property
    def used_bytes(self) -> int: ...

    def get(self, key: str) -> ChunkKV | StoredEntry | None: ...

    def put(self, key: str, kv: ChunkKV) -> bool: ...

    def __contains__(self, key: str) -> bool: ...

    def delete(self, key: str) -> bool: ...

    def keys(self) -> list[str]: ...

    def __len__(self) -> int: ...

    def counters(self) -> dict[str, int]: ...


class Meter:
    """A measured rate (bytes/s of a tier's layer reads, rows/s of compute), smoothed so one
    slow read moves it but does not own it. None until first measured."""

    def __init__(self, weight: float = 0.3):
        self.rate: float | None = None
        self.weight = weight

    def record(self, amount: float, seconds: float) -> None:
        if amount <= 0 or seconds <= 0:
            return
        r = amount / seconds
        self.rate = r if self.rate is None else (1 - self.weight) * self.rate + self.weight * r


class Counters:
    """What a tier counts; `counters()` is what metrics and `kvblend store ls` show."""

    def __init__(self):
        self.hits = self.misses = self.puts = self.evictions = self.bad_entries = self.write_errors = 0
        self.meter = Meter()  # bytes/s of this tier's layer reads, checks included

    def counters(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in
                ("hits", "misses", "puts", "evictions", "bad_entries", "write_errors")}


class StoredEntry:
    """An entry of a slower tier, its header already checked; layers are read (and their digests
    checked) one at a time, so the loader can fetch layer l+1 while layer l computes."""

    def __init__(self, meta: EntryMeta, tier: str, meter: Meter | None = None):
        self.meta, self.tier, self.key, self.meter = meta, tier, meta.key, meter
        self.positions = torch.tensor(meta.positions, dtype=torch.long)

    @property
    def n_tokens(self) -> int:
        return self.meta.n_tokens

    @property
    def n_layers(self) -> int:
        return self.meta.n_layers

    @property
    def nbytes(self) -> int:
        return self.meta.nbytes

    @property
    def has_probe_copy(self) -> bool:
        return bool(self.meta.probe)

    def _read_layer(self, layer: int) -> dict[str, torch.Tensor]:
        """The stored tensors of one layer, named as in EntryMeta.part_specs."""
        raise NotImplementedError

    def _read_probe_layer(self, layer: int) -> dict[str, torch.Tensor]:
        """The compact copy's tensors of one layer, named as in EntryMeta.probe_specs."""
        raise NotImplementedError

    def parts(self, layer: int, compact: bool = False) -> dict[str, torch.Tensor]:
        """One layer's tensors as stored (its compact copy's, with `compact`), read and checked."""
        t0 = time.perf_counter()
        what = "compact copy of layer" if compact else "layer"
        try:
            parts = self._read_probe_layer(layer) if compact else self._read_layer(layer)
        except BadEntry:
            raise
        except Exception as e:  # truncated file, missing value, undecodable bytes: all a miss
            raise BadEntry(self.key, self.tier, f"{what} {layer} unreadable ({type(e).__name__}: {e})") from e
        why = check_layer(self.meta, layer, parts, compact)
        if why:
            raise BadEntry(self.key, self.tier, why)
        if self.meter is not None:
            nbytes = self.meta.probe_layer_nbytes if compact else self.meta.layer_nbytes
            self.meter.record(nbytes, time.perf_counter() - t0)
        return parts

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [Hkv, n, d] of one layer, read and checked: in the model's dtype, or bfloat16 for
        a half entry (the cache converts it as it is written)."""
        p = self.parts(layer)
        if self.meta.quant == "int8":
            dt = dtype_of(self.meta.dtype)
            return dequantize_tensor(p["k"], p["k_scale"], dt), dequantize_tensor(p["v"], p["v_scale"], dt)
        return p["k"], p["v"]

    def verify(self) -> None:
        """Read and check every layer and its compact copy; BadEntry at the first bad one."""
        for layer in range(self.n_layers):
            self.parts(layer)
            if self.has_probe_copy:
                self.parts(layer, compact=True)

    def materialize(self) -> ChunkKV | HalfKV | QuantKV:
        """Every layer read and checked, as stored: what promotion to a faster tier keeps."""
        layers = [self.parts(layer) for layer in range(self.n_layers)]
        stack = {name: torch.stack([p[name] for p in layers]) for name in layers[0]}
        if self.meta.quant == "int8":
            return QuantKV(stack["k"], stack["v"], stack["k_scale"], stack["v_scale"], self.positions.clone(),
                           dtype_of(self.meta.dtype))
        if self.meta.quant == "bf16":
            return HalfKV(stack["k"], stack["v"], self.positions.clone(), model_dtype=dtype_of(self.meta.dtype))
        return ChunkKV(stack["k"], stack["v"], self.positions.clone())
