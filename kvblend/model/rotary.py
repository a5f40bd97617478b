"""Rotary position embedding from the model's own rotary module, and K re-rotation.

Cached K is stored already rotated at the positions it was computed at. Moving it to new
positions is one more rotation by the position difference: R(q - p) rope_p(k) == rope_q(k),
true for every RoPE whose frequencies do not depend on the sequence length. `check_rerotation`
verifies that with the model's own module before blending is allowed.
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
    def __init__(self, hf_model: torch.nn.Module):
        self.module = hf_model.model.rotary_emb
        self.rope_type = getattr(self.module, "rope_type", "default")

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [n, d] at the given positions, from the model's module (scaling included)."""
        dummy = torch.empty(0, dtype=dtype, device=positions.device)
        cos, sin = self.module(dummy, positions[None])
        return cos[0], sin[0]

    def shift_table(self, delta: torch.Tensor, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos, sin [n, d] of a rotation by delta [n] positions (no attention scaling: it is
        already in cached K). Computed once per chunk and reused for every layer."""
        inv_freq = self.module.inv_freq.to(device=device or delta.device, dtype=torch.float32)
        freqs = delta.to(device=inv_freq.device, dtype=torch.float32)[:, None] * inv_freq[None]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def rerotate(self, k: torch.Tensor, delta: torch.Tensor | None = None,
                 table: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Rotate k [..., n, d] by delta [n] positions (or by a `shift_table`), in fp32."""
        cos, sin = table if table is not None else self.shift_table(delta, k.device)
        kf = k.float()
        return (kf * cos + rotate_half(kf) * sin).to(k.dtype)


def check_rerotation(hf_model: torch.nn.Module, max_positions: int) -> tuple[bool, str]:
    """Does R(d) rope(p) == rope(p + d) with this model's rotary module? (ok, reason)."""
    rot = Rotary(hf_model)
    if rot.rope_type in LENGTH_DEPENDENT_ROPE:
        return False, f"rotary type {rot.rope_type!r} changes its frequencies with sequence length"
    # A copy in fp32 on the CPU: the check must not disturb the serving module's state.
    module = copy.deepcopy(rot.module).float().cpu()
    probe = Rotary.__new__(Rotary)
    probe.module, probe.rope_type = module, rot.rope_type
    head_dim = module.inv_freq.shape[0] * 2
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
