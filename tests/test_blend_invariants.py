"""CacheBlend invariants on tiny random models of every family (docs/architecture.md)."""

import math
import warnings
from dataclasses import replace

import pytest
import torch
from tiny_models import FAMILIES, tiny_model

from kvblend.blend.segment import join_segments
from kvblend.config import Settings
from kvblend.engine.engine import Engine
from kvblend.engine.sampler import SamplingParams
from kvblend.engine.scheduler import generate

SEP = [7, 7, 3]


def make_engine(family="llama", seed=0, **settings):
    # No minimum budget: on these ~100-token prompts the ratio alone sets it, as on long prompts.
    # float32 entries: these invariants compare stored KV with fresh computations exactly
    # (tests/test_store_half.py covers the bf16 entries a float32 model stores by default).
    m = tiny_model(family, seed=seed)
    return Engine(m, Settings(**{"check_layers": [1], "recompute_ratios": [0.15], "min_recompute_tokens": 0,
                                 "kv_half": False, **settings}), sep_ids=SEP)


def chunks(n, length=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 300, (length,), generator=g).tolist() for _ in range(n)]


PREFIX = [1, 20, 21, 22, 23, 24]
SUFFIX = [30, 31, 32, 33, 34]


def prompt(cs):
    return join_segments(PREFIX, cs, SUFFIX, SEP)


def separator_rows(ids, prefix_hit):
    """Positions of the separator tokens after the prefix hit: the must-compute rows the probe skips."""
    n = len(SEP)
    return [i + j for i in range(prefix_hit, len(ids) - n + 1) if ids[i:i + n] == SEP for j in range(n)]


def poison_fresh_caches(engine, rows):
    """The engine's new caches hold NaN at `rows` (a fresh cache is uninitialised memory)."""
    new_cache = engine.runner.new_cache

    def poisoned(capacity):
        cache = new_cache(capacity)
        cache.k[:, :, rows] = float("nan")
        cache.v[:, :, rows] = float("nan")
        return cache
    engine.runner.new_cache = poisoned


def assert_the_probe_skipped(engine, ids, rows, before, after, **cfg):
    """`after` (blend 0.2 with `cfg`) is `before` with `rows` left out of the probe."""
    # The probe walked every layer for every must-compute row but those; the blend pass still computes them.
    assert after.stats.compute_frac == pytest.approx(before.stats.compute_frac - len(rows) / len(ids))
    assert set(rows) <= set(after.stats.recomputed_positions)
    # The probe's -inf on their keys does not outlive it: decode reads them.
    assert all(b is None or bool(torch.isfinite(b).all()) for b in after.cache.key_bias)
    # The probe never reads what those rows' cache slots held before: NaN there changes nothing.
    poison_fresh_caches(engine, rows)
    _, dirty = prefill(engine, ids, "blend", ratios=[0.2], **cfg)
    assert torch.equal(dirty.logits, after.logits)


