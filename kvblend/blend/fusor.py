"""Prefill of one planned request in any mode: full, prefix, reuse or blend.

Rows [0, prefix_hit) hold exact KV from the prefix cache. Reused rows hold cached chunk KV moved
to their new positions. Blend computes the other rows through the layers before the first check
layer (by default only the must-compute rows and the reused rows the suffix attends to most, in a
reuse pass first), then at each check layer keeps only the reused rows whose fresh K (or V)
deviates most from the cached one (by default weighted by that attention); after it only the kept
rows (and the rows that must always be computed: separators, missed chunks, the suffix) go on,
at their true positions, and their fresh KV overwrites the cached rows.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from ..model.runner import KVCache, Rows, Runner
from .loader import ChunkLoader
from .plan import Plan
from .select import attend_with_mass, deviation, n_selected, top_tokens, weighted

MODES = ("full", "prefix", "reuse", "blend")


@dataclass
class BlendConfig:
    check_layers: list[int] = field(default_factory=lambda: [1])
    ratios: list[float] = field(default_factory=lambda: [0.08])
    deviation: str = "v"
    check_layer_kv: str = "fresh"  # KV that unselected rows keep at the check layer itself
    # Weight each token's deviation by the attention the prompt's suffix pays it, measured in a
    # reuse pass first (a few percent of a full prefill's compute): recompute what the question reads.
    weight_by_attention: bool = True
    # Attention to stale chunk keys (reused KV that was not recomputed at a layer) is scaled by
    # this factor, a logit bias of log(scale) (as APE damps independently encoded contexts): such
    # keys were computed without the other chunks before them and draw more attention than they
    # would in a full prefill. 1.0 leaves attention exact; fresh keys are never touched. The
    # engine passes the value measured for its model (model/aliases.py).
    stale_key_scale: float = 1.0
    # The attention probe walks only the first `probe_layers` layers (None: all) and sums the
    # suffix's attention there; the blend pass loads the rest. Its cost is a reuse pass's, pro rata.
    probe_layers: int | None = None
    # Layers before the first check are computed only for the must-compute rows and the reused
    # rows the probe's attention ranks highest, `check_candidates` times as many as the first check
    # keeps (0: every row). Layer 0's loaded KV is exact (it depends on a token and its position
    # only), so with a check at layer 1 those rows' deviation is exact; a token outside them would
    # need a deviation several times the candidates' to be chosen. Needs weight_by_attention.
    check_candidates: float = 3.0
    # The probe computes the separators between chunks too (they are must-compute rows). False:
    # it skips them and hides their keys from its rows; the blend pass computes them as before.
    probe_separators: bool = False
    # The probe sums the suffix's attention over the layers from this share of the depth on (0: all
    # of them): the first layers' attention is mostly local and positional and ranks worse. Below
    # it the probe's rows attend as in any pass. See docs/experiments.md#the-probe.
    probe_attention_from: float = 1 / 3
    # The probe computes only the suffix's last `probe_suffix_tokens` rows (0: all of it) and hides
    # the rest of the suffix from them, as the separators: the question's end reads the passages.
    probe_suffix_tokens: int = 32
    # Each check layer keeps at least this many reused tokens, whatever the ratio: on a short
    # prompt a ratio leaves a few dozen tokens, and one stale token there can flip a near-tie in
    # the answer; from a few thousand tokens on the ratio's own budget is larger and this is moot.
    min_recompute_tokens: int = 0
    # The probe reads the compact copy of chunks stored with one (disk, Redis entries): on a slow
    # tier it then finishes early and the full KV streams in behind it for the blend pass.
    compact_probe: bool = False

    def __post_init__(self):
        if self.check_candidates and self.check_candidates < 1:
            raise ValueError(f"check_candidates must be >= 1 (or 0 for every row), got {self.check_candidates}")
        if self.probe_layers is not None and self.probe_layers < 1:
            raise ValueError(f"probe_layers must be >= 1 (or None for every layer), got {self.probe_layers}")
        if not 0 <= self.probe_attention_from < 1:
            raise ValueError(f"probe_attention_from must be in [0, 1), got {self.probe_attention_from}")
        if self.min_recompute_tokens < 0:
            raise ValueError(f"min_recompute_tokens must be >= 0, got {self.min_recompute_tokens}")
        if self.probe_suffix_tokens < 0:
            raise ValueError(f"probe_suffix_tokens must be >= 0 (0: the whole suffix), got {self.probe_suffix_tokens}")
        if not 0 < self.stale_key_scale <= 1:
            raise ValueError(f"stale_key_scale must be in (0, 1], got {self.stale_key_scale}")
        if len(self.ratios) == 1 and len(self.check_layers) > 1:
            self.ratios = self.ratios * len(self.check_layers)
        if len(self.ratios) != len(self.check_layers):
            raise ValueError(f"{len(self.ratios)} recompute ratios for {len(self.check_layers)} check layers")
        if self.check_layer_kv not in ("fresh", "cached"):
            raise ValueError(f"check_layer_kv must be 'fresh' or 'cached', got {self.check_layer_kv!r}")

    def budget(self, ratio: float, n_reused: int) -> int:
        """Reused rows a check at `ratio` keeps, this config's minimum included."""
        return n_selected(ratio, n_reused, self.min_recompute_tokens)


