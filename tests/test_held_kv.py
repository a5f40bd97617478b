"""Weights held in half precision for fp32 products (bf16-fp32, fp16-fp32) hold KV in that dtype
too: caches, prefix blocks and chunk entries. Every attention reads the same rounded KV, so the
blend invariants stay exact, and full prefill stays within the rounding of the same model with
fp32 KV."""

from dataclasses import replace

import pytest
import torch
from tiny_models import tiny_hf

from kvblend.blend.segment import join_segments
from kvblend.config import Settings
from kvblend.engine.engine import Engine
from kvblend.engine.sampler import SamplingParams
from kvblend.engine.scheduler import generate
from kvblend.model.loader import load_model
from kvblend.model.runner import KVCache
from kvblend.model.weights import HELD_DTYPES

SEP = [7, 7, 3]
PREFIX, SUFFIX = [1, 20, 21, 22, 23, 24], [30, 31, 32, 33, 34]
SETTINGS = dict(check_layers=[1], recompute_ratios=[0.15], min_recompute_tokens=0)


def chunks(n, length=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 300, (length,), generator=g).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("held") / "qwen2"
    tiny_hf("qwen2", tie_word_embeddings=True).save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=sorted(HELD_DTYPES))
def held_format(request):
    return request.param


def engine(folder, weights, **settings):
    model = load_model(str(folder), dtype="float32", weights=weights, device="cpu", progress=False)
    return Engine(model, Settings(**{**SETTINGS, **settings}), sep_ids=SEP)


def test_kv_is_held_in_half_precision_and_keyed_apart_from_fp32_kv(folder, held_format):
    half = HELD_DTYPES[held_format]
    held, plain = engine(folder, held_format), engine(folder, weights="fp32")
    assert held.runner.dtype == torch.float32 and held.runner.new_cache(4).k.dtype == half
    assert plain.runner.new_cache(4).k.dtype == torch.float32
    assert held.spec.dtype == str(half).removeprefix("torch.") and held.chunk_storage == ""  # not halved again
    ids = join_segments(PREFIX, chunks(2), SUFFIX, SEP)
    held.precompute(ids)
    memory = held.store.tier("memory")
    stored = [memory.get(key) for key in memory.keys()]
    assert len(stored) > 2 and all(kv.k.dtype == half for kv in stored)  # chunks and prefix blocks
    assert held.keys.chunk_key(chunks(1)[0], PREFIX) != plain.keys.chunk_key(chunks(1)[0], PREFIX)


def test_blend_invariants_are_exact_with_held_kv(folder, held_format):
    e = engine(folder, held_format)
    cs = chunks(4)
    e.precompute(join_segments(PREFIX, cs, SUFFIX, SEP))
    ids = join_segments(PREFIX, [cs[2], cs[0], cs[3], cs[1]], SUFFIX, SEP)
    _, full = e.prefill(ids, "full")
    _, prefix = e.prefill(ids, "prefix")
    assert prefix.stats.prefix_hit_tokens > 0 and torch.equal(prefix.logits, full.logits)
    plan, one = e.prefill(ids, "blend", blend_cfg=replace(e.blend_cfg, ratios=[1.0]))
    assert plan.hits == 4 and one.stats.reused_tokens == 0
    T = len(ids)
    assert torch.equal(one.logits, full.logits)
    assert torch.equal(one.cache.k[:, :, :T], full.cache.k[:, :, :T]) and one.cache.k.dtype == HELD_DTYPES[held_format]
    _, reuse = e.prefill(ids, "reuse")
    _, zero = e.prefill(ids, "blend", blend_cfg=replace(e.blend_cfg, ratios=[0.0]))
    assert torch.equal(zero.logits, reuse.logits)
    assert not torch.allclose(reuse.logits, full.logits, atol=1e-3)


def test_full_prefill_and_decode_stay_within_half_rounding_of_fp32_kv(folder, held_format):
    """Against the same held weights with fp32 KV: logits within the KV's rounding carried through
    four layers; greedy tokens (full prefill, then decode steps) read the same held KV."""
    held = engine(folder, held_format)
    ref = engine(folder, held_format)
    ref.runner.kv_dtype = torch.float32  # the same weights, KV kept in fp32
    ids = join_segments(PREFIX, chunks(3, seed=5), SUFFIX, SEP)
    _, a = held.prefill(ids, "full")
    _, b = ref.prefill(ids, "full")
    assert a.cache.k.dtype == HELD_DTYPES[held_format] and b.cache.k.dtype == torch.float32
    torch.testing.assert_close(a.logits, b.logits, atol=3e-2, rtol=3e-2)
    assert not torch.equal(a.logits, b.logits)  # the KV really is rounded
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    tokens = generate(held, ids, params, mode="full").token_ids
    assert len(tokens) == 6 and tokens == generate(held, ids, params, mode="full").token_ids


def test_held_kv_reads_back_from_disk(folder, held_format, tmp_path):
    first = engine(folder, held_format, local_disk=str(tmp_path))
    cs = chunks(3, seed=7)
    first.precompute(join_segments(PREFIX, cs, SUFFIX, SEP))
    ids = join_segments(PREFIX, cs[::-1], SUFFIX, SEP)
    _, in_memory = first.prefill(ids, "blend")
    first.close()
    second = engine(folder, held_format, local_disk=str(tmp_path), local_cpu=False)
    plan, from_disk = second.prefill(ids, "blend")
    assert plan.hits == 3 and "disk" in {c.tier for c in plan.chunks} and "memory" not in {c.tier for c in plan.chunks}
    assert torch.equal(from_disk.logits, in_memory.logits)


def test_fp16_kv_saturates_where_a_value_is_past_its_range():
    """A key of 1e6 would be inf in fp16, and attention reading it NaN; it is held at fp16's
    largest value. bf16 holds it as it is (its range is fp32's)."""
    k = torch.tensor([[[1e6, -1e6, 0.5, 2.0]]])  # [Hkv, n, d]
    for dtype, big in [(torch.float16, torch.finfo(torch.float16).max), (torch.bfloat16, 1e6)]:
        cache = KVCache(1, 1, 4, 4, dtype, torch.device("cpu"))
        cache.write(0, torch.tensor([0]), k, k)
        held = cache.k[0, 0, 0].float()
        assert torch.isfinite(held).all() and held[0] == torch.tensor(big, dtype=dtype).float()
        assert held[1] == -held[0] and held[2:].tolist() == [0.5, 2.0]