def prefill(engine, ids, mode, ratios=None, **cfg):
    bc = engine.blend_cfg
    if ratios is not None:
        cfg["ratios"] = ratios
    return engine.prefill(ids, mode, blend_cfg=replace(bc, **cfg))


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("context", ["bare", "prefix"])
def test_blend_at_ratio_one_equals_full_prefill(family, context):
    engine = make_engine(family, chunk_context=context)
    cs = chunks(4)
    engine.precompute(prompt(cs))
    ids = prompt([cs[2], cs[0], cs[3], cs[1]])  # chunks moved to new positions
    _, full = prefill(engine, ids, "full")
    plan, blend = prefill(engine, ids, "blend", ratios=[1.0])
    assert plan.hits == 4 and blend.stats.reused_tokens == 0
    torch.testing.assert_close(blend.logits, full.logits, atol=1e-4, rtol=1e-4)
    T = len(ids)
    torch.testing.assert_close(blend.cache.k[:, :, :T], full.cache.k[:, :, :T], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(blend.cache.v[:, :, :T], full.cache.v[:, :, :T], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_blend_at_ratio_zero_equals_reuse_and_differs_from_full(family):
    engine = make_engine(family)
    cs = chunks(3, seed=1)
    engine.precompute(prompt(cs))
    ids = prompt(cs[::-1])
    _, reuse = prefill(engine, ids, "reuse")
    _, blend0 = prefill(engine, ids, "blend", ratios=[0.0])
    _, full = prefill(engine, ids, "full")
    assert torch.equal(reuse.logits, blend0.logits)
    assert torch.equal(reuse.cache.k, blend0.cache.k)
    assert not torch.allclose(reuse.logits, full.logits, atol=1e-3)  # reuse really is approximate


@pytest.mark.parametrize("context", ["bare", "bos", "prefix"])
def test_reordered_prompt_hits_every_chunk(context):
    engine = make_engine(chunk_context=context)
    cs = chunks(4, seed=2)
    engine.precompute(prompt(cs))
    plan, out = prefill(engine, prompt([cs[3], cs[1], cs[0], cs[2]]), "blend")
    assert plan.hits == 4 and not plan.misses
    # The system prompt came exact, and the first chunk with it (exact_first_chunk).
    assert out.stats.prefix_hit_tokens == len(PREFIX) + len(SEP) + len(cs[3]) + len(SEP)


def test_prefix_context_key_depends_on_the_prefix():
    engine = make_engine(chunk_context="prefix")
    cs = chunks(2, seed=3)
    engine.precompute(prompt(cs))
    other = join_segments([1, 99, 98], cs, SUFFIX, SEP)
    plan = engine.plan(other, "blend")
    assert plan.hits == 0 and len(plan.misses) == 2


def test_miss_in_the_middle_is_computed_and_later_chunks_still_reused():
    engine = make_engine()
    a, b, c = chunks(3, seed=4)
    engine.precompute(prompt([a, c]))  # b never seen
    ids = prompt([a, b, c])
    plan, out = prefill(engine, ids, "blend", ratios=[0.0])
    assert [ch.tier for ch in plan.chunks] == ["prefix", "miss", "memory"]  # a: exact_first_chunk
    b_span, c_span = plan.chunks[1].span, plan.chunks[2].span
    recomputed = set(out.stats.recomputed_positions)
    assert set(range(*b_span)) <= recomputed  # the miss is computed in the request
    assert not set(range(*c_span)) & recomputed  # the chunk after it is reused
    assert out.stats.reused_tokens == len(c)
    # Generating stores the missed chunk, so the next request hits all three.
    generate(engine, ids, SamplingParams(max_tokens=2))
    assert engine.plan(ids, "blend").hits == 3


@pytest.mark.parametrize("ratio", [0.0, 0.1, 0.5])
def test_separators_and_suffix_always_recomputed(ratio):
    engine = make_engine()
    cs = chunks(3, seed=5)
    engine.precompute(prompt(cs))
    ids = prompt(cs)
    plan, out = prefill(engine, ids, "blend", ratios=[ratio])
    recomputed = set(out.stats.recomputed_positions)
    seg = plan.segments
    # Separators in the exact prefix hit (the system prompt's, the first chunk's) come exact.
    for span in [s for s in seg.separators if s[0] >= plan.prefix_hit] + [seg.suffix]:
        assert set(range(*span)) <= recomputed
    assert set(out.stats.selected_positions) <= set(plan.reused_mask().nonzero().squeeze(1).tolist())


@pytest.mark.parametrize("check_layers,ratios", [([1], [0.3]), ([1], [0.05]), ([0, 2], [0.5, 0.2]),
                                                 ([1, 2, 3], [0.6, 0.3, 0.1])])
@pytest.mark.parametrize("deviation", ["k", "v", "kv"])
@pytest.mark.parametrize("weight_by_attention", [True, False])
def test_number_of_selected_tokens_follows_ratios(check_layers, ratios, deviation, weight_by_attention):
    engine = make_engine()
    cs = chunks(4, length=25, seed=6)
    engine.precompute(prompt(cs))
    ids = prompt(cs[::-1])
    plan, out = prefill(engine, ids, "blend", ratios=ratios, check_layers=check_layers, deviation=deviation,
                        weight_by_attention=weight_by_attention)
    n_reused = int(plan.reused_mask().sum())
    assert len(out.stats.selected_positions) == round(ratios[-1] * n_reused)
    must = plan.n_tokens - plan.prefix_hit - n_reused
    assert out.stats.recomputed_tokens == must + round(ratios[-1] * n_reused)
    # Gradual filtering: rows computed per layer shrink at each check layer as the ratios say.
    # The attention probe is a reuse pass: the must-compute rows but the separators, every layer.
    probe = must - len(separator_rows(ids, plan.prefix_hit))
    per_layer = [probe] * engine.runner.n_layers if weight_by_attention else []
    # Before the first check: every row, or (with the probe) the check candidates.
    cand = min(n_reused, math.ceil(engine.blend_cfg.check_candidates * round(ratios[0] * n_reused)))
    active = must + (cand if weight_by_attention else n_reused)
    for layer in range(engine.runner.n_layers):
        if layer in check_layers:
            active = must + round(ratios[check_layers.index(layer)] * n_reused)
        per_layer.append(active)
    assert out.stats.compute_frac == pytest.approx(sum(per_layer) / (engine.runner.n_layers * plan.n_tokens))


@pytest.mark.parametrize("minimum", [0, 20, 10_000])
def test_a_minimum_recompute_budget_raises_a_small_ratios_count_and_caps_at_every_reused_row(minimum):
    engine = make_engine()
    cs = chunks(4, length=25, seed=6)
    engine.precompute(prompt(cs))
    ids = prompt(cs[::-1])
    plan, out = prefill(engine, ids, "blend", ratios=[0.05], min_recompute_tokens=minimum)
    n_reused = int(plan.reused_mask().sum())
    assert len(out.stats.selected_positions) == min(n_reused, max(round(0.05 * n_reused), minimum))
    if minimum >= n_reused:  # every reused row recomputed: full prefill's answer
        _, full = prefill(engine, ids, "full")
        torch.testing.assert_close(out.logits, full.logits, rtol=1e-4, atol=1e-4)


def test_a_minimum_below_the_ratios_budget_changes_nothing():
    engine = make_engine()
    cs = chunks(4, length=25, seed=6)
    engine.precompute(prompt(cs))
    ids = prompt(cs[::-1])
    _, plain = prefill(engine, ids, "blend", ratios=[0.5])
    _, floored = prefill(engine, ids, "blend", ratios=[0.5], min_recompute_tokens=5)
    assert floored.stats.selected_positions == plain.stats.selected_positions
    assert torch.equal(floored.logits, plain.logits)
    with pytest.raises(ValueError, match="min_recompute_tokens"):
        replace(engine.blend_cfg, min_recompute_tokens=-1)


def test_selection_picks_the_most_deviating_tokens():
    """Selected rows are the top deviations: raising a chunk's deviation gets it selected."""
    engine = make_engine(deviation="v", chunk_context="bare", weight_by_attention=False)
    cs = chunks(3, seed=7)
    engine.precompute(prompt(cs))
    ids = prompt(cs)
    key = engine.keys.chunk_key(cs[1], [])
    kv = engine.store.get(key)
    v = kv.v.clone()
    v[1] += 50.0  # layer 1 (the check layer) V of chunk 1 far from fresh: maximal deviation
    kv.v = v
    reused = int(engine.plan(ids, "blend").reused_mask().sum())  # chunks 1 and 2: chunk 0 comes exact
    plan, out = prefill(engine, ids, "blend", ratios=[len(cs[1]) / reused])
    assert set(out.stats.selected_positions) == set(range(*plan.chunks[1].span))


def test_failed_rerotation_gate_serves_full_with_a_warning():
    m = tiny_model("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    with pytest.warns(RuntimeWarning, match="full prefill"):
        engine = Engine(m, Settings(), sep_ids=SEP)
    assert engine.effective_mode("blend") == "full" and engine.effective_mode("reuse") == "full"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert make_engine().effective_mode("blend") == "blend"


def test_prefix_mode_reuses_exact_prefix_and_matches_full():
    engine = make_engine()
    cs = chunks(3, seed=8)
    ids = prompt(cs)
    generate(engine, ids, SamplingParams(max_tokens=1), mode="prefix")  # stores every exact block
    plan, out = prefill(engine, ids, "prefix")
    assert plan.prefix_hit == len(ids) - 1
    _, full = prefill(engine, ids, "full")
    torch.testing.assert_close(out.logits, full.logits, atol=1e-4, rtol=1e-4)
    reordered = prompt([cs[1], cs[0], cs[2]])
    assert engine.plan(reordered, "prefix").prefix_hit == len(PREFIX) + len(SEP)  # order breaks the prefix


def assert_exact_ends(engine):
    """Blend with every row recomputed equals full prefill; at ratio 0 it equals reuse. On three
    chunks reversed; returns the prompt, blend at ratio 1 and reuse."""
    cs = chunks(3, seed=4)
    engine.precompute(prompt(cs))
    ids = prompt(cs[::-1])
    _, full = prefill(engine, ids, "full")
    _, blend1 = prefill(engine, ids, "blend", ratios=[1.0])
    torch.testing.assert_close(blend1.logits, full.logits, atol=1e-4, rtol=1e-4)
    _, reuse = prefill(engine, ids, "reuse")
    _, blend0 = prefill(engine, ids, "blend", ratios=[0.0])
    assert torch.equal(reuse.logits, blend0.logits)
    return ids, blend1, reuse


@pytest.mark.parametrize("family", list(FAMILIES))
def test_stale_key_scale_keeps_the_exact_ends(family):
    """Damping stale keys touches only stale keys: with every row recomputed blend still equals
    full prefill, and at ratio 0 it still equals reuse with the same damping."""
    engine = make_engine(family, stale_key_scale=0.5)
    ids, blend1, reuse = assert_exact_ends(engine)
    assert all(b is None for b in blend1.cache.key_bias)
    _, exact = prefill(engine, ids, "reuse", stale_key_scale=1.0)
    assert not torch.allclose(reuse.logits, exact.logits, atol=1e-4)  # the damping acts


def test_stale_key_bias_marks_exactly_the_stale_rows():
    engine = make_engine(stale_key_scale=0.25)
    cs = chunks(3, seed=5)
    engine.precompute(prompt(cs))
    ids = prompt(cs[::-1])
    plan, out = prefill(engine, ids, "blend", ratios=[0.3])
    T = len(ids)
    stale = plan.reused_mask().clone()
    stale[out.stats.recomputed_positions] = False
    unchecked = plan.reused_mask().clone()  # reused rows outside the check candidates
    unchecked[out.stats.checked_positions] = False
    assert unchecked.any() and (stale & ~unchecked).any()
    check = engine.blend_cfg.check_layers[0]
    for layer, bias in enumerate(out.cache.key_bias):
        if layer < check:  # layer 0's loaded KV is exact: nothing there is stale
            assert bias is None
        else:  # at the check layer every candidate keeps its fresh KV; after it, only the kept rows
            rows = unchecked if layer == check else stale
            assert torch.equal(bias[:T] != 0, rows) and torch.allclose(bias[:T][rows], torch.tensor(math.log(0.25)))
    # decode reads the same bias: the next token's logits change without it
    step = lambda: engine.runner.forward(torch.tensor([40]), torch.tensor([T]), out.cache)  # noqa: E731
    damped = step()
    out.cache.key_bias = [None] * engine.runner.n_layers
    assert not torch.allclose(damped, step(), atol=1e-4)


def test_stale_key_scale_out_of_range_is_rejected():
    with pytest.raises(ValueError, match="stale_key_scale"):
        Settings(stale_key_scale=0)
    with pytest.raises(ValueError, match="stale_key_scale"):
        replace(make_engine().blend_cfg, stale_key_scale=1.5)


def test_growing_the_cache_grows_its_key_bias_and_keeps_it_shared():
    from kvblend.model.runner import KVCache

    cache = KVCache(3, 2, 4, 600, torch.float32, torch.device("cpu"))
    bias = torch.zeros(600)
    bias[5] = -1.0
    cache.key_bias = [None, bias, bias]
    cache.reserve(700)
    assert cache.key_bias[0] is None and cache.key_bias[1] is cache.key_bias[2]
    assert cache.key_bias[1].shape[0] == cache.capacity == 700 and cache.key_bias[1][5] == -1.0
    assert not cache.key_bias[1][600:].any()


def test_a_shallower_probe_keeps_the_exact_ends_and_costs_less():
    engine = make_engine()
    cs = chunks(3, seed=6)
    engine.precompute(prompt(cs))
    ids = prompt(cs[::-1])
    L = engine.runner.n_layers
    _, full = prefill(engine, ids, "full")
    _, blend1 = prefill(engine, ids, "blend", ratios=[1.0], probe_layers=1)
    torch.testing.assert_close(blend1.logits, full.logits, atol=1e-4, rtol=1e-4)
    _, deep = prefill(engine, ids, "blend", ratios=[0.3])
    _, all_layers = prefill(engine, ids, "blend", ratios=[0.3], probe_layers=L)
    _, shallow = prefill(engine, ids, "blend", ratios=[0.3], probe_layers=2)
    assert torch.equal(deep.logits, all_layers.logits)
    assert shallow.stats.compute_frac < deep.stats.compute_frac
    with pytest.raises(ValueError, match="probe_layers"):
        replace(engine.blend_cfg, probe_layers=0)


def test_stale_key_scale_defaults_to_the_models_measured_value_and_a_setting_wins():
    from kvblend.model.aliases import ALIASES, DEFAULT_STALE_KEY_SCALE

    assert make_engine(model="gemma3-270m").blend_cfg.stale_key_scale == ALIASES["gemma3-270m"].stale_key_scale
    assert make_engine(model="/models/other").blend_cfg.stale_key_scale == DEFAULT_STALE_KEY_SCALE
    assert make_engine(model="gemma3-270m", stale_key_scale=0.9).blend_cfg.stale_key_scale == 0.9


def test_check_candidates_compute_the_layers_before_the_check_for_fewer_rows_exactly():
    engine = make_engine(stale_key_scale=0.5)
    cs = chunks(4, seed=7)
    engine.precompute(prompt(cs))
    ids = prompt([cs[1], cs[3], cs[0], cs[2]])
    T = len(ids)
    _, full = prefill(engine, ids, "full")
    _, blend1 = prefill(engine, ids, "blend", ratios=[1.0], check_candidates=1.0)
    torch.testing.assert_close(blend1.logits, full.logits, atol=1e-4, rtol=1e-4)
    _, every = prefill(engine, ids, "blend", ratios=[0.2], check_candidates=0)
    _, all_rows = prefill(engine, ids, "blend", ratios=[0.2], check_candidates=1000)
    _, few = prefill(engine, ids, "blend", ratios=[0.2], check_candidates=1.0)
    assert torch.equal(all_rows.logits, every.logits)  # candidates that cover every row change nothing
    assert few.stats.compute_frac < every.stats.compute_frac
    # Layer 0's loaded KV equals a fresh computation's, so the candidates' layer 1 K/V is exact.
    torch.testing.assert_close(few.cache.k[0][:, :T], every.cache.k[0][:, :T], atol=1e-5, rtol=1e-4)
    sel = torch.tensor(few.stats.selected_positions)
    assert sel.numel() == len(every.stats.selected_positions)
    torch.testing.assert_close(few.cache.k[1][:, sel], every.cache.k[1][:, sel], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(few.cache.v[1][:, sel], every.cache.v[1][:, sel], atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="check_candidates"):
        replace(engine.blend_cfg, check_candidates=0.5)
    with pytest.raises(ValueError, match="check_candidates"):
        Settings(check_candidates=0.5)


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_a_probe_without_separators_skips_only_them_and_keeps_the_exact_ends(scale):
    engine = make_engine(stale_key_scale=scale)
    cs = chunks(4, seed=8)
    engine.precompute(prompt(cs))
    ids = prompt([cs[2], cs[0], cs[3], cs[1]])
    _, full = prefill(engine, ids, "full")
    _, blend1 = prefill(engine, ids, "blend", ratios=[1.0], probe_separators=False)
    torch.testing.assert_close(blend1.logits, full.logits, atol=1e-4, rtol=1e-4)
    _, probed = prefill(engine, ids, "blend", ratios=[0.2], probe_separators=True)
    _, skipped = prefill(engine, ids, "blend", ratios=[0.2], probe_separators=False)
    P = skipped.stats.prefix_hit_tokens
    seps = separator_rows(ids, P)
    assert len(seps) == 3 * len(SEP)  # before each chunk but the first two (in the prefix hit), before the suffix
    assert_the_probe_skipped(engine, ids, seps, probed, skipped, probe_separators=False)


def test_the_probe_sums_its_attention_from_the_chosen_layer_on():
    from kvblend.blend.fusor import ChunkLoader, StaleBias, run_layers

    engine = make_engine()
    ids = prompt(chunks(3, seed=9))
    T, L, runner = len(ids), engine.runner.n_layers, engine.runner
    plan, full = prefill(engine, ids, "full")  # exact KV at every layer for the suffix to read
    pos = torch.arange(T - len(SUFFIX), T)
    token_ids = torch.tensor(ids)[pos]
    passes = {}
    for mass_from in (0, 2, L - 1):
        loader = ChunkLoader(runner, plan, full.cache)
        loader.start([])
        stale = StaleBias(1.0, torch.zeros(T, dtype=torch.bool), full.cache, runner.dtype)
        with torch.inference_mode():
            passes[mass_from] = run_layers(runner, full.cache, loader, runner.rows(token_ids, pos), pos, stale,
                                           watch=torch.ones(len(pos), dtype=torch.bool), mass_from=mass_from)
    for mass_from, p in passes.items():
        # Each layer's attention mass is a distribution over the keys: the sum counts the layers summed.
        assert float(p.attention.sum()) == pytest.approx(L - mass_from, rel=1e-5)
        assert not bool(p.attention[T:].any()) and bool((p.attention[: T - len(SUFFIX)] > 0).all())
        # Below mass_from the rows attend through the pass's usual kernel: the same rows either way.
        torch.testing.assert_close(p.rows.h, passes[0].rows.h, atol=1e-5, rtol=1e-5)
    # A sum from an earlier layer holds every later layer's mass and more, position by position.
    assert bool((passes[0].attention >= passes[2].attention - 1e-6).all())
    assert bool((passes[2].attention >= passes[L - 1].attention - 1e-6).all())
    with pytest.raises(ValueError, match="probe_attention_from"):
        replace(engine.blend_cfg, probe_attention_from=1.0)


def test_a_probe_over_the_suffix_tail_skips_only_its_head_and_keeps_the_exact_ends():
    engine = make_engine(stale_key_scale=0.5)
    cs = chunks(3, seed=10)
    engine.precompute(prompt(cs))
    ids = prompt([cs[1], cs[2], cs[0]])
    T, tail = len(ids), 2
    head = list(range(T - len(SUFFIX), T - tail))
    _, full = prefill(engine, ids, "full")
    _, blend1 = prefill(engine, ids, "blend", ratios=[1.0], probe_suffix_tokens=tail)
    torch.testing.assert_close(blend1.logits, full.logits, atol=1e-4, rtol=1e-4)
    _, whole = prefill(engine, ids, "blend", ratios=[0.2], probe_suffix_tokens=0)
    _, longer = prefill(engine, ids, "blend", ratios=[0.2], probe_suffix_tokens=len(SUFFIX))
    assert torch.equal(longer.logits, whole.logits)  # a tail as long as the suffix changes nothing
    _, tailed = prefill(engine, ids, "blend", ratios=[0.2], probe_suffix_tokens=tail)
    assert_the_probe_skipped(engine, ids, head, whole, tailed, probe_suffix_tokens=tail)
    with pytest.raises(ValueError, match="probe_suffix_tokens"):
        replace(engine.blend_cfg, probe_suffix_tokens=-1)
