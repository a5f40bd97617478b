"""The engine on every device there is: runner parity with transformers, the blend invariants,
generation and a disk round trip, in fp32 and bf16 (re-rotation: test_runner_parity.py).

The CPU cases run everywhere (CI); the CUDA cases run where a GPU is (`-m cuda` selects them) and
are skipped cleanly elsewhere. On CUDA, full prefill takes the flash kernel and scattered rows the
masked one, which round differently: what is bit-identical on the CPU is compared with the
dtype's tolerance there.
"""

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tiny_models import DEVICES, FAMILIES, tiny_model

from kvblend.blend.segment import join_segments
from kvblend.config import Settings
from kvblend.engine.engine import Engine
from kvblend.engine.sampler import SamplingParams
from kvblend.model.runner import Runner
from kvblend.engine.scheduler import generate

DTYPES = [torch.float32, torch.bfloat16]
# Logits of the tiny models are O(1): fp32 differs only by summation order, bf16 by its 8-bit
# mantissa carried through four layers.
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=6e-2, rtol=6e-2)}

SEP = [7, 7, 3]
PREFIX = [1, 20, 21, 22, 23, 24]
SUFFIX = [30, 31, 32, 33, 34]


def chunks(n, length=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 300, (length,), generator=g).tolist() for _ in range(n)]


def prompt(cs):
    return join_segments(PREFIX, cs, SUFFIX, SEP)


