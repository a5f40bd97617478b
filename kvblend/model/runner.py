"""The layerwise runner: drives a transformers Llama-family or Gemma 3 model one layer at a time.

It uses the model's own modules (norms, projections, q/k norms, MLP, rotary) and its own
attention, so that any subset of token rows can be computed at any layer against a KV cache that
holds every position. Masks come from positions (a query sees keys at positions <= its own),
never from row order: that is what lets blending recompute scattered rows exactly.

Gemma 3 differs in per-layer ways, each found once in Runner.__init__: sliding-window layers
(attention reads only the keys of the window) and full layers rotate with their own rotary; norms
wrap the attention output and the MLP ("sandwich" norms); the embedding module scales by
sqrt(hidden) itself; logits may be soft-capped.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from .adapter import ChunkAdapter
from .loader import LoadedModel
from .rotary import apply_rope, layer_rotary_keys, rotaries


# Attention reads keys in whole blocks of KEY_BLOCK positions (the CPU flash-attention kernel's own
# block; a call over fewer keys takes another path and rounds differently). With every call reading
# at least one whole block, and groups of queries ending on block boundaries (query_groups), a row's
# result no longer depends on which other rows share its call: prefix reuse and blend at ratio 1.0
# are bit-identical to full prefill, in bf16 too.
KEY_BLOCK = 512

# On the CPU the MLP of a long pass runs on row pieces of at most MLP_ROWS, so that its three
# [rows, intermediate] activations stay small: at the 1.9k candidate rows of an 8k-token blend on
# Qwen2.5-Coder-0.5B they were the process's memory peak (60 MiB over the rest). A 4k-token full
# prefill and blend took the same time either way. The products work row by row: each row's
# result is the same bit for bit.
MLP_ROWS = 512


FP16_MAX = torch.finfo(torch.float16).max


def narrowed(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in the cache's dtype (a no-op but where KV is held narrower). fp16 saturates: a key past
    its range would be inf and turn the attention that reads it into NaN."""
    if dtype == torch.float16 and t.dtype != torch.float16:
        t = t.clamp(-FP16_MAX, FP16_MAX)
    return t.to(dtype)


class KVCache:
    """K and V of one sequence for every layer, [L, Hkv, capacity, d]; slot index == position."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (n_layers, n_kv_heads, max(capacity, KEY_BLOCK), head_dim)
        # Uninitialised, but for the first block: attention always reads a whole block, and the
        # slots of it past `length` must hold finite values for their mask to cancel them.
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.k[:, :, :KEY_BLOCK].zero_()
        self.v[:, :, :KEY_BLOCK].zero_()
        # Positions [0, length) hold valid KV (a pass sets it first: each of its layers writes or
        # loads every such slot before attention reads it). Past it, only the zeroed first block
        # is ever read: empty() memory may hold NaN, which a mask cannot cancel.
        self.length = 0
        self.first = 0  # lowest valid position: a sequence may start at an offset (tests, probes)
        # Per layer, None or an additive logit bias [capacity] on the keys (0 where none): blending
        # damps the attention paid to stale chunk keys (BlendConfig.stale_key_scale). Decode reads
        # it too, since those keys stay stale.
        self.key_bias: list[torch.Tensor | None] = [None] * n_layers

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @property
    def readable(self) -> int:
        """Slots attention may read: the valid ones, and at least one whole key block."""
        return max(self.length, KEY_BLOCK)

    def reserve(self, capacity: int) -> None:
        """Grow to hold `capacity` positions (decode appends past the prompt)."""
        if capacity <= self.capacity:
            return
        grow = capacity - self.capacity
        pad = lambda t: torch.cat([t, t.new_empty(*t.shape[:2], grow, t.shape[3])], dim=2)  # noqa: E731
        self.k, self.v = pad(self.k), pad(self.v)
        grown = {}  # layers share one bias tensor: grow each once, keep them shared
        for i, b in enumerate(self.key_bias):
            if b is not None:
                if id(b) not in grown:
                    grown[id(b)] = torch.cat([b, b.new_zeros(grow)])
                self.key_bias[i] = grown[id(b)]

    def truncate(self, length: int) -> None:
        """Forget positions >= length (what an earlier decode appended), so that what is computed
        next reads exactly what it would have read right after the prefill."""
        self.length = min(self.length, length)

    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer][:, positions] = narrowed(k, self.k.dtype)
        self.v[layer][:, positions] = narrowed(v, self.v.dtype)

    def layer_kv(self, layer: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `layer` at positions [first, readable) in `dtype`: views where the cache holds
        that dtype, else widened copies, made at each attention call."""
        k, v = self.k[layer][:, self.first:self.readable], self.v[layer][:, self.first:self.readable]
        return k.to(dtype), v.to(dtype)