@dataclass
class PrefillStats:
    prefix_hit_tokens: int = 0
    reused_tokens: int = 0  # rows whose final KV at the last layer came from a cached chunk
    recomputed_tokens: int = 0  # rows computed through every layer after the prefix
    chunk_hits: int = 0  # found in the store (read, exact in the prefix, or recomputed by the loading controller)
    chunk_misses: int = 0  # not found: computed and stored after the request
    compute_frac: float = 1.0  # computed (layer, row) pairs / a full prefill's
    load_wait_s: float = 0.0  # time the layers waited for stored KV to be read and re-encoded
    compute_s: float = 0.0  # time in the layers, waits and copies excluded: what the loading controller measures
    controller: dict | None = None  # the loading controller's decision, where it ran
    chunk_tiers: list[str] = field(default_factory=list)  # per chunk: prefix, a tier, '<tier>: recomputed' or miss
    compact_chunks: int = 0  # chunks the probe read from their compact copies (compact_probe)
    copy_s: float = 0.0  # time the probe spent decoding and writing those copies (not in compute_s)
    copy_bytes: int = 0  # the copies' bytes it decoded
    read_cpu_s: float = 0.0  # the reading thread's CPU for the layers it read from stored entries
    read_bytes: int = 0  # the bytes it read from them
    bad_entries: int = 0  # stored entries found bad during this request (discarded, recomputed)
    selected_positions: list[int] = field(default_factory=list)  # reused rows chosen for recompute
    recomputed_positions: list[int] = field(default_factory=list)  # every row computed to the end
    checked_positions: list[int] = field(default_factory=list)  # rows the main pass began with (blend: checked)


@dataclass
class PrefillOutput:
    cache: KVCache
    logits: torch.Tensor  # [vocab] of the prompt's last token
    stats: PrefillStats


class Selector:
    """At each check layer, which of the active rows go on: every must-compute row, and the
    reused rows with the highest scores, `ratio` of all reused rows."""

    def __init__(self, checks: dict[int, float], cfg: BlendConfig, reused: torch.Tensor,
                 attention: torch.Tensor | None):
        self.checks, self.attention, self.reused = checks, attention, reused
        self.signal, self.check_layer_kv = cfg.deviation, cfg.check_layer_kv
        self.n_reused, self.budget = int(reused.sum()), cfg.budget

    def keep(self, layer: int, active: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             cache: KVCache) -> torch.Tensor | None:
        """A mask over the active rows, or None where `layer` is no check layer."""
        if layer not in self.checks:
            return None
        cand = self.reused[active]  # reused rows still active: the candidates
        cand_idx = cand.nonzero().squeeze(1)
        cand_pos = active[cand_idx]
        score = deviation(self.signal, k[:, cand_idx], cache.k[layer][:, cand_pos],
                          v[:, cand_idx], cache.v[layer][:, cand_pos])
        if self.attention is not None:
            score = weighted(score, self.attention[cand_pos])
        keep = ~cand
        keep[cand_idx[top_tokens(score, self.budget(self.checks[layer], self.n_reused))]] = True
        return keep


