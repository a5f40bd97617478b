"""The student: a training prompt's answer logits when its chunks' KV is made with the adapter and
read as blend reads it, computed with autograd from the loss back to the adapter.

The engine's own passes write into one preallocated cache in place, which autograd cannot follow;
this is the same arithmetic written out of place, with dense position masks. It mirrors how a
prompt is served: the prefix and the prompt's first chunk exact (no adapter), every other chunk
encoded after the prefix and its neighbour lead with the adapter and moved to its place, the
separators, the suffix and the rows blend chose recomputed by the model alone, attention to the stale chunk keys damped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..model.adapter import ChunkAdapter
from ..model.rotary import apply_rope
from ..model.runner import Rows, Runner


@dataclass
class ExactKV:
    """K, V per layer ([Hkv, n, d], no grad) of the rows [0, n), computed by the model alone."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]

    @property
    def n(self) -> int:
        return self.k[0].shape[1]


@torch.no_grad()
def exact_kv(runner: Runner, ids: list[int]) -> ExactKV:
    """Full prefill's K and V of `ids` at positions [0, len)."""
    cache = runner.new_cache(len(ids))
    runner.forward(torch.tensor(ids), torch.arange(len(ids)), cache)
    return ExactKV([cache.k[i, :, :len(ids)].clone() for i in range(runner.n_layers)],
                   [cache.v[i, :, :len(ids)].clone() for i in range(runner.n_layers)])


def _mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None,
          same: torch.Tensor | None = None) -> torch.Tensor:
    """[nq, nk] bool: a query sees keys at its own position and before (in its window; and, with
    `same` [nq, nk], only where it is True)."""
    m = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        m &= k_pos[None, :] > q_pos[:, None] - window
    return m if same is None else m & same


def _attend(runner: Runner, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            mask: torch.Tensor) -> torch.Tensor:
    """q [H, n, d] over k, v [Hkv, T, d] with a [n, T] bool or float mask: [H, n, d]."""
    if mask.dtype != torch.bool:
        mask = mask.to(q.dtype)
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask[None, None],
                                          scale=runner.layers[layer].self_attn.scaling, enable_gqa=True)[0]


def encode(runner: Runner, adapter: ChunkAdapter | None, context: ExactKV, chunks: list[list[int]],
           leads: list[list[int]] | None = None,
           low_memory: bool = False,
           grad: set[int] | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Every chunk's K, V per layer ([Hkv, N, d] over the chunks' rows, concatenated) and the
    positions they were computed at: each chunk right after the context and its lead (its
    neighbours with separators, or nothing), alone with them, as encode_chunks does; the adapter
    acts on the lead's and the chunk's rows. With `low_memory`, a chunk's activations are not kept
    for the backward but computed again there, one chunk at a time: a 6k-token prompt's would
    hold some 20 GB, its K and V alone a few hundred MB. `grad` names the chunks (indices) whose
    KV the backward reaches (default: all); the others are computed without autograd, which costs
    them no backward at all and leaves the forward, the loss, unchanged."""
    leads = leads or [[] for _ in chunks]
    one = partial(checkpoint, _encode_one, use_reentrant=False) if low_memory and torch.is_grad_enabled() \
        else _encode_one
    per_chunk = []
    for i, (lead, c) in enumerate(zip(leads, chunks)):
        if grad is None or i in grad:
            per_chunk.append(one(runner, adapter, context, lead, c))
        else:
            with torch.no_grad():
                per_chunk.append(_encode_one(runner, adapter, context, lead, c))
    ks = [torch.cat([k[layer] for k, _, _ in per_chunk], 1) for layer in range(runner.n_layers)]
    vs = [torch.cat([v[layer] for _, v, _ in per_chunk], 1) for layer in range(runner.n_layers)]
    return ks, vs, torch.cat([p for _, _, p in per_chunk])


def _encode_one(runner: Runner, adapter: ChunkAdapter | None, context: ExactKV, lead: list[int],
                chunk: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """One chunk after the context and its lead: the chunk rows' K, V per layer and positions.
    Chunks are encoded one at a time: their attention stays [len, context + len], where one
    block-diagonal pass over all of them would hold [N, N] per layer for the backward."""
    C, L, dev = context.n, len(lead), runner.device
    pos = torch.arange(C, C + L + len(chunk), device=dev)
    ks, vs = encode_rows(runner, adapter, context, runner.rows(torch.tensor(lead + chunk, device=dev), pos), L)
    return ks, vs, pos[L:]


def encode_rows(runner: Runner, adapter: ChunkAdapter | None, context: ExactKV, rows: Rows,
                skip: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """`rows` (positions right after the context) through every layer over the context and
    themselves, with the adapter: K, V per layer of all but their first `skip` rows."""
    k_pos = torch.cat([torch.arange(context.n, device=runner.device), rows.pos])  # the context's, then the rows'
    ks, vs = [], []
    with runner.adapting(adapter):
        for layer in range(runner.n_layers):
            q, k, v = runner.qkv(layer, rows)
            ks.append(k[:, skip:])
            vs.append(v[:, skip:])
            if layer == runner.n_layers - 1:
                break  # past the last layer's KV nothing of the chunk is read
            mask = _mask(rows.pos, k_pos, runner.windows[layer])
            keys, values = torch.cat([context.k[layer], k], 1), torch.cat([context.v[layer], v], 1)
            rows.h = runner.after_attention(layer, rows.h, _attend(runner, layer, q, keys, values, mask))
    return ks, vs


def move(runner: Runner, layer: int, k: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """K [Hkv, n, d] of `layer` rotated by delta [n] positions, in fp32 as the engine's loader does."""
    cos, sin = runner.rotaries[runner.layer_rope[layer]].shift_table(delta, k.device)
    return apply_rope(k.float(), cos, sin).to(k.dtype)