def engine_on(device, dtype, family="llama", **settings):
    s = Settings(**{"check_layers": [1], "recompute_ratios": [0.15], "min_recompute_tokens": 0, **settings})
    return Engine(tiny_model(family, dtype=dtype, device=device), s, sep_ids=SEP)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_runner_matches_transformers(family, dtype, device):
    """Full prefill, then a block of rows after it and single decode rows: every logit is what
    transformers' own forward gives on the same device and dtype."""
    m = tiny_model(family, seed=3, dtype=dtype, device=device)
    ids = torch.randint(0, m.config.vocab_size, (90,), generator=torch.Generator().manual_seed(2))
    ref = m.hf(ids[None].to(device)).logits[0].float()
    runner = Runner(m)
    cache = runner.new_cache(8)  # grows on demand
    head = runner.forward(ids[:40], torch.arange(40), cache, logit_rows=slice(None))
    block = runner.forward(ids[40:80], torch.arange(40, 80), cache, logit_rows=slice(None))
    steps = [runner.forward(ids[i:i + 1], torch.tensor([i]), cache) for i in range(80, 90)]
    assert head.device.type == device
    torch.testing.assert_close(torch.cat([head, block, *steps]), ref, **TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_prefix_reuse_and_blend_at_ratio_one_are_full_and_at_zero_reuse(family, dtype, device):
    engine = engine_on(device, dtype, family)
    cs = chunks(4)
    engine.precompute(prompt(cs))
    ids = prompt([cs[2], cs[0], cs[3], cs[1]])  # every chunk moved
    _, full = engine.prefill(ids, "full")
    plan, prefix = engine.prefill(ids, "prefix")  # the system prompt and first chunk exact, the rest computed
    assert prefix.stats.prefix_hit_tokens > 0
    torch.testing.assert_close(prefix.logits, full.logits, **TOL[dtype])
    plan, one = engine.prefill(ids, "blend", blend_cfg=_ratio(engine, 1.0))
    assert plan.hits == 4 and one.stats.reused_tokens == 0
    T = len(ids)
    torch.testing.assert_close(one.logits, full.logits, **TOL[dtype])
    torch.testing.assert_close(one.cache.k[:, :, :T].float(), full.cache.k[:, :, :T].float(), **TOL[dtype])
    _, reuse = engine.prefill(ids, "reuse")
    _, zero = engine.prefill(ids, "blend", blend_cfg=_ratio(engine, 0.0))
    assert torch.equal(zero.logits, reuse.logits) and torch.equal(zero.cache.k, reuse.cache.k)
    assert not torch.allclose(reuse.logits, full.logits, atol=1e-3)  # reuse really is approximate


def _ratio(engine, r):
    return replace(engine.blend_cfg, ratios=[r])


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_generation_matches_transformers(device):
    """The engine's greedy tokens (full prefill, then decode steps) are transformers' own."""
    engine = engine_on(device, torch.float32)
    ids = prompt(chunks(3, seed=6))
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    got = generate(engine, ids, params, mode="full").token_ids
    hf = engine.model.hf
    seq = torch.tensor([ids], device=device)
    for _ in range(8):  # greedy by hand: no generation config to depend on
        seq = torch.cat([seq, hf(seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert got == seq[0, len(ids):].tolist()
    blended = generate(engine, ids, params, mode="blend")  # precomputed by the first request's misses
    assert len(blended.token_ids) == 8


@pytest.mark.parametrize("device", DEVICES)
def test_chunks_read_back_from_disk_onto_the_device(device, tmp_path):
    """Chunk KV written to disk from the device and read back onto it gives the very prefill that
    memory gave."""
    first = engine_on(device, torch.bfloat16, local_disk=str(tmp_path))
    cs = chunks(3, seed=7)
    first.precompute(prompt(cs))
    ids = prompt(cs[::-1])
    _, in_memory = first.prefill(ids, "blend")
    first.close()
    second = engine_on(device, torch.bfloat16, local_disk=str(tmp_path), local_cpu=False)
    plan, from_disk = second.prefill(ids, "blend")
    assert plan.hits == 3 and "disk" in {c.tier for c in plan.chunks} and "memory" not in {c.tier for c in plan.chunks}
    assert from_disk.cache.k.device.type == device
    assert torch.equal(from_disk.logits, in_memory.logits)


@pytest.mark.parametrize("device", DEVICES)
def test_gpu_bench_runs_on_the_tiny_shape(device, tmp_path, warm_python):
    """The GPU benchmark as written, on a tiny model of its shape family: every mode and the layer
    costs come back (nothing reads the timings)."""
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "gpu_bench.json"
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    proc = warm_python.run([str(root / "benchmarks" / "gpu_bench.py"), "--shape", "tiny", "--device", device,
                            "--lengths", "200,400", "--repeats", "1", "--out", str(out)], tmp_path, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["device"].startswith(device) and len(report["results"]) == 2
    for row in report["results"]:
        assert {"full", "prefix", "reuse", "blend 15%", "transformers full"} <= set(row)
        assert row["reuse"]["recomputed"] < row["blend 15%"]["recomputed"] < row["full"]["recomputed"]
        kernels = row["layer"]["attention"]
        assert kernels["cpu_block_groups_max_diff"] < 0.05 and kernels["one_call_expanded_max_diff"] < 0.05


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("depth", [0, 2])
def test_chunk_writes_in_one_batch_give_the_same_cache(family, depth, monkeypatch, tmp_path):
    """CUDA writes every moved chunk of a layer in one batch; here, forced on the CPU, the batch
    gives bit for bit the cache that one write per chunk gives, from memory and from disk. The
    loading controller is off: it acts on measured disk speed, which differs from run to run."""
    from kvblend.blend import loader

    engine = engine_on("cpu", torch.bfloat16, family, local_disk=str(tmp_path), prefetch_depth=depth,
                       loading_controller=False)
    cs = chunks(4, seed=8)
    engine.precompute(prompt(cs))
    ids = prompt([cs[3], cs[1], cs[0], cs[2]])
    engine.close()
    on_disk = engine_on("cpu", torch.bfloat16, family, local_disk=str(tmp_path), local_cpu=False,
                        prefetch_depth=depth, loading_controller=False)
    outs = {}
    for batched in (False, True):
        monkeypatch.setattr(loader, "writes_in_batches", lambda cache, b=batched: b)
        for name, e in (("memory", engine), ("disk", on_disk)):
            outs[name, batched] = [e.prefill(ids, mode)[1] for mode in ("reuse", "blend")]
    for name in ("memory", "disk"):
        for one, batch in zip(outs[name, False], outs[name, True]):
            assert torch.equal(one.logits, batch.logits) and torch.equal(one.cache.k, batch.cache.k)
            assert torch.equal(one.cache.v, batch.cache.v)
