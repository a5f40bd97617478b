"""Planning one request: which rows come exact from the prefix cache, which chunks hit the chunk
store, and which rows must be computed."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..store.chunk_kv import ChunkKV
from ..store.keys import chunk_key, prefix_block_keys, tokens_hash
from ..store.tier import StoredEntry
from .neighbours import NeighbourIndex
from .segment import Segments, Span

CHUNK_CONTEXTS = ("bare", "bos", "prefix")


@dataclass
class ChunkRef:
    span: Span
    key: str
    kv: ChunkKV | StoredEntry | None  # None: a miss, computed in the request and stored after it
    note: str | None = None  # why a stored chunk is computed anyway (the loading controller)
    exact: bool = False  # inside the prefix hit: its rows come exact, its stored KV is never read

    @property
    def tier(self) -> str:
        if self.exact:
            return "prefix"
        return self.kv.tier if self.kv is not None else (self.note or "miss")


@dataclass
class Plan:
    token_ids: torch.Tensor  # [T]
    segments: Segments
    prefix_hit: int = 0  # rows [0, prefix_hit) are exact KV from the prefix cache
    prefix_blocks: list[tuple[Span, ChunkKV | StoredEntry]] = field(default_factory=list)
    chunks: list[ChunkRef] = field(default_factory=list)

    @property
    def n_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    def reused_mask(self) -> torch.Tensor:
        """Rows whose KV can come from a cached chunk (not from the exact prefix)."""
        return self.chunk_index() >= 0

    def chunk_index(self) -> torch.Tensor:
        """Each reused row's chunk among the plan's chunks (see reused_mask), else -1."""
        index = torch.full((self.n_tokens,), -1, dtype=torch.long)
        for i, c in enumerate(self.chunks):
            if c.kv is not None:
                index[c.span[0]:c.span[1]] = i
        index[: self.prefix_hit] = -1
        return index

    def separator_mask(self) -> torch.Tensor:
        """Rows of the separator tokens between segments: never part of a reused chunk."""
        mask = torch.zeros(self.n_tokens, dtype=torch.bool)
        for a, b in self.segments.separators:
            mask[a:b] = True
        return mask

    def read_chunks(self) -> list[ChunkRef]:
        """Hit chunks whose stored KV is read (a chunk inside the prefix hit is a hit, but exact)."""
        return [c for c in self.chunks if c.kv is not None]

    @property
    def hits(self) -> int:
        """Chunks found in the store: read, exact in the prefix, or recomputed by choice (`note`)."""
        return len(self.chunks) - len(self.misses)

    @property
    def misses(self) -> list[ChunkRef]:
        """Chunks the store does not hold: computed in the request and stored after it."""
        return [c for c in self.chunks if c.kv is None and not c.exact and c.note is None]


def block_bounds(seg: Segments, block: int, limit: int) -> list[Span]:
    """Prefix-cache blocks covering [0, limit): cut at every segment edge and every `block`
    tokens inside a segment, so the same segments always give the same blocks."""
    edges = {0, limit, *[e for span in (seg.prefix, *seg.separators, *seg.chunks, seg.suffix) for e in span]}
    cuts = sorted(e for e in edges if e <= limit)
    bounds = []
    for a, b in zip(cuts, cuts[1:]):
        bounds += [(s, min(s + block, b)) for s in range(a, b, block)]
    return bounds


class KeyScheme:
    """Everything that must agree for two requests to share KV, bound to one model."""

    def __init__(self, namespace: str, fingerprint: str, dtype: torch.dtype, chunk_context: str,
                 block: int, bos_id: int | None, storage: str = "", sep_ids: list[int] | None = None):
        if chunk_context not in CHUNK_CONTEXTS:
            raise ValueError(f"unknown chunk context {chunk_context!r}; choose one of {CHUNK_CONTEXTS}")
        if chunk_context == "bos" and bos_id is None:
            raise ValueError("chunk context 'bos' needs a tokenizer with a BOS token")
        self.namespace, self.fingerprint = namespace, fingerprint
        self.dtype = str(dtype).removeprefix("torch.")
        # Chunks stored in another form (a ChunkKV's `quant`: "bf16", "int8") are other KV than the
        # model's own: they never share a key.
        self.chunk_dtype = self.dtype + (f"+{storage}" if storage else "")
        self.chunk_context, self.block, self.bos_id = chunk_context, block, bos_id
        self.sep_ids = list(sep_ids or [])
        # The chunk adapter's identity ("": none): chunk KV made with one never meets KV made
        # with another or with none. Prefix blocks are exact, made without one, and keep their keys.
        self.adapter = ""
        self.neighbours: NeighbourIndex | None = None  # set when a collection is indexed
        # The shared namespace's keys (read only): where a lookup missing here looks next.
        self.shared: KeyScheme | None = None

    def context_ids(self, token_ids: list[int], seg: Segments) -> list[int]:
        """The left context a chunk is precomputed after (its KV is dropped)."""
        if self.chunk_context == "bos":
            return [self.bos_id]
        if self.chunk_context == "prefix":
            return token_ids[: seg.exact_end]
        return []

    def lead_ids(self, chunk_ids: list[int]) -> list[int]:
        """What a chunk is precomputed after besides the context: its neighbour in the indexed
        collection (after its `more` chunks, if any), each followed by a separator as in a prompt;
        nothing for a chunk outside it."""
        return self.lead_after(self.neighbours.lead_of(chunk_ids) if self.neighbours is not None else [])

    def lead_after(self, chunks: list[list[int]]) -> list[int]:
        """The lead of a chunk precomputed after `chunks` ([]: after nothing)."""
        return [t for chunk in chunks for t in chunk + self.sep_ids]

    def chunk_key(self, chunk_ids: list[int], context_ids: list[int], lead: list[int] | None = None) -> str:
        """The key of the chunk's KV after the context and `lead` (None: its lead in the index)."""
        lead = self.lead_ids(chunk_ids) if lead is None else lead
        mode = self.chunk_context + ("+neighbour" if lead else "")
        mode += f"+adapter-{self.adapter}" if self.adapter else ""
        ctx_hash = tokens_hash(context_ids + lead) if self.chunk_context == "prefix" or lead else ""
        return chunk_key(self.namespace, self.fingerprint, self.chunk_dtype, mode, ctx_hash, chunk_ids)

    def prefix_keys(self, token_ids: list[int], bounds: list[Span]) -> list[str]:
        return prefix_block_keys(self.namespace, self.fingerprint, self.dtype, token_ids, bounds)


