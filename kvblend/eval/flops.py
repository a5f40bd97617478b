"""What a prefill computed, in FLOPs over full prefill's: compute_frac counts every computed
(layer, row) alike, but a late row reads more keys than an early one, and the rows blend selects
sit late (the question reads nearby text). `blend_phases.py` bounds speed with it, and
`sweep_blend.py` compares variants at equal work with it."""

from __future__ import annotations

import torch

from ..engine.engine import Engine


def layer_flops(runner, layer: int, positions: torch.Tensor) -> float:
    """Matmul and attention FLOPs of rows at `positions` through one layer: projections and MLP
    per row, plus QK and PV over the keys each row reads (its own and earlier, within a window)."""
    per_row = 2 * sum(p.numel() for p in runner.layers[layer].parameters() if p.dim() == 2)
    keys = positions.float() + 1
    if runner.windows[layer] is not None:
        keys = keys.clamp(max=runner.windows[layer])
    return per_row * positions.numel() + 4 * runner.n_heads * runner.head_dim * float(keys.sum())


def work_frac(engine: Engine, n_tokens: int, mode: str, cfg, stats) -> float:
    """FLOPs a prefill computed over full prefill's, estimated from the rows each layer computed.
    compute_frac counts rows alike; late rows read more keys, so this is the tighter bound."""
    runner = engine.runner
    L, every = runner.n_layers, torch.arange(stats.prefix_hit_tokens, n_tokens)
    full = sum(layer_flops(runner, layer, every) for layer in range(L))
    if mode == "full":
        return 1.0
    kept = torch.tensor(stats.recomputed_positions)
    must = torch.tensor(sorted(set(stats.recomputed_positions) - set(stats.selected_positions)))
    if mode == "reuse" or cfg is None:
        return sum(layer_flops(runner, layer, must) for layer in range(L)) / full
    check = min(cfg.check_layers)
    # The probe as a reuse pass over every must-compute row: it skips the separators and the
    # suffix's head, so this overcounts it a little.
    probe = sum(layer_flops(runner, layer, must) for layer in range(min(cfg.probe_layers or L, L))) \
        if cfg.weight_by_attention else 0.0
    checked = torch.tensor(stats.checked_positions)  # every row, or the check candidates
    main = sum(layer_flops(runner, layer, checked if layer < check else kept) for layer in range(L))
    attn = runner.layers[check].self_attn  # the check layer projects every checked row before it selects
    qkv = 2 * sum(m.weight.numel() for m in (attn.q_proj, attn.k_proj, attn.v_proj)) * (checked.numel() - kept.numel())
    return (probe + main + qkv) / full