@dataclass
class Pass:
    """One walk through the layers: what it computed and, if asked, what the watched rows read."""

    rows: Rows  # after the last layer only the last row; a watching pass's rows stop a layer short
    active: torch.Tensor  # positions of the rows computed at the last layer
    computed: int  # (layer, row) pairs computed
    attention: torch.Tensor | None  # [T] attention mass the watched rows put on each position


class StaleBias:
    """Sets each layer's key bias: log(scale) on the reused rows whose KV there is stale (loaded,
    not written by this pass), no bias where there are none. Layers below `exact_below` hold no
    stale rows (a blend pass that computes only candidates there: layer 0's loaded KV is exact).
    `hidden` positions (a pass that skips them) get -inf: no row reads their keys. The bias is in
    the activation dtype `dtype` (KV may be held narrower)."""

    def __init__(self, scale: float, reused: torch.Tensor, cache: KVCache, dtype: torch.dtype):
        self.log_scale, self.reused, self.cache, self.dtype = math.log(scale), reused, cache, dtype
        self.written, self.bias = None, None
        self.exact_below = 0
        self.hidden: torch.Tensor | None = None

    def hide(self, positions: torch.Tensor | None) -> None:
        self.hidden, self.written = positions, None  # the next set() builds the bias again
        if positions is not None:
            # Their slots are never written by the pass that hides them, and a fresh cache is
            # uninitialised: a NaN key or value there would survive the -inf (NaN + -inf, 0 * NaN).
            self.cache.k[:, :, positions] = 0
            self.cache.v[:, :, positions] = 0

    def set(self, layer: int, written: torch.Tensor) -> None:
        if (self.log_scale == 0 and self.hidden is None) or layer < self.exact_below:
            self.cache.key_bias[layer] = None
            return
        if self.written is not written:  # the stale rows change only where the written rows do
            stale = self.reused.clone()
            stale[written] = False
            self.written, self.bias = written, None
            if (self.log_scale != 0 and bool(stale.any())) or self.hidden is not None:
                self.bias = torch.zeros(self.cache.capacity, dtype=self.dtype, device=stale.device)
                self.bias[: stale.shape[0]][stale] = self.log_scale
                if self.hidden is not None:
                    self.bias[self.hidden] = float("-inf")
        self.cache.key_bias[layer] = self.bias