def _lookup(store, key: str, shared_key: str | None):
    """(key, entry) under `key`, else under the shared namespace's key (read, never written);
    a miss keeps the own key, under which it is stored."""
    kv = store.get(key)
    if kv is None and shared_key is not None:
        hit = store.get(shared_key)
        if hit is not None:
            return shared_key, hit
    return key, kv


def make_plan(token_ids: list[int], seg: Segments, keys: KeyScheme, store, use_prefix: bool,
              use_chunks: bool) -> Plan:
    plan = Plan(torch.tensor(token_ids, dtype=torch.long), seg)
    shared = keys.shared
    blocks, chunks = [], []  # (span, key, shared key) to look up, in order
    if use_prefix:
        bounds = block_bounds(seg, keys.block, len(token_ids))
        # A block's KV is exact whichever namespace computed it: own and shared blocks may mix.
        shared_keys = shared.prefix_keys(token_ids, bounds) if shared else [None] * len(bounds)
        blocks = list(zip(bounds, keys.prefix_keys(token_ids, bounds), shared_keys))
    if use_chunks:
        context = keys.context_ids(token_ids, seg)
        for span in seg.chunks:
            ids = token_ids[span[0]:span[1]]
            chunks.append((span, keys.chunk_key(ids, context),
                           shared.chunk_key(ids, context) if shared is not None else None))
    if hasattr(store, "prefetch"):  # every lookup's reads at once, not one after another
        store.prefetch([k for _, *both in blocks + chunks for k in both if k is not None])
    if use_prefix:
        for span, key, shared_key in blocks:
            _, kv = _lookup(store, key, shared_key)
            if kv is None:
                break
            plan.prefix_blocks.append((span, kv))
            plan.prefix_hit = span[1]
        # The last row is always computed: its logits give the first token.
        plan.prefix_hit = min(plan.prefix_hit, len(token_ids) - 1)
    for span, key, shared_key in chunks:
        if span[1] <= plan.prefix_hit:  # looking it up would only cost a read and a promotion
            plan.chunks.append(ChunkRef(span, key, None, exact=True))
            continue
        plan.chunks.append(ChunkRef(span, *_lookup(store, key, shared_key)))  # a miss doesn't stop lookup
    return plan
