"""The engine: one request's prompt, from token ids to its KV and first logits.

plan (prefix cache, chunk store) -> prefill in the request's mode -> store what missed. The engine
loop (scheduler.py) drives it and decodes.
"""

from __future__ import annotations

import copy
import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from ..blend.controller import LoadingController
from ..blend.encode import encode_chunks
from ..blend.fusor import MODES, BlendConfig, PrefillOutput, PrefillStats, prefill
from ..blend.namespace_indexes import NamespaceIndexes
from ..blend.neighbours import NeighbourIndex
from ..blend.plan import KeyScheme, Plan, block_bounds, make_plan
from ..blend.segment import Segments, Span, segment, separator_ids
from ..config import Settings
from ..model.adapter import resolve_adapter
from ..model.allocator import release_freed_memory
from ..model.aliases import stale_key_scale_for
from ..model.loader import LoadedModel, load_model
from ..model.rotary import check_rerotation
from ..model.runner import Runner
from ..store.chunk_kv import ChunkKV
from ..store.entry_format import BadEntry, EntrySpec, dtype_name
from ..store.half import halve
from ..store.index_store import build_index_store
from ..store.int8 import quantize
from ..store.tiered import build_store

log = logging.getLogger(__name__)
GIB = 1 << 30
MAX_BAD_ENTRIES = 8  # bad entries one request may meet before it plans without the store


class RequestError(ValueError):
    """A request that cannot be served as given (bad ids, too long, empty)."""


@dataclass
class RequestMetrics:
    mode: str
    prompt_tokens: int
    ttft_s: float = 0.0
    decode_tokens: int = 0
    decode_tokens_per_s: float = 0.0
    prefix_hit_tokens: int = 0
    reused_tokens: int = 0
    recomputed_tokens: int = 0
    chunk_hits: int = 0  # found in the store (read, exact in the prefix, or recomputed by the loading controller)
    chunk_misses: int = 0  # not found: computed and stored after the request
    compute_frac: float = 1.0
    selected_positions: list[int] = field(default_factory=list)
    load_wait_s: float = 0.0  # time compute waited for stored KV
    chunk_tiers: list[str] = field(default_factory=list)  # per chunk: prefix, a tier, '<tier>: recomputed' or miss
    bad_entries: int = 0  # bad stored entries met (discarded and recomputed)
    controller: dict | None = None  # the loading controller's decision (ratio, chunks dropped, why)

    @classmethod
    def from_prefill(cls, mode: str, n: int, stats: PrefillStats) -> "RequestMetrics":
        return cls(mode=mode, prompt_tokens=n, prefix_hit_tokens=stats.prefix_hit_tokens,
                   reused_tokens=stats.reused_tokens, recomputed_tokens=stats.recomputed_tokens,
                   chunk_hits=stats.chunk_hits, chunk_misses=stats.chunk_misses,
                   compute_frac=stats.compute_frac, selected_positions=stats.selected_positions,
                   load_wait_s=stats.load_wait_s, chunk_tiers=stats.chunk_tiers, bad_entries=stats.bad_entries,
                   controller=stats.controller)