def read(runner: Runner, exact: ExactKV, stale_k: list[torch.Tensor], stale_v: list[torch.Tensor],
         stale_pos: torch.Tensor, ids: list[int], pos: torch.Tensor, n_logits: int, stale_scale: float,
         damp_from: int = 1) -> torch.Tensor:
    """The model alone computing rows `ids` at positions `pos` (ascending) through every layer,
    over the exact rows, the stale chunk rows (K already moved to `stale_pos`) and themselves.
    Attention to stale keys is damped by `stale_scale` from layer `damp_from` on (the engine's
    blend: layer 0's stored KV counts as exact). Returns the logits of the last `n_logits` rows."""
    dev = runner.device
    ids_t = torch.tensor(ids, device=dev)
    rows = runner.rows(ids_t, pos)
    k_pos = torch.cat([torch.arange(exact.n, device=dev), stale_pos, pos])
    stale = torch.zeros(k_pos.shape[0], dtype=torch.bool, device=dev)
    stale[exact.n:exact.n + stale_pos.shape[0]] = True
    log_scale = math.log(stale_scale)
    bias = torch.where(stale, log_scale, 0.0)[None, :]  # the same at every damped layer
    for layer in range(runner.n_layers):
        q, k, v = runner.qkv(layer, rows)
        if layer == runner.n_layers - 1:
            rows, q = rows.take(slice(-n_logits, None)), q[:, -n_logits:]
        seen = _mask(rows.pos, k_pos, runner.windows[layer])
        if layer >= damp_from and log_scale != 0:
            mask = torch.where(seen, bias, float("-inf"))
        else:
            mask = seen
        K = torch.cat([exact.k[layer], stale_k[layer], k], 1)
        V = torch.cat([exact.v[layer], stale_v[layer], v], 1)
        rows.h = runner.after_attention(layer, rows.h, _attend(runner, layer, q, K, V, mask))
    return runner.logits(rows.h)


def topk_kl(teacher_logp: torch.Tensor, teacher_idx: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) per position, with the teacher kept as its top-k log-probs
    ([n, K] values and vocabulary ids) and the rest of its mass as one tail bucket."""
    logq = F.log_softmax(student_logits.float(), -1)
    q_top = logq.gather(1, teacher_idx)
    p = teacher_logp.exp()
    kl = (p * (teacher_logp - q_top)).sum(1)
    p_tail = (1 - p.sum(1)).clamp_min(1e-9)
    q_tail = (1 - q_top.exp().sum(1)).clamp_min(1e-9)
    return kl + p_tail * (p_tail.log() - q_tail.log())