def run_layers(runner: Runner, cache: KVCache, loader: ChunkLoader, rows: Rows, active: torch.Tensor,
               stale: StaleBias, selector: Selector | None = None, watch: torch.Tensor | None = None,
               n_layers: int | None = None, mass_from: int = 0) -> Pass:
    """Every layer over the active rows, the loader supplying each layer's cached KV first (once
    per prefill); the selector narrows the rows at its check layers. `watch` (a mask over the
    rows; no selector) sums the attention those rows pay each position, over the layers from
    `mass_from` on (the last layer always counts). A pass may stop early, after `n_layers` layers."""
    T = cache.length
    mass = torch.zeros(T, device=runner.device) if watch is not None else None
    if watch is not None:  # the watched rows (the suffix) are the last ones; the others attend as usual
        n_head = int((~watch).sum())
        if bool(watch[:n_head].any()):
            raise ValueError("the watched rows must be the last rows of the pass")
        head = Rows(rows.h[:0], active[:n_head], {})  # its query groups, built once for every layer
    computed = 0
    depth = runner.n_layers if n_layers is None else n_layers
    for layer in range(depth):
        loader.load_layer(layer)
        q, k, v = runner.qkv(layer, rows)
        keep = selector.keep(layer, active, k, v, cache) if selector is not None else None
        written = active  # rows not written at this layer hold loaded (stale) chunk KV, or none
        if keep is None:
            cache.write(layer, active, k, v)
        else:
            if selector.check_layer_kv == "fresh":
                cache.write(layer, active, k, v)
            active, q, k, v = active[keep], q[:, keep], k[:, keep], v[:, keep]
            rows = rows.take(keep.nonzero().squeeze(1))
            if selector.check_layer_kv == "cached":
                cache.write(layer, active, k, v)
                written = active
        computed += active.numel()
        stale.set(layer, written)
        last = layer == depth - 1
        if mass is None or (layer < mass_from and not last):
            if last:  # past the last layer's KV only the last row is read (its logits)
                rows, q = rows.take(slice(-1, None)), q[:, -1:]
            rows.h = runner.finish(layer, rows, q, cache)
            continue
        # The watched rows' attention and the mass they put on each position, from one softmax.
        # At a watching pass's last layer only the mass is read: no attention output, no next rows.
        bias = cache.key_bias[layer]
        o, m = attend_with_mass(q[:, n_head:], cache.k[layer][:, :T], None if last else cache.v[layer][:, :T],
                                active[n_head:], runner.layers[layer].self_attn.scaling, runner.windows[layer],
                                None if bias is None else bias[:T])
        mass += m
        if last:
            continue
        if n_head:
            o = torch.cat([runner.attention(layer, head, q[:, :n_head], cache), o], dim=1)
        rows.h = runner.after_attention(layer, rows.h, o)
    return Pass(rows, active, computed, mass)


def candidates(attention: torch.Tensor, reused: torch.Tensor, must: torch.Tensor, n_keep: int,
               factor: float) -> torch.Tensor:
    """Positions the layers before the check compute: the must-compute rows and the `factor` x
    `n_keep` `reused` rows (those not among `must`) with the most attention from the probe, ascending."""
    reused_pos = reused.nonzero().squeeze(1)
    n = min(reused_pos.numel(), math.ceil(factor * n_keep))
    top = reused_pos[torch.topk(attention[reused_pos], n, sorted=False).indices]
    return torch.cat([must, top]).sort().values


