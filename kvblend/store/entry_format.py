"""What a stored entry holds besides its tensors, and how a reader decides to trust it.

An entry is one chunk's (or prefix block's) KV, stored one layer at a time so a prefill can read
layer l while it computes layer l-1. Its header names the format version, the entry's own key,
the model fingerprint, dtype, shapes, positions and a digest per layer (k bytes then v bytes);
the entry checksum is the digest of the layer digests. An entry may also hold a compact copy of
its KV that only the attention probe reads (store.probe_copy), with its own digest per layer,
which the checksum covers too. Digests are XXH3-128 (format 1 used SHA-256, still read): every
read checks every layer, and SHA-256 cost a 6k-token prompt's read ~0.1 s of CPU, taken from
the prefill on a small machine. They guard against corruption, not forgery (neither does an
unkeyed SHA-256: who can write an entry can write its digests). A reader checks the header
against what it expects before it hands the entry out, and each layer's digest as it reads that
layer, so a corrupt, truncated, swapped or foreign entry is a miss, never wrong KV.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field

import torch
import xxhash

from . import probe_copy
from .half import HALF

FORMAT_VERSION = 2  # 2: XXH3-128 digests and the optional compact copy
READABLE = (1, 2)  # 1: SHA-256 digests, no compact copy
DIGESTS = {"sha256": hashlib.sha256, "xxh3_128": xxhash.xxh3_128}


class BadEntry(Exception):
    """A stored entry that cannot be used: the caller forgets it and recomputes.

    `delete` is False where the entry may be fine but its tier could not be reached."""

    def __init__(self, key: str, tier: str, reason: str, delete: bool = True):
        super().__init__(f"{tier} entry {key[:22]}: {reason}")
        self.key, self.tier, self.reason, self.delete = key, tier, reason, delete


@dataclass(frozen=True)
class EntrySpec:
    """What the reading model needs an entry to be."""

    fingerprint: str
    dtype: str  # torch dtype name without "torch."
    n_layers: int
    n_kv_heads: int
    head_dim: int


@dataclass
class EntryMeta:
    version: int
    key: str
    fingerprint: str
    dtype: str
    n_layers: int
    n_kv_heads: int
    n_tokens: int
    head_dim: int
    positions: list[int]
    layer_digests: list[str]
    checksum: str  # digest of the layer digests: the whole entry's data
    # "" (stored in `dtype`), "bf16" (bfloat16, converted to `dtype` as it is loaded) or "int8"
    # (int8 with float16 scales, decoded to `dtype`)
    quant: str = ""
    probe: str = ""  # "" or probe_copy.NAME: the entry holds a compact copy for the probe
    probe_digests: list[str] = field(default_factory=list)  # per layer, over the compact copy
    digest: str = "xxh3_128"  # the digests' algorithm, a DIGESTS name

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> EntryMeta:
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("version") not in READABLE:
            version = data.get("version") if isinstance(data, dict) else None
            raise ValueError(f"format version {version!r}, this reader knows {READABLE}")
        if data["version"] == 1:
            data = {k: v for k, v in data.items() if k != "layer_sha256"} | {
                "layer_digests": data.get("layer_sha256"), "digest": "sha256"}
        meta = cls(**data)
        if meta.digest not in DIGESTS:
            raise ValueError(f"unknown digest {meta.digest!r}")
        return meta

    @property
    def layer_shape(self) -> tuple[int, int, int]:
        return (self.n_kv_heads, self.n_tokens, self.head_dim)

    def part_specs(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """The tensors stored per layer, in storage and digest order, with dtype and shape."""
        if self.quant == "int8":
            scale = (self.n_kv_heads, self.n_tokens, 1)
            return {"k": (torch.int8, self.layer_shape), "v": (torch.int8, self.layer_shape),
                    "k_scale": (torch.float16, scale), "v_scale": (torch.float16, scale)}
        if self.quant not in ("", "bf16"):
            raise ValueError(f"unknown quantization {self.quant!r}")
        dt = HALF if self.quant == "bf16" else dtype_of(self.dtype)
        return {"k": (dt, self.layer_shape), "v": (dt, self.layer_shape)}

    def probe_specs(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """The compact copy's tensors per layer; none for an entry without one."""
        if not self.probe:
            return {}
        if self.probe != probe_copy.NAME:
            raise ValueError(f"unknown compact copy {self.probe!r}")
        return probe_copy.part_specs(self.n_kv_heads, self.n_tokens, self.head_dim)

    @property
    def layer_nbytes(self) -> int:
        return specs_nbytes(self.part_specs())

    @property
    def probe_layer_nbytes(self) -> int:
        return specs_nbytes(self.probe_specs())

    @property
    def nbytes(self) -> int:
        return self.n_layers * (self.layer_nbytes + self.probe_layer_nbytes) + 8 * self.n_tokens