class Engine:
    @classmethod
    def from_settings(cls, settings: Settings, progress: bool = True) -> "Engine":
        """The model the settings name, loaded with their dtype, device and weight format, and its engine."""
        return cls(load_model(settings.model, settings.dtype, settings.device, settings.weights, progress=progress),
                   settings)

    def __init__(self, model: LoadedModel, settings: Settings | None = None, sep_ids: list[int] | None = None):
        self.settings = s = settings or Settings()
        self.model = model
        self.runner = Runner(model)
        self.tokenizer = model.tokenizer
        self.max_len = min(s.max_model_len or self.runner.max_len, self.runner.max_len)
        if any(layer >= self.runner.n_layers for layer in s.check_layers):
            raise ValueError(f"check layers {s.check_layers} out of range for a {self.runner.n_layers}-layer model")
        self.blend_cfg = BlendConfig(list(s.check_layers), list(s.recompute_ratios), s.deviation, s.check_layer_kv,
                                     s.weight_by_attention, self._stale_key_scale(neighbours=False),
                                     s.probe_layers, s.check_candidates, s.probe_separators,
                                     s.probe_attention_from, s.probe_suffix_tokens, s.min_recompute_tokens,
                                     s.probe_reads_copies())
        bos = getattr(self.tokenizer, "bos_token_id", None)
        bos = bos if bos is not None else getattr(model.config, "bos_token_id", None)
        # Models without a tokenizer (tests' tiny random models) name their separator ids.
        self.sep_ids = sep_ids or separator_ids(self.tokenizer, s.separator)
        # How chunk KV is stored: int8 where asked, else bfloat16 where the model's KV is float32.
        kv_dtype = model.kv_dtype  # what caches and stored KV hold (bf16 under fp32 products on some CPUs)
        self.chunk_storage = "int8" if s.kv_int8 else "bf16" if s.kv_half and kv_dtype == torch.float32 else ""
        self.keys = KeyScheme(s.namespace, model.fingerprint, kv_dtype, s.chunk_context, s.chunk_size, bos,
                              self.chunk_storage, self.sep_ids)
        self.adapter = resolve_adapter(s.chunk_adapter, s.model, model.config)
        self.keys.adapter = self.adapter.identity if self.adapter is not None else ""
        r = self.runner
        self.spec = EntrySpec(model.fingerprint, dtype_name(kv_dtype), r.n_layers, r.n_kv_heads, r.head_dim)
        self.store = build_store(s, self.spec)
        # Each namespace's neighbour index, kept beside the store's entries (Redis, local_disk).
        own = (s.namespace, Path(s.neighbour_index)) if s.neighbour_index is not None else None
        self.indexes = (NamespaceIndexes(build_index_store(self.store.tier("redis"), s.local_disk, own),
                                         s.neighbour_count)
                        if s.neighbour_context else None)
        self.neighbour_reencodes = 0  # chunks switched to a closer neighbour, their KV re-encoded after it
        self._switched: set[str] = set()  # namespaces whose index the writer changed: bound again at the next plan
        self._bind(self.keys)
        depth = r.n_layers if s.prefetch_depth is None else s.prefetch_depth
        self.prefetch_depth = depth if s.layerwise else 0
        self.controller = LoadingController(self.store) if s.loading_controller else None
        self.store.pick_by_bandwidth = s.loading_controller
        self.eos_ids = _eos_ids(model)
        self.rerotation_ok, why = check_rerotation(model.hf, self.max_len)
        if not self.rerotation_ok:
            warnings.warn(f"kvblend: cached KV cannot be moved between positions for this model ({why}); "
                          "serving every request with full prefill", RuntimeWarning, stacklevel=2)

    def _stale_key_scale(self, neighbours: bool) -> float:
        s = self.settings.stale_key_scale
        return s if s is not None else stale_key_scale_for(self.settings.model, neighbours)

    def use_neighbours(self, index: NeighbourIndex) -> None:
        """Precompute and look up chunks of the current namespace after their neighbours in this
        index (kept in this process only); their KV is less stale, so blend damps it less."""
        self.keys.neighbours = index
        self._damp(self.keys)

    def _damp(self, keys: KeyScheme) -> None:
        """Chunks precomputed after neighbours are less stale: blend damps them by the model's
        measured neighbour scale when the namespace (or the shared one) has an index."""
        indexed = keys.neighbours is not None or (keys.shared is not None and keys.shared.neighbours is not None)
        self.blend_cfg = replace(self.blend_cfg, stale_key_scale=self._stale_key_scale(neighbours=indexed))

    def _bind(self, keys: KeyScheme) -> None:
        """Give `keys` its namespace's neighbour index and the shared namespace's keys, as stored now."""
        keys.neighbours = self.indexes.get(keys.namespace) if self.indexes is not None else None
        keys.shared = self._shared_keys(keys)
        if keys.shared is not None:
            keys.shared.neighbours = self.indexes.get(keys.shared.namespace) if self.indexes is not None else None
        self._damp(keys)

    def _shared_keys(self, keys: KeyScheme) -> KeyScheme | None:
        """The shared namespace's keys beside `keys` (None: no shared namespace, or it is this one)."""
        name = self.settings.shared_namespace
        if name is None or name == keys.namespace:
            return None
        shared = copy.copy(keys)
        shared.namespace, shared.shared = name, None
        return shared

    @contextmanager
    def namespace(self, name: str):
        """Chunk and prefix keys, and the neighbour index, of namespace `name` for the calls inside,
        so that tenants never share cached KV or each other's chunks as context. The engine is used
        by one thread at a time, so swapping is safe."""
        saved = self.keys, self.blend_cfg
        self.keys = copy.copy(self.keys)  # cheap: a few fields (no cache per namespace to grow unbounded)
        self.keys.namespace = name
        self._bind(self.keys)
        try:
            yield
        finally:
            self.keys, self.blend_cfg = saved

    def index_collection(self, prompts: list[list[int]], segs: list[Segments | None] | None = None) -> int:
        """Add the chunks of these prompts (token ids; `segs`: their segments where known) to the
        current namespace's neighbour index, kept where the store keeps its entries; returns how
        many chunks were new. Older chunks they are much closer to switch to them once
        reencode_neighbours has stored their KV. A no-op when neighbour_context is off."""
        if self.indexes is None:
            return 0
        segs = segs or [None] * len(prompts)
        chunks = [ids[a:b] for ids, seg in zip(prompts, segs) for a, b in (seg or self.segments(ids)).chunks]
        new, index = self.indexes.add(self.keys.namespace, chunks)
        self.use_neighbours(index)
        return new

    # ---- checks ------------------------------------------------------------------------------

    def check_ids(self, token_ids: list[int], max_tokens: int = 0) -> None:
        if not token_ids:
            raise RequestError("the prompt is empty")
        vocab = self.runner.cfg.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise RequestError(f"invalid token ids {bad[:5]}: ids must be integers in [0, {vocab})")
        if len(token_ids) + max_tokens > self.max_len:
            raise RequestError(f"prompt of {len(token_ids)} tokens plus max_tokens {max_tokens} exceeds "
                               f"the model's context of {self.max_len} tokens")

    def effective_mode(self, mode: str | None) -> str:
        mode = mode or self.settings.mode
        if mode not in MODES:
            raise RequestError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        if mode in ("reuse", "blend") and not self.rerotation_ok:
            return "full"
        return mode

    # ---- prefill ---------------------------------------------------------------------------

    def segments(self, token_ids: list[int]) -> Segments:
        return segment(token_ids, self.sep_ids)

    def plan(self, token_ids: list[int], mode: str, store=None, seg: Segments | None = None) -> Plan:
        """What to read and what to compute; `seg`: the prompt's segments where they are known (a
        prompt built from documents), else found by the separator."""
        if self.keys.namespace in self._switched:  # chunks switched neighbours: look them up by the new keys
            self._switched.discard(self.keys.namespace)
            self._bind(self.keys)
        seg = seg or self.segments(token_ids)
        return make_plan(token_ids, seg, self.keys, self.store if store is None else store,
                         use_prefix=mode != "full", use_chunks=mode in ("reuse", "blend"))

    def prefill(self, token_ids: list[int], mode: str, extra_capacity: int = 0,
                blend_cfg: BlendConfig | None = None, seg: Segments | None = None) -> tuple[Plan, PrefillOutput]:
        """Plan and prefill. A stored entry found bad while it is read (corrupt, truncated,
        foreign, or its tier gone) is discarded and the request planned again without it, so
        the answer is what recomputing gives, never one made from wrong KV."""
        bad, bad_before = 0, self.store.bad_entries()
        while True:
            store = self.store if bad < MAX_BAD_ENTRIES else _NoStore()
            plan = self.plan(token_ids, mode, store, seg)
            cfg, decision = blend_cfg or self.blend_cfg, None
            if self.controller is not None and mode == "blend":
                cfg, decision = self.controller.decide(plan, cfg)
            try:
                out = prefill(self.runner, plan, mode, cfg, extra_capacity, self.prefetch_depth)
            except BadEntry as e:
                log.warning("%s; recomputing", e)
                self.store.discard(e)
                bad += 1
                continue
            # Bad entries met at lookup (header) and while reading layers, in this request.
            out.stats.bad_entries = self.store.bad_entries() - bad_before
            if self.controller is not None:
                s = out.stats
                self.controller.observe(s.compute_frac * self.runner.n_layers * plan.n_tokens, s.compute_s,
                                        s.copy_bytes, s.copy_s, s.read_bytes, s.read_cpu_s)
                s.controller = asdict(decision) if decision else None
            return plan, out

    def close(self) -> None:
        """Finish the background writes (the store's tiers keep what was computed)."""
        self.store.close()

    # ---- storing -------------------------------------------------------------------------

    def store_prefix(self, token_ids: list[int], seg: Segments, k: torch.Tensor, v: torch.Tensor, end: int,
                     start: int = 0, copy: bool = True) -> int:
        """Store exact KV (k, v: [L, Hkv, >=end-start, d], row 0 = position `start`) of rows
        [start, end) as prefix-cache blocks; their keys still hash every token from position 0.
        copy=False stores views of k and v: only for tensors that hold nothing but these rows (a
        view keeps its whole tensor alive)."""
        stored = 0
        for (a, b), key, shared_key in self._prefix_blocks(token_ids, seg, end):
            if a >= start and not self._held(key, shared_key):
                rows = slice(a - start, b - start)
                kb, vb = k[:, :, rows], v[:, :, rows]
                if copy:
                    kb, vb = kb.clone(), vb.clone()
                self.store.put(key, ChunkKV(kb, vb, torch.arange(a, b)))
                stored += 1
        return stored

    def blocks_missing(self, token_ids: list[int], seg: Segments, end: int, start: int = 0) -> bool:
        """Whether any prefix-cache block of rows [start, end) is not stored yet."""
        return any(not self._held(key, shared_key)
                   for span, key, shared_key in self._prefix_blocks(token_ids, seg, end) if span[0] >= start)

    def _held(self, key: str, shared_key: str | None) -> bool:
        """Whether a block is stored here, or in the shared namespace (no copy is kept here then)."""
        return key in self.store or (shared_key is not None and shared_key in self.store)

    def _prefix_blocks(self, token_ids: list[int], seg: Segments, end: int) -> list[tuple[Span, str, str | None]]:
        """Each whole block of rows [0, end): its span, its key, and its key in the shared namespace."""
        bounds = [b for b in block_bounds(seg, self.keys.block, end) if b[1] <= end]
        shared = self.keys.shared
        shared_keys = shared.prefix_keys(token_ids, bounds) if shared is not None else [None] * len(bounds)
        return list(zip(bounds, self.keys.prefix_keys(token_ids, bounds), shared_keys))

    def store_first_chunks(self, token_ids: list[int], seg: Segments) -> int:
        """Each chunk's exact KV as it stands first in a prompt with this prefix (right after it,
        with the separator that follows), as prefix-cache blocks: a prompt's first chunk is then
        read exact, never stale, and blend spends its recompute on the others. Returns chunks stored."""
        return len(self._store_firsts(token_ids, seg))

    def _store_firsts(self, token_ids: list[int], seg: Segments) -> dict[tuple[int, ...], ChunkKV]:
        """store_first_chunks; returns the KV it encoded (each chunk's rows, then the separator's)
        by chunk ids."""
        C, n_sep = seg.exact_end, len(self.sep_ids)
        todo = {}  # first prompt's ids -> (them, their segments)
        for a, b in seg.chunks:
            first = token_ids[:C] + token_ids[a:b] + self.sep_ids
            first_seg = self.segments(first)
            if self.blocks_missing(first, first_seg, len(first), start=C):
                todo[tuple(first)] = (first, first_seg)
        firsts = list(todo.values())
        encoded = list(encode_chunks(self.runner, token_ids[:C], [first[C:] for first, _ in firsts]))
        for (first, first_seg), kv in zip(firsts, encoded):  # each encoding is just its blocks' rows
            self.store_prefix(first, first_seg, kv.k, kv.v, len(first), start=C, copy=False)
        return {tuple(first[C:len(first) - n_sep]): kv for (first, _), kv in zip(firsts, encoded)}

    def precompute(self, token_ids: list[int], seg: Segments | None = None) -> int:
        """Compute and store the prefix segment and every chunk of a prompt that is not stored
        yet (what `/v1/chunks` and `kvblend store` do ahead of requests). Returns chunks stored."""
        seg = seg or self.segments(token_ids)
        context = self.keys.context_ids(token_ids, seg)
        todo = {}
        for a, b in seg.chunks:
            ids = token_ids[a:b]
            key = self.keys.chunk_key(ids, context)
            if key not in self.store and key not in todo:
                todo[key] = ids
        # The prefix is computed only when some of its blocks are not stored yet.
        if seg.separators and seg.exact_end > 0 and self.blocks_missing(token_ids, seg, seg.exact_end):
            exact = token_ids[: seg.exact_end]
            cache = self.runner.new_cache(len(exact))
            self.runner.forward(torch.tensor(exact), torch.arange(len(exact)), cache)
            self.store_prefix(token_ids, seg, cache.k, cache.v, len(exact))
        firsts = {}
        if self.settings.exact_first_chunk and seg.separators and seg.exact_end > 0:
            firsts = self._store_firsts(token_ids, seg)
        for key, kv in self._encode(todo, context, firsts):
            self._store_chunk(key, kv)
        if self.model.device.type == "cpu" and (todo or firsts):
            release_freed_memory()  # the encodings' caches and activations: a request's are shaped otherwise
        return len(todo)

    def _store_chunk(self, key: str, kv: ChunkKV) -> None:
        """Chunk KV (never prefix blocks) may be stored as int8 or bfloat16, and with the probe's
        compact copy."""
        kv.probe_copy = self.settings.compact_probe is not False
        form = {"int8": quantize, "bf16": halve}.get(self.chunk_storage)
        self.store.put(key, form(kv) if form else kv)

    def _encode(self, todo: dict[str, list[int]], context: list[int],
                firsts: dict[tuple[int, ...], ChunkKV]) -> dict[str, ChunkKV]:
        """Each chunk's KV by key. A chunk precomputed after the prefix alone (no neighbour) has the
        very rows its first-chunk encoding began with: they are cut from it, not encoded again
        (unless a chunk adapter makes chunk KV, which exact first chunks never use)."""
        leads = {key: self.keys.lead_ids(ids) for key, ids in todo.items()}
        cut = self.keys.chunk_context == "prefix" and self.adapter is None
        rest = []
        for key, ids in todo.items():
            kv = firsts.get(tuple(ids)) if cut and not leads[key] else None
            if kv is not None:  # views: in memory the chunk and its blocks share one tensor (counted twice)
                n = len(ids)
                yield key, ChunkKV(kv.k[:, :, :n], kv.v[:, :, :n], kv.positions[:n].clone())
            else:
                rest.append(key)
        yield from zip(rest, encode_chunks(self.runner, context, [todo[k] for k in rest], [leads[k] for k in rest],
                                           self.adapter))

    def store_after(self, token_ids: list[int], plan: Plan, out: PrefillOutput, mode: str,
                    misses: bool = True) -> list[Span]:
        """Keep what this request computed exactly, and (with `misses`) the chunks it missed, as
        store_misses does. Returns the spans of the missed chunks (a caller storing them later
        passes them to store_misses)."""
        if mode == "full":
            return []
        reused = plan.reused_mask()
        exact_end = int(reused.nonzero()[0]) if bool(reused.any()) else plan.n_tokens
        self.store_prefix(token_ids, plan.segments, out.cache.k, out.cache.v, exact_end)
        missed = [c.span for c in plan.misses]
        if missed and misses:
            self.store_misses(token_ids, missed, plan.segments)
            self.reencode_neighbours(token_ids, plan.segments)  # older chunks they are much closer to
        return missed

    def store_misses(self, token_ids: list[int], missed: list[Span], seg: Segments | None = None) -> int:
        """Documents first met in a request join the current namespace's collection: the chunks
        that missed are indexed (each after its most similar chunk of this namespace, the
        request's other documents included) and precomputed, so the next request with them
        gets indexed chunks. Returns chunks stored."""
        seg = seg or self.segments(token_ids)
        chunks = [token_ids[a:b] for a, b in missed]
        if self.indexes is not None and chunks:
            new, index = self.indexes.add(self.keys.namespace, chunks)
            if new:
                self.use_neighbours(index)
        return self.precompute(token_ids, seg)

    def reencode_neighbours(self, token_ids: list[int], seg: Segments | None = None, limit: int | None = None) -> int:
        """Chunks of the current namespace for which a much closer chunk joined the collection
        since they were indexed: encode each after that chunk, in this prompt's context (one
        system prompt is the common case), and store it. Lookups keep the old key, and its stored
        KV, until the store has written the new KV behind; then, on the store's background writer,
        the index switches each chunk to its new neighbour. Encodes at most `limit` chunks (None:
        all); returns how many it encoded."""
        index = self.indexes.get(self.keys.namespace) if self.indexes is not None else None
        waiting = index.waiting() if index is not None else []
        if not waiting:
            return 0
        context = self.keys.context_ids(token_ids, seg or self.segments(token_ids))
        todo = {}  # key after the new neighbour -> (chunk, new neighbour, lead ids)
        for chunk, candidate, lead in waiting:
            lead_ids = self.keys.lead_after(lead)
            todo[self.keys.chunk_key(chunk, context, lead_ids)] = (chunk, candidate, lead_ids)
        # A key stored already was encoded by an earlier try (one whose switch waits, or cut short).
        stored = {key for key in todo if key in self.store}
        encode = [key for key in todo if key not in stored][:limit]
        kvs = encode_chunks(self.runner, context, [todo[key][0] for key in encode], [todo[key][2] for key in encode],
                            self.adapter)
        for key, kv in zip(encode, kvs):
            self._store_chunk(key, kv)
        switch = {key: todo[key][:2] for key in [*stored, *encode]}
        self.store.after_writes(self._switch_neighbours, self.keys.namespace, switch)
        return len(encode)

    def _switch_neighbours(self, ns: str, todo: dict[str, tuple[list[int], list[int]]]) -> None:
        """On the store's writer, after the re-encoded KV's writes: switch the chunks whose new KV
        every tier written behind holds (a write dropped, or owed to a tier that is down, waits for
        the next try)."""
        written = [pair for key, pair in todo.items() if self.store.written(key)]
        switched = self.indexes.promote(ns, written)
        self.neighbour_reencodes += switched
        if switched:
            self._switched.add(ns)


class _NoStore:
    """Every lookup a miss: the last resort of a request that met too many bad entries."""

    def get(self, key: str) -> None:
        return None


def _eos_ids(model: LoadedModel) -> set[int]:
    ids = set()
    for source in (getattr(model.hf, "generation_config", None), model.config, model.tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return ids
