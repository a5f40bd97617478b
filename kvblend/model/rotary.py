"""Rotary position embedding from the model's own rotary module, and K re-rotation.

Cached K is stored already rotated at the positions it was computed at. Moving it to new
positions is one more rotation by the position difference: R(q - p) rope_p(k) == rope_q(k),
true for every RoPE whose frequencies do not depend on the sequence length. `check_rerotation`
verifies that with the model's own module before blending is allowed.

Some models rotate each kind of layer differently (Gemma 3: a local base for sliding-window layers,
a global base, maybe scaled, for full-attention layers), from one module called with the layer
type. `rotaries` gives one `Rotary` per layer type; models with a single rotary have one, keyed None.
"""

from __future__ import annotations

import copy

import torch

# Frequencies that change with the sequence length: a cached rotation cannot be moved exactly.
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., n, d]; cos, sin [n, d] (broadcast over heads), same convention as transformers."""
    return x * cos + rotate_half(x) * sin


class Rotary:
    def __init__(self, module: torch.nn.Module, layer_type: str | None = None):
        self.module, self.layer_type = module, layer_type
        rope_type = getattr(module, "rope_type", "default")
        self.rope_type = rope_type[layer_type] if layer_type is not None else rope_type

    @property
    def inv_freq(self) -> torch.Tensor:
        return getattr(self.module, f"{self.layer_type}_inv_freq" if self.layer_type else "inv_freq")

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [n, d] at the given positions, from the model's module (scaling included)."""
        dummy = torch.empty(0, dtype=dtype, device=positions.device)
        extra = () if self.layer_type is None else (self.layer_type,)
        cos, sin = self.module(dummy, positions[None], *extra)
        return cos[0], sin[0]

    def shift_table(self, delta: torch.Tensor, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos, sin [n, d] of a rotation by delta [n] positions (no attention scaling: it is
        already in cached K). Computed once per chunk and reused for every layer."""
        inv_freq = self.inv_freq.to(device=device or delta.device, dtype=torch.float32)
        freqs = delta.to(device=inv_freq.device, dtype=torch.float32)[:, None] * inv_freq[None]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def rerotate(self, k: torch.Tensor, delta: torch.Tensor | None = None,
                 table: tuple[torch.Tensor, torch.Tensor] | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate k [..., n, d] by delta [n] positions (or by a `shift_table`), in fp32; into `out`
        (which must not overlap k) where given."""
        cos, sin = table if table is not None else self.shift_table(delta, k.device)
        # cos and sin repeat over the two halves (Rotary.shift_table): each half of the result is
        # two products, as apply_rope's x * cos + rotate_half(x) * sin gives it, bit for bit.
        half = k.shape[-1] // 2
        c, s = cos[..., :half], sin[..., :half]
        if out is not None and out.dtype == torch.float32 and k.dtype != torch.float32:
            k = k.float()  # K stored in bf16 for a float32 cache: converted once, rotated as fp32 below
        if out is None or k.dtype != torch.float32 or out.dtype != torch.float32:
            kf = k.float()
            k1, k2 = kf[..., :half], kf[..., half:]
            moved = out if out is not None else torch.empty_like(k)
            moved[..., :half] = k1 * c - k2 * s
            moved[..., half:] = k2 * c + k1 * s
            return moved
        # fp32 into a cache view: each half written once, no temporaries (loading is memory-bound).
        k1, k2, o1, o2 = k[..., :half], k[..., half:], out[..., :half], out[..., half:]
        torch.mul(k1, c, out=o1).addcmul_(k2, s, value=-1)
        torch.mul(k2, c, out=o2).addcmul_(k1, s)
        return out


def rotaries(hf_model: torch.nn.Module) -> dict[str | None, Rotary]:
    """One Rotary per layer type that has its own rotation (Gemma 3), else {None: the one}."""
    module = hf_model.model.rotary_emb
    if isinstance(getattr(module, "rope_type", None), dict):  # one module, called per layer type
        return {t: Rotary(module, t) for t in module.rope_type}
    return {None: Rotary(module)}


def layer_rotary_keys(hf_model: torch.nn.Module) -> list[str | None]:
    """Which of `rotaries` each layer uses."""
    keys = rotaries(hf_model)
    if None in keys:
        return [None] * hf_model.config.num_hidden_layers
    return list(hf_model.config.layer_types[: hf_model.config.num_hidden_layers])


def check_rerotation(hf_model: torch.nn.Module, max_positions: int) -> tuple[bool, str]:
    """Does R(d) rope(p) == rope(p + d) with each of this model's rotaries? (ok, reason)."""
    for rot in rotaries(hf_model).values():
        ok, why = _check_one(rot, max_positions)
        if not ok:
            return False, why if rot.layer_type is None else f"{rot.layer_type} layers: {why}"
    return True, "ok"


def _check_one(rot: Rotary, max_positions: int) -> tuple[bool, str]:
    if rot.rope_type in LENGTH_DEPENDENT_ROPE:
        return False, f"rotary type {rot.rope_type!r} changes its frequencies with sequence length"
    # A copy in fp32 on the CPU: the check must not disturb the serving module's state.
    probe = Rotary(copy.deepcopy(rot.module).float().cpu(), rot.layer_type)
    head_dim = probe.inv_freq.shape[0] * 2
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(2, 4, head_dim, generator=gen)
    top = max(2, max_positions - 1)
    for p, q in [(0, 3), (7, 0), (5, top // 3), (top // 2, top), (top, 1)]:
        pos_p, pos_q = torch.full((4,), p), torch.full((4,), q)
        cos_p, sin_p = probe.cos_sin(pos_p, torch.float32)
        cos_q, sin_q = probe.cos_sin(pos_q, torch.float32)
        moved = probe.rerotate(apply_rope(k, cos_p, sin_p), pos_q - pos_p)
        direct = apply_rope(k, cos_q, sin_q)
        # fp32 angles at positions in the thousands carry ~1e-3 rad of rounding on both sides;
        # a wrong rotation is off by O(1).
        if not torch.allclose(moved, direct, atol=2e-2, rtol=0):
            err = (moved - direct).abs().max().item()
            return False, f"re-rotating K from position {p} to {q} is off by {err:.2e} ({rot.rope_type!r} rotary)"
    return True, "ok"