@torch.inference_mode()
def prefill(runner: Runner, plan: Plan, mode: str, cfg: BlendConfig, extra_capacity: int = 0,
            prefetch_depth: int = 0) -> PrefillOutput:
    """`prefetch_depth` layers of stored KV are read ahead in a background thread (0: inline).
    A bad stored entry raises entry_format.BadEntry: the caller discards it and plans again."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {MODES}")
    T = plan.n_tokens
    dev = runner.device
    cache = runner.new_cache(T + extra_capacity)
    cache.length = T  # every layer loads or computes every row before its attention reads them
    loader = ChunkLoader(runner, plan, cache, prefetch_depth)
    P = plan.prefix_hit
    reused = plan.reused_mask().to(dev)
    stats = PrefillStats(prefix_hit_tokens=P, chunk_hits=plan.hits, chunk_misses=len(plan.misses),
                         chunk_tiers=[c.tier for c in plan.chunks])

    checks = dict(zip(cfg.check_layers, cfg.ratios)) if mode == "blend" else {}
    if all(r == 0 for r in checks.values()):
        checks = {}  # selecting nothing needs no check: blend at ratio 0 is reuse
    pos = torch.arange(T, device=dev)
    ids = plan.token_ids.to(dev)
    must = pos[P:][~reused[P:]]  # separators, missed chunks, the suffix
    computed, attention, probe_depth, probe_reads = 0, None, 0, ()
    stale = StaleBias(cfg.stale_key_scale if mode in ("reuse", "blend") else 1.0, reused, cache, runner.dtype)
    L = runner.n_layers
    if mode in ("full", "prefix") or not bool(reused.any()):
        chunk_layers, active = range(0), pos[P:]  # nothing reused: every row, every layer
    elif checks:
        active = pos[P:]
        chunk_layers = range(min(checks), L)  # fresh K for all rows up to the first check
        if cfg.weight_by_attention:
            # A reuse pass first, over the must-compute rows only (by default not the separators,
            # whose keys it hides): what its suffix rows attend to is what the question reads. It
            # loads the chunk KV of the layers it walks (compact copies, with compact_probe, which
            # the blend pass replaces by the full KV), and the blend pass overwrites every row the
            # probe computed.
            skip = torch.zeros_like(must, dtype=torch.bool)
            suffix = plan.segments.suffix[0]
            if suffix < T:  # a suffix left to watch
                if not cfg.probe_separators:
                    skip |= plan.separator_mask().to(dev)[must]
                if cfg.probe_suffix_tokens:  # the suffix's head: from T - probe_suffix_tokens on only
                    skip |= (must >= suffix) & (must < T - cfg.probe_suffix_tokens)
                if bool(skip.any()):
                    stale.hide(must[skip])
            probe_rows = must[~skip]
            watch = probe_rows >= min(suffix, T - 1)
            probe_depth = min(cfg.probe_layers or L, L)
            # With check candidates, the layers before the check read loaded KV for the other rows.
            blend_from = 0 if cfg.check_candidates else min(checks)
            if cfg.compact_probe:  # the probe reads compact copies first, the blend pass full KV after
                probe_reads, chunk_layers = range(probe_depth), range(blend_from, L)
            else:  # one read a layer: the probe's layers are loaded for the blend pass too
                chunk_layers = [*range(probe_depth), *range(max(probe_depth, blend_from), L)]
    else:
        chunk_layers, active = range(L), must  # reuse: only the must-compute rows
    t0 = time.perf_counter()
    loader.start(chunk_layers, probe_reads)
    try:
        if probe_depth:
            probe = run_layers(runner, cache, loader, runner.rows(ids[probe_rows], probe_rows), probe_rows, stale,
                               watch=watch, n_layers=probe_depth,
                               mass_from=min(round(cfg.probe_attention_from * L), probe_depth - 1))
            computed, attention = probe.computed, probe.attention
            stale.hide(None)
        selector = Selector(checks, cfg, reused, attention) if checks else None
        if attention is not None and cfg.check_candidates:
            active = candidates(attention, reused, must, cfg.budget(checks[min(checks)], selector.n_reused),
                                cfg.check_candidates)
            stale.exact_below = 1  # layer 0's loaded KV is exact for the rows not computed there
        stats.checked_positions = active.tolist()
        out = run_layers(runner, cache, loader, runner.rows(ids[active], active), active, stale, selector)
    finally:
        loader.close()
    active = out.active
    stats.load_wait_s, stats.compact_chunks = loader.wait_s, loader.compact_parts
    stats.copy_s, stats.copy_bytes = loader.copy_s, loader.copy_bytes
    stats.read_cpu_s, stats.read_bytes = loader.read_cpu_s, loader.read_bytes
    stats.compute_s = time.perf_counter() - t0 - loader.wait_s - loader.copy_s

    still_reused = reused.clone()
    still_reused[active] = False
    stats.reused_tokens = int(still_reused.sum())
    stats.recomputed_tokens = int(active.numel())
    stats.compute_frac = (computed + out.computed) / (runner.n_layers * T)
    stats.selected_positions = active[reused[active]].tolist()
    stats.recomputed_positions = active.tolist()
    return PrefillOutput(cache, runner.logits(out.rows.h[-1:])[0], stats)