def specs_nbytes(specs: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> int:
    return sum(dt.itemsize * math.prod(shape) for dt, shape in specs.values())


def dtype_of(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def raw_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy (bf16 too, which numpy cannot hold as such)."""
    t = t.detach().contiguous().cpu()
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


def layer_digest(parts: dict[str, torch.Tensor], algorithm: str = "xxh3_128") -> str:
    h = DIGESTS[algorithm]()
    for t in parts.values():
        h.update(raw_bytes(t))  # both release the GIL on large buffers
    return h.hexdigest()


def entry_checksum(digests: list[str], algorithm: str = "xxh3_128") -> str:
    return DIGESTS[algorithm]("".join(digests).encode()).hexdigest()


def describe(key: str, kv, fingerprint: str, probe: list[dict[str, torch.Tensor]] | None = None) -> EntryMeta:
    """The header of a ChunkKV (or its HalfKV or QuantKV forms), with `probe` its compact copy if it has one."""
    L, (H, n, d) = kv.n_layers, kv.parts(0)["k"].shape
    digests = [layer_digest(kv.parts(layer)) for layer in range(L)]
    probe_digests = [layer_digest(p) for p in probe] if probe else []
    return EntryMeta(FORMAT_VERSION, key, fingerprint, dtype_name(kv.dtype), L, H, n, d,
                     [int(p) for p in kv.positions], digests, entry_checksum(digests + probe_digests), kv.quant,
                     probe_copy.NAME if probe else "", probe_digests)


def check_meta(meta: EntryMeta, key: str, spec: EntrySpec | None) -> str | None:
    """Why an entry read under `key` must not be used, or None. Without a spec (the `store`
    commands, which load no model) only the entry's own consistency is checked."""
    if meta.key != key:
        return f"holds the entry of another key ({meta.key[:22]})"
    if len(meta.layer_digests) != meta.n_layers or len(meta.positions) != meta.n_tokens:
        return "header shapes disagree with its digests or positions"
    if len(meta.probe_digests) != (meta.n_layers if meta.probe else 0):
        return "header's compact copy disagrees with its digests"
    if entry_checksum(meta.layer_digests + meta.probe_digests, meta.digest) != meta.checksum:
        return "header checksum mismatch"
    if spec is None:
        return None
    if meta.fingerprint != spec.fingerprint:
        return f"computed by another model ({meta.fingerprint})"
    if meta.dtype != spec.dtype:
        return f"stored as {meta.dtype}, the model runs {spec.dtype}"
    if (meta.n_layers, meta.n_kv_heads, meta.head_dim) != (spec.n_layers, spec.n_kv_heads, spec.head_dim):
        return "shapes do not fit the model"
    return None


def check_layer(meta: EntryMeta, layer: int, parts: dict[str, torch.Tensor], compact: bool = False) -> str | None:
    """Why one layer's tensors (its compact copy's, with `compact`) must not be used, or None."""
    specs = meta.probe_specs() if compact else meta.part_specs()
    if list(parts) != list(specs):
        return f"layer {layer} holds {list(parts)}, header says {list(specs)}"
    for name, (dt, shape) in specs.items():
        t = parts[name]
        if tuple(t.shape) != shape or t.dtype != dt:
            return f"layer {layer} {name} is {t.dtype} {tuple(t.shape)}, header says {dt} {shape}"
    if layer_digest(parts, meta.digest) != (meta.probe_digests if compact else meta.layer_digests)[layer]:
        return f"layer {layer} {'compact copy ' if compact else ''}checksum mismatch"
    return None
