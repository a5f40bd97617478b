"""Stale keys moved by the shift their chunk's recomputed rows measure (blend/key_shift.py)."""

from dataclasses import replace

import pytest
import torch
from test_blend_invariants import assert_exact_ends, make_engine, prefill
from tiny_models import FAMILIES

from kvblend.blend.key_shift import StaleKeyShift, spread_rows
from kvblend.config import Settings
from kvblend.model.rotary import apply_rope


def rotated(runner, layer, k0, positions):
    cos, sin = runner.rotaries[runner.layer_rope[layer]].cos_sin(positions, torch.float32)
    return apply_rope(k0, cos.float(), sin.float())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_shared_offset_in_the_stored_keys_is_taken_out(family):
    """Stored keys off by one vector per chunk and head (before the rotation): the recomputed
    rows measure it and the stale rows lose it, at their own positions, whatever the rotary."""
    engine = make_engine(family, dtype="float32")
    runner = engine.runner
    H, d, T, layer = runner.n_kv_heads, runner.head_dim, 40, runner.n_layers - 1
    chunk_of = torch.tensor([-1] * 4 + [0] * 18 + [-1] * 2 + [1] * 16)
    exact = torch.randn(H, T, d)
    offset = torch.randn(H, 2, d)[:, chunk_of.clamp(min=0)] * (chunk_of >= 0)[None, :, None]
    stored = rotated(runner, layer, exact + offset, torch.arange(T))
    cache = runner.new_cache(T)
    cache.k[layer][:, :T] = stored
    computed = torch.tensor([0, 1, 2, 3, 5, 9, 22, 23, 30])  # rows outside chunks measure nothing
    stale = torch.tensor([p for p in range(T) if chunk_of[p] >= 0 and p not in computed.tolist()])
    fresh = rotated(runner, layer, exact[:, computed], computed)
    StaleKeyShift(runner, 1.0, chunk_of).apply(layer, cache, computed, fresh, stale)
    torch.testing.assert_close(cache.k[layer][:, stale], rotated(runner, layer, exact[:, stale], stale),
                               atol=1e-5, rtol=1e-5)
    untouched = torch.tensor([p for p in range(T) if p not in stale.tolist()])
    assert torch.equal(cache.k[layer][:, untouched], stored[:, untouched])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_shift_keeps_the_exact_ends_and_acts_between(family):
    """Every row recomputed: no stale key, blend still equals full. Ratio 0: no check, reuse. In
    between it selects the same rows and moves keys only after the check."""
    engine = make_engine(family, stale_key_shift=1.0)
    ids, _, _ = assert_exact_ends(engine)
    _, shifted = prefill(engine, ids, "blend", ratios=[0.3])
    _, plain = prefill(engine, ids, "blend", ratios=[0.3], stale_key_shift=0.0)
    assert shifted.stats.recomputed_positions == plain.stats.recomputed_positions
    T, check = len(ids), max(engine.blend_cfg.check_layers)
    assert torch.equal(shifted.cache.k[: check + 1, :, :T], plain.cache.k[: check + 1, :, :T])  # none before it
    assert not torch.equal(shifted.cache.k[check + 1:, :, :T], plain.cache.k[check + 1:, :, :T])


def test_spread_rows_takes_evenly_spaced_rows_of_each_chunk():
    chunk_of = torch.tensor([-1] * 3 + [0] * 9 + [-1] + [1] * 2 + [2] * 5)
    assert spread_rows(chunk_of, 3).tolist() == [3, 7, 11, 13, 14, 15, 17, 19]  # a 2-row chunk: both
    assert spread_rows(torch.full((5,), -1), 3).numel() == 0


def test_only_the_spread_rows_measure_when_asked():
    """A computed row outside `measure` leaves the shift as the measuring rows give it."""
    engine = make_engine(dtype="float32")
    runner = engine.runner
    H, d, T, layer = runner.n_kv_heads, runner.head_dim, 12, 1
    chunk_of = torch.tensor([-1] * 2 + [0] * 10)
    exact = torch.randn(H, T, d)
    offset = torch.randn(H, 1, d) * (chunk_of >= 0)[None, :, None]
    stored = rotated(runner, layer, exact + offset, torch.arange(T))
    computed, stale = torch.tensor([2, 6, 11]), torch.tensor([3, 4, 5, 7, 8, 9, 10])
    fresh = rotated(runner, layer, exact[:, computed], computed)
    fresh[:, 1] += 5.0  # row 6 computed far off: it must not count
    measure = torch.zeros(T, dtype=torch.bool)
    measure[[2, 11]] = True
    cache = runner.new_cache(T)
    cache.k[layer][:, :T] = stored
    StaleKeyShift(runner, 1.0, chunk_of, measure=measure).apply(layer, cache, computed, fresh, stale)
    torch.testing.assert_close(cache.k[layer][:, stale], rotated(runner, layer, exact[:, stale], stale),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_shift_rows_are_computed_beside_the_budget(family):
    """The spread rows go on past the check with the rows the budget selects, which stay the same
    count; at ratio 1.0 blend still equals full."""
    engine = make_engine(family, stale_key_shift=1.0, shift_rows=3)
    ids, _, _ = assert_exact_ends(engine)
    plan, out = prefill(engine, ids, "blend", ratios=[0.15])
    _, plain = prefill(engine, ids, "blend", ratios=[0.15], shift_rows=0)
    spread = set(spread_rows(plan.chunk_index(), 3).tolist())
    assert len(spread) >= 3 and spread <= set(out.stats.recomputed_positions)
    chosen = set(out.stats.selected_positions) - spread
    assert len(chosen) == len(plain.stats.selected_positions)


def test_a_shift_out_of_range_is_rejected():
    with pytest.raises(ValueError, match="stale_key_shift"):
        Settings(stale_key_shift=-0.5)
    with pytest.raises(ValueError, match="stale_key_shift"):
        replace(make_engine().blend_cfg, stale_key_shift=2.0)
    with pytest.raises(ValueError, match="shift_rows"):
        Settings(shift_rows=-1)