@dataclass
class Rows:
    """The token rows being computed: hidden states with their positions and rotary tables."""

    h: torch.Tensor  # [n, hidden]
    pos: torch.Tensor  # [n] absolute positions, ascending
    rope: dict  # rotary key (Runner.layer_rope) -> (cos, sin), each [n, d]
    # Attention query groups and masks per (cache first position, window): the same for every layer.
    groups: dict = field(default_factory=dict)

    def take(self, idx: torch.Tensor | slice) -> "Rows":
        return Rows(self.h[idx], self.pos[idx], {key: (c[idx], s[idx]) for key, (c, s) in self.rope.items()})


class Runner:
    def __init__(self, model: LoadedModel):
        self.model = model
        hf = model.hf
        cfg = hf.config
        self.cfg = cfg
        self.embed_tokens = hf.model.embed_tokens
        self.layers = hf.model.layers
        self.norm = hf.model.norm
        self.lm_head = hf.lm_head
        # Per layer, once: the rotary it uses, its window, whether norms wrap attention and MLP.
        self.rotaries = rotaries(hf)
        self.layer_rope = layer_rotary_keys(hf)
        self.rotary = self.rotaries[self.layer_rope[0]]  # layer 0's (the only one but for Gemma 3)
        self.sandwich = [hasattr(layer, "pre_feedforward_layernorm") for layer in self.layers]
        self.logit_softcap = getattr(cfg, "final_logit_softcapping", None)
        self.n_layers = cfg.num_hidden_layers
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.max_len = cfg.max_position_embeddings
        self.windows = [self._window(layer) for layer in self.layers]
        self.dtype, self.device = model.dtype, model.device
        self.kv_dtype = model.kv_dtype  # what caches hold (LoadedModel.kv_dtype)
        # A chunk adapter acts only inside `adapting` (chunk precompute): every other pass is the
        # model's own, with no extra operation at all.
        self.adapter: ChunkAdapter | None = None

    @contextmanager
    def adapting(self, adapter: ChunkAdapter | None):
        """Passes inside add the chunk adapter's deltas to the attention projections (None: none)."""
        saved, self.adapter = self.adapter, adapter
        try:
            yield
        finally:
            self.adapter = saved

    def _window(self, layer) -> int | None:
        attn = layer.self_attn
        if hasattr(attn, "sliding_window"):  # qwen2/qwen3: per layer
            return attn.sliding_window
        return getattr(self.cfg, "sliding_window", None) if self.cfg.model_type == "mistral" else None

    def new_cache(self, capacity: int) -> KVCache:
        return KVCache(self.n_layers, self.n_kv_heads, self.head_dim, capacity, self.kv_dtype, self.device)

    # ---- pieces of one layer -------------------------------------------------------------

    def rows(self, token_ids: torch.Tensor, positions: torch.Tensor) -> Rows:
        # Gemma 3's embedding module multiplies by sqrt(hidden) itself.
        rope = {key: rot.cos_sin(positions, self.dtype) for key, rot in self.rotaries.items()}
        return Rows(self.embed_tokens(token_ids), positions, rope)

    def shift_tables(self, delta: torch.Tensor, device: torch.device) -> dict:
        """Per rotary key, the rotation moving cached K by delta [n] positions (see Rotary.shift_table)."""
        return {key: rot.shift_table(delta, device) for key, rot in self.rotaries.items()}

    def rerotate(self, layer: int, k: torch.Tensor, tables: dict, out: torch.Tensor | None = None) -> torch.Tensor:
        """Cached K [Hkv, n, d] of `layer`, moved by its rotary's table from `shift_tables` (into `out`)."""
        key = self.layer_rope[layer]
        return self.rotaries[key].rerotate(k, table=tables[key], out=out)

    def qkv(self, layer: int, rows: Rows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [H, n, d], k and v [Hkv, n, d]; q and k rotated at the rows' positions."""
        attn = self.layers[layer].self_attn
        x = self.layers[layer].input_layernorm(rows.h)
        n = x.shape[0]
        q, k, v = project_qkv(attn, x)
        q = q.view(n, self.n_heads, self.head_dim)
        k = k.view(n, self.n_kv_heads, self.head_dim)
        v = v.view(n, self.n_kv_heads, self.head_dim)
        if self.adapter is not None:
            ad = self.adapter
            q = q + ad.delta(layer, "q", x).view(q.shape)
            k = k + ad.delta(layer, "k", x).view(k.shape)
            v = v + ad.delta(layer, "v", x).view(v.shape)
        if hasattr(attn, "q_norm"):  # qwen3, gemma3
            q, k = attn.q_norm(q), attn.k_norm(k)
        cos, sin = rows.rope[self.layer_rope[layer]]
        q = apply_rope(q.transpose(0, 1), cos, sin)
        k = apply_rope(k.transpose(0, 1), cos, sin)
        return q, k, v.transpose(0, 1)

    def finish(self, layer: int, rows: Rows, q: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Attention of q over the cache, o_proj, residual, MLP: the rows' next hidden states."""
        return self.after_attention(layer, rows.h, self.attention(layer, rows, q, cache))

    def attention(self, layer: int, rows: Rows, q: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Attention of q [H, n, d] over the cache: [H, n, d], before o_proj."""
        attn = self.layers[layer].self_attn
        first, window = cache.first, self.windows[layer]
        if (first, window) not in rows.groups:
            rows.groups[first, window] = query_groups(rows.pos - first, cache.readable - first, window)
        groups = rows.groups[first, window]
        bias = cache.key_bias[layer]
        if bias is not None:  # float masks carrying the bias, built once per bias tensor
            held = rows.groups.get((first, window, "bias"))
            if held is None or held[0] is not bias:
                held = rows.groups[first, window, "bias"] = (bias, biased_groups(groups, bias[first:]))
            groups = held[1]
        # attn.scaling is the model's own (Gemma 3: query_pre_attn_scalar ** -0.5).
        k, v = cache.layer_kv(layer, q.dtype)
        return attend(q, k, v, groups, attn.scaling)

    def after_attention(self, layer: int, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """o_proj of the attention output o [H, n, d], residual, MLP: the rows' next hidden states."""
        block = self.layers[layer]
        flat = o.transpose(0, 1).reshape(h.shape[0], -1)
        o = block.self_attn.o_proj(flat)
        if self.adapter is not None:
            o = o + self.adapter.delta(layer, "o", flat)
        if self.sandwich[layer]:  # gemma3: norms on the attention output and around the MLP
            h = h + block.post_attention_layernorm(o)
            return h + block.post_feedforward_layernorm(mlp(block.mlp, block.pre_feedforward_layernorm(h)))
        h = h + o
        return h + mlp(block.mlp, block.post_attention_layernorm(h))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.norm(h)).float()
        if self.logit_softcap:  # gemma 2/3 configs may cap logits: cap * tanh(logits / cap)
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits

    # ---- whole passes -----------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                logit_rows: torch.Tensor | slice | None = None) -> torch.Tensor:
        """Compute every layer for these tokens, writing their KV at their positions.

        Keys at other positions must already be in the cache. Returns logits of `logit_rows`
        (indices into the given tokens; default the last one): the last layer finishes only
        those rows, since the others are read only through the KV they wrote.
        """
        token_ids = token_ids.to(self.device)
        positions = positions.to(self.device)
        cache.reserve(int(positions.max()) + 1)
        if cache.length == 0:
            cache.first = int(positions.min())
        cache.length = max(cache.length, int(positions.max()) + 1)
        rows = self.rows(token_ids, positions)
        if logit_rows is None:
            logit_rows = slice(-1, None)
        last = self.n_layers - 1
        for layer in range(self.n_layers):
            q, k, v = self.qkv(layer, rows)
            cache.write(layer, positions, k, v)
            if layer == last:  # past the last layer's KV only the logit rows are ever read
                rows, q = rows.take(logit_rows), q[:, logit_rows]
            rows.h = self.finish(layer, rows, q, cache)
        return self.logits(rows.h)

    @torch.inference_mode()
    def decode(self, token_ids: list[int], positions: list[int], caches: list[KVCache]) -> torch.Tensor:
        """One decode step of several sequences: token i at positions[i] appended to caches[i].
        The rows share the projections and the MLP (one matmul for all); each attends its own
        cache. Returns logits [n, vocab].

        Rows are padded to a multiple of DECODE_ROW_BLOCK: the CPU fp32 matmul kernel works on
        blocks of 4 rows, and the rows of a partial block (the 1-3 left over) go another path
        that rounds differently, so a sequence's tokens would depend on how many others decode
        beside it. In whole blocks a row's result is the same at every batch size and thread count
        on an AVX2 EPYC; an AVX-512 Xeon's kernel still rounds a row's last bits differently with
        the batch size (for some shapes at any padding), so there tokens can differ only where
        the top two logits are that close.
        """
        n = len(token_ids)
        pad = -n % DECODE_ROW_BLOCK
        ids = torch.tensor(token_ids + token_ids[:1] * pad, device=self.device)
        pos = torch.tensor(positions + positions[:1] * pad, device=self.device)
        for p, cache in zip(positions, caches):
            cache.reserve(p + 1)
            cache.length = max(cache.length, p + 1)
        rows = self.rows(ids, pos)
        singles = [Rows(rows.h[i:i + 1], pos[i:i + 1], {}) for i in range(n)]  # masks per sequence
        for layer in range(self.n_layers):
            q, k, v = self.qkv(layer, rows)
            o = torch.zeros_like(q)  # padding rows attend to nothing: their outputs are dropped
            for i, (cache, single) in enumerate(zip(caches, singles)):
                cache.write(layer, pos[i:i + 1], k[:, i:i + 1], v[:, i:i + 1])
                o[:, i:i + 1] = self.attention(layer, single, q[:, i:i + 1], cache)
            rows.h = self.after_attention(layer, rows.h, o)
        return self.logits(rows.h[:n])


# See Runner.decode: decode batches come in whole blocks of this many rows (the matmul kernel's block).
DECODE_ROW_BLOCK = 4


def project_qkv(attn, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v [n, heads * d] of rows x: one fused product where the attention module offers one
    (a host engine's packed qkv projection, kvblend/vllm/model_view.py), else its three projections."""
    fused = getattr(attn, "qkv", None)
    if fused is not None:
        return fused(x)
    return attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)


def mlp(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """module(x) for rows x [n, hidden], in near-equal pieces of at most MLP_ROWS rows on the CPU."""
    if x.shape[0] <= MLP_ROWS or x.is_cuda:
        return module(x)
    return torch.cat([module(piece) for piece in x.tensor_split(-(-x.shape[0] // MLP_ROWS))])


@dataclass
class QueryGroup:
    rows: slice  # consecutive query rows
    end: int  # keys [start, end) are all they can see
    mask: torch.Tensor | None  # [n, end - start] bool, or None when the rows see every key (causal / decode)
    causal: bool = False  # the rows are the last n positions of [start, end): the causal kernel, no mask
    start: int = 0  # > 0 only in sliding-window layers: the keys before it are out of every row's window


# What one attention call costs per key it reads, counted in query rows: the kernel's fixed work
# per key block (loading, converting) is about that of 8 rows' dot products on this CPU kernel.
CALL_COST_ROWS = 8


def query_groups(q_pos: torch.Tensor, n_keys: int, window: int | None = None) -> list[QueryGroup]:
    """How queries at ascending positions q_pos (slot == position) attend over the readable keys
    [0, n_keys): query i sees keys at positions <= q_pos[i] (and > q_pos[i] - window).

    Scattered queries are split into runs of key blocks; each run attends over keys up to the end
    of its last block only, so masked rows pay for little more than the causal triangle, while a
    few rows spread over a long prompt (separators, a suffix) share one call. In sliding-window
    layers a run also starts at the key block holding its first row's window start: it reads the
    window, not the whole cache. On CUDA every row goes in one call (one_call_group). Built once
    per pass: every layer reuses the masks.
    """
    n = q_pos.shape[0]
    last, first = int(q_pos[-1]), int(q_pos[0])
    if last + 1 == n_keys:
        if window is None and first == 0 and n == n_keys:  # a fresh prefill: the plain causal kernel
            return [QueryGroup(slice(0, n), n, None, causal=True)]
        if n == 1:  # decode: the one query sees every key (of its window)
            return [QueryGroup(slice(0, 1), n_keys, None, start=max(0, n_keys - (window or n_keys)))]
    if groups_in_one_call(q_pos):
        return [one_call_group(q_pos, window)]
    groups = []
    for a, b in _block_runs(q_pos, n_keys, window):
        qp = q_pos[a:b]
        start = _window_start(int(qp[0]), window)
        end = min((int(qp[-1]) // KEY_BLOCK + 1) * KEY_BLOCK, n_keys)
        groups.append(QueryGroup(slice(a, b), end, _mask(qp, start, end, window), start=start))
    return groups


def groups_in_one_call(q_pos: torch.Tensor) -> bool:
    """Whether these queries take one_call_group rather than the CPU's calls over key blocks."""
    return q_pos.is_cuda


def one_call_group(q_pos: torch.Tensor, window: int | None = None) -> QueryGroup:
    """Every query row in one attention call, over the keys up to the last row's. On a GPU a
    kernel launch costs more than the masked keys a dense [n, T] mask makes it read: at 8k tokens
    and 15% of the rows, one call took 1.0 ms against the CPU's block groups' 1.7 ms on an H200
    (benchmarks/gpu_bench.py). The prompt's last n rows (prefix reuse) take the causal kernel,
    aligned to the lower right, and no mask at all."""
    n, first, last = q_pos.shape[0], int(q_pos[0]), int(q_pos[-1])
    if window is None and last - first + 1 == n:
        return QueryGroup(slice(0, n), last + 1, None, causal=True)
    start = _window_start(first, window)
    return QueryGroup(slice(0, n), last + 1, _mask(q_pos, start, last + 1, window), start=start)


def _mask(q_pos: torch.Tensor, start: int, end: int, window: int | None) -> torch.Tensor:
    """[n, end - start] bool: the keys each query sees (its own position and before, in its window)."""
    key_pos = torch.arange(start, end, device=q_pos.device)
    mask = key_pos[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= key_pos[None, :] > q_pos[:, None] - window
    return mask


def _window_start(pos: int, window: int | None) -> int:
    """First key a call with its first query at `pos` reads: the key block holding the window start."""
    return 0 if window is None else max(0, pos - window + 1) // KEY_BLOCK * KEY_BLOCK


def _block_runs(q_pos: torch.Tensor, n_keys: int, window: int | None = None) -> list[tuple[int, int]]:
    """Row ranges [a, b) of the cheapest split into calls: a call over the key blocks from its
    first row's window start to its last row's costs (its keys) x (CALL_COST_ROWS + its rows).
    Exact over block runs (O(blocks^2))."""
    block = torch.div(q_pos, KEY_BLOCK, rounding_mode="floor")
    starts = [0, *(torch.nonzero(block[1:] != block[:-1]).squeeze(1) + 1).tolist()]
    bounds = starts + [q_pos.shape[0]]
    ends = [min((int(block[a]) + 1) * KEY_BLOCK, n_keys) for a in starts]
    key_starts = [_window_start(int(q_pos[a]), window) for a in starts]
    best = [0.0] + [float("inf")] * len(starts)  # best[j]: cheapest split of the first j blocks
    cut = [0] * (len(starts) + 1)
    for j in range(1, len(starts) + 1):
        for i in range(j):
            keys = ends[j - 1] - key_starts[i]
            cost = best[i] + keys * (CALL_COST_ROWS + bounds[j] - bounds[i])
            if cost < best[j]:
                best[j], cut[j] = cost, i
    runs, j = [], len(starts)
    while j:
        runs.append((bounds[cut[j]], bounds[j]))
        j = cut[j]
    return runs[::-1]


def biased_groups(groups: list[QueryGroup], bias: torch.Tensor) -> list[QueryGroup]:
    """The same groups with float masks: `bias` [keys] added to the logits of the keys a row sees."""
    out = []
    for g in groups:
        keys = bias[g.start:g.end]
        if g.mask is not None:
            mask = torch.where(g.mask, keys, float("-inf"))
        elif g.causal:  # row i of n sees the keys up to T - n + i
            n, T = g.rows.stop - g.rows.start, g.end - g.start
            above = torch.ones(n, T, dtype=torch.bool, device=keys.device).triu(T - n + 1)
            mask = keys.expand(n, -1).masked_fill(above, float("-inf"))
        else:  # decode: the one row sees every key of [start, end)
            mask = keys[None]
        out.append(QueryGroup(g.rows, g.end, mask, start=g.start))
    return out


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: list[QueryGroup], scale: float) -> torch.Tensor:
    """Attention of queries q [H, n, d] over keys/values [Hkv, T, d] (slot == position), by the
    `query_groups` of the queries' positions (or their `biased_groups`)."""
    if q.shape[1] == 1:
        # Decode: the kernel's one-row path is slow (bf16: 7x); the query heads that share a key
        # head, taken as rows of one call, go through its multi-row path instead. A sequence under
        # one key block reads the whole block, its unwritten keys masked: the mask, made additive,
        # applies to every folded row alike.
        g = groups[0]
        mask = g.mask
        if mask is not None:
            if mask.dtype == torch.bool:  # additive, as biased_groups' masks are
                mask = torch.where(mask, 0.0, float("-inf"))
            mask = mask.to(q.dtype)[None, None]
        o = F.scaled_dot_product_attention(q.view(k.shape[0], -1, q.shape[2])[None], k[None, :, g.start:g.end],
                                           v[None, :, g.start:g.end], attn_mask=mask, scale=scale)[0]
        return o.reshape(q.shape)  # CUDA kernels may return it strided
    out = []
    for g in groups:
        mask = None if g.mask is None else g.mask[None, None]
        if mask is not None and mask.dtype != torch.bool:
            mask = mask.to(q.dtype)
        n, keys = g.rows.stop - g.rows.start, g.end - g.start
        if g.causal and n < keys:  # the last rows of a longer sequence: causal from the lower right
            mask = causal_lower_right(n, keys)
        out.append(F.scaled_dot_product_attention(
            q[None, :, g.rows], k[None, :, g.start:g.end], v[None, :, g.start:g.end], attn_mask=mask,
            is_causal=g.causal and n == keys, scale=scale, enable_gqa=True)[0])
    return out[0] if len(out) == 1 else torch.cat(out, dim=1)
