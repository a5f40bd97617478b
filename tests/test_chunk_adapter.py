"""Chunk adapters: low-rank deltas used only while chunk KV is precomputed (kvblend/model/adapter.py),
and their training by self-distillation (kvblend/train)."""

import random
from dataclasses import replace

import pytest
import torch
from tiny_models import tiny_model
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from kvblend.blend.segment import join_segments
from kvblend.config import Settings
from kvblend.engine.engine import Engine
from kvblend.eval.harness import forced_logits, greedy, teacher_forced
from kvblend.model.adapter import AdapterError, ChunkAdapter, resolve_adapter, shipped_adapter_path
from kvblend.train.data import Example, teach
from kvblend.train.student import topk_kl
from kvblend.train.trainer import TrainConfig, student_loss, train

SEP = [7, 7, 3]
PREFIX, SUFFIX = [1, 20, 21, 22, 23, 24], [30, 31, 32, 33, 34]


def prompt(seed=0, n=4, length=24):
    g = torch.Generator().manual_seed(seed)
    return join_segments(PREFIX, [torch.randint(10, 300, (length,), generator=g).tolist() for _ in range(n)],
                         SUFFIX, SEP)


def engine(family="llama", adapter="none", **settings):
    return Engine(tiny_model(family), Settings(**{"check_layers": [1], "recompute_ratios": [0.15],
                                                  "min_recompute_tokens": 0, "kv_half": False,
                                                  "chunk_adapter": str(adapter), **settings}), sep_ids=SEP)


def trained_like(model_config, seed=1) -> ChunkAdapter:
    """An adapter whose deltas are not zero (as after training)."""
    adapter = ChunkAdapter.for_model(model_config, rank=4, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for b in adapter.b.values():
            b.copy_(0.05 * torch.randn(b.shape, generator=g))
    return adapter


def test_an_adapter_round_trips_through_its_file(tmp_path):
    adapter = trained_like(tiny_model("qwen2").config)
    adapter.info = {"model": "tiny", "step": 3}
    adapter.save(tmp_path / "a.safetensors")
    back = ChunkAdapter.load(tmp_path / "a.safetensors")
    assert back.identity == adapter.identity
    assert back.info == adapter.info and back.rank == 4 and back.shapes == adapter.shapes
    for name, p in adapter.state_dict().items():
        assert torch.equal(back.state_dict()[name], p)


def test_an_untrained_adapter_changes_nothing_and_its_identity_follows_its_weights():
    cfg = tiny_model("llama").config
    adapter = ChunkAdapter.for_model(cfg)
    x = torch.randn(5, cfg.hidden_size)
    assert torch.equal(adapter.delta(0, "k", x), torch.zeros(5, adapter.shapes["k"][1]))
    assert trained_like(cfg, 1).fresh_identity() != trained_like(cfg, 2).fresh_identity()


def test_bad_adapter_files_are_clear_errors(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(AdapterError, match="cannot be read"):
        ChunkAdapter.load(bad)
    with pytest.raises(AdapterError, match="not found"):
        ChunkAdapter.load(tmp_path / "missing.safetensors")
    other = trained_like(tiny_model("llama", num_hidden_layers=2).config)  # fewer layers
    other.save(tmp_path / "other.safetensors")
    with pytest.raises(AdapterError, match="does not fit"):
        resolve_adapter(str(tmp_path / "other.safetensors"), "tiny", tiny_model("llama").config)
    assert resolve_adapter("auto", "a-model-with-none-shipped", tiny_model("llama").config) is None


def test_adapters_ship_for_the_qwen_instruct_model_only():
    """`auto` finds the 0.5B's adapter, a file that reads whole and names its model; SmolLM2 and
    Gemma 3 keep precomputing with the model alone (no adapter of theirs won on held-out records)."""
    path = shipped_adapter_path("qwen2.5-coder-0.5b-instruct")
    assert path is not None
    adapter = ChunkAdapter.load(path)
    assert adapter.info["model"] == "qwen2.5-coder-0.5b-instruct" and adapter.n_layers == 24
    assert any(bool(b.abs().sum() > 0) for b in adapter.b.values())  # trained: not the identity
    for alias in ("smollm2-135m-instruct", "gemma3-270m", "qwen2.5-coder-1.5b-instruct"):
        assert shipped_adapter_path(alias) is None


@pytest.fixture
def adapter_file(tmp_path):
    path = tmp_path / "adapter.safetensors"
    trained_like(tiny_model("llama").config).save(path)
    return path


def test_chunk_keys_name_the_adapter_and_prefix_keys_do_not(adapter_file):
    ids = prompt()
    with_adapter, without = engine(adapter=adapter_file), engine()
    seg = without.segments(ids)
    chunk = ids[seg.chunks[1][0]:seg.chunks[1][1]]
    context = without.keys.context_ids(ids, seg)
    assert with_adapter.keys.adapter == ChunkAdapter.load(adapter_file).identity
    assert with_adapter.keys.chunk_key(chunk, context) != without.keys.chunk_key(chunk, context)
    bounds = [(0, seg.exact_end)]
    assert with_adapter.keys.prefix_keys(ids, bounds) == without.keys.prefix_keys(ids, bounds)


def test_the_adapter_changes_only_stored_chunk_kv(adapter_file):
    ids = prompt()
    on, off = engine(adapter=adapter_file), engine()
    for e in (on, off):
        e.precompute(ids)
    _, full_on = on.prefill(ids, "full")
    _, full_off = off.prefill(ids, "full")
    assert torch.equal(full_on.logits, full_off.logits)  # the reader is the model alone
    _, blend_on = on.prefill(ids, "blend")
    _, blend_off = off.prefill(ids, "blend")
    assert blend_on.stats.chunk_hits == blend_off.stats.chunk_hits == 4
    assert not torch.equal(blend_on.logits, blend_off.logits)
    # The first chunk is read exact from the prefix cache: no adapter in its rows.
    first = off.segments(ids).chunks[0]
    assert torch.equal(blend_on.cache.k[:, :, first[0]:first[1]], blend_off.cache.k[:, :, first[0]:first[1]])


def test_an_adapter_turned_off_gives_todays_output_bit_for_bit(adapter_file):
    ids = prompt(seed=3)
    outputs = []
    for e in (engine(adapter=adapter_file, chunk_adapter="none"), engine(chunk_adapter="auto")):
        e.precompute(ids)
        _, out = e.prefill(ids, "blend")
        outputs.append(out)
    assert outputs[0].stats.selected_positions == outputs[1].stats.selected_positions
    assert torch.equal(outputs[0].logits, outputs[1].logits)
    assert torch.equal(outputs[0].cache.k, outputs[1].cache.k)


def example(e, ids, n=8):
    _, full = e.prefill(ids, "full", 40)
    answer = greedy(e, full, len(ids), n + 1)
    logp, idx = torch.log_softmax(teacher_forced(e, full, len(ids), answer, n).float(), -1).topk(64, dim=-1)
    return Example(ids, e.segments(ids), answer, logp, idx)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("neighbours", [False, True])
def test_the_student_computes_what_the_engine_serves(family, neighbours, tmp_path):
    """Trained through the student, the adapter is scored through the engine: the two agree, with
    chunks precomputed after the prefix alone and after their neighbour leads."""
    path = tmp_path / "adapter.safetensors"
    trained_like(tiny_model(family).config).save(path)
    e = engine(family, path)
    ids = prompt(seed=5)
    if neighbours:  # a collection whose chunks have neighbours: the prompt's and another's
        e.index_collection([ids, prompt(seed=6)])
        assert all(e.keys.lead_ids(ids[a:b]) for a, b in e.segments(ids).chunks)
    ex = example(e, ids)
    e.precompute(ids)
    for ratio in (0.0, 1.0):
        cfg = replace(e.blend_cfg, ratios=[ratio])
        with torch.no_grad():
            student = float(student_loss(e, e.adapter, ex, "blend", cfg))
        served, _ = forced_logits(e, ids, "blend", cfg, ex.answer, ex.n_positions)
        assert student == pytest.approx(float(topk_kl(ex.logp, ex.idx, served).mean()), rel=0.05, abs=1e-7)
        assert ratio == 1.0 or student > 1e-4  # reused chunk KV is not full prefill's
    assert student == pytest.approx(0.0, abs=1e-6)  # ratio 1.0: full prefill


def training_setup():
    """An engine whose chunks have neighbours, a prompt with its teacher, and an adapter to train."""
    e = engine("qwen2")
    ids = prompt(seed=5)
    e.index_collection([ids, prompt(seed=6)])
    for p in e.model.hf.parameters():
        p.requires_grad_(False)
    return e, example(e, ids), trained_like(e.model.config)


def loss_and_grads(e, adapter, ex, **kw):
    adapter.zero_grad(set_to_none=True)
    loss = student_loss(e, adapter, ex, **kw)
    loss.backward()
    # The last layer's q and o deltas get no gradient: past its K and V nothing of a chunk is read.
    return float(loss.detach()), [p.grad for p in adapter.parameters() if p.grad is not None]


def test_low_memory_training_gives_the_same_loss_and_gradient(monkeypatch):
    """Chunk activations computed again in the backward, not kept: the same arithmetic."""
    from kvblend.train import student

    calls = []
    monkeypatch.setattr(student, "checkpoint", lambda *a, **k: calls.append(1) or torch_checkpoint(*a, **k))
    e, ex, adapter = training_setup()
    (kept, g_kept), (again, g_again) = [loss_and_grads(e, adapter, ex, low_memory=m) for m in (False, True)]
    assert len(calls) == len(ex.seg.chunks) - 1  # each chunk after the exact first one, once
    assert kept > 1e-4 and again == pytest.approx(kept, rel=1e-6)
    assert len(g_kept) == len(g_again) and any(g.abs().sum() > 0 for g in g_kept)
    for a, b in zip(g_kept, g_again):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)


def test_gradient_to_some_chunks_sums_to_the_whole_gradient():
    """Chunks left out of the gradient are computed without autograd: the loss is the same, and
    the gradients of a split of the chunks add up to the gradient through all of them."""
    e, ex, adapter = training_setup()
    n = len(ex.seg.chunks) - 1  # the stored chunks: all but the exact first one
    assert n >= 2
    (whole, g), (even, g_even), (odd, g_odd) = [loss_and_grads(e, adapter, ex, grad=grad) for grad in
                                                (None, set(range(0, n, 2)), set(range(1, n, 2)))]
    assert whole > 1e-4 and even == pytest.approx(whole, rel=1e-6) and odd == pytest.approx(whole, rel=1e-6)
    assert len(g) == len(g_even) == len(g_odd)
    assert any(not torch.equal(a, b) for a, b in zip(g_even, g))  # a part, not the whole
    for a, b, c in zip(g, g_even, g_odd):
        torch.testing.assert_close(b + c, a, rtol=1e-4, atol=1e-7)


def test_the_chunks_a_step_trains_are_drawn_from_the_stored_ones():
    from kvblend.train.trainer import grad_chunks

    e = engine("qwen2")
    ex = example(e, prompt(seed=5))
    n = len(ex.seg.chunks) - 1
    rng = random.Random(0)
    assert grad_chunks(e, ex, 0, rng) is None and grad_chunks(e, ex, n, rng) is None  # all of them
    drawn = [grad_chunks(e, ex, 1, rng) for _ in range(20)]
    assert all(len(d) == 1 and d <= set(range(n)) for d in drawn)
    assert len(set().union(*drawn)) > 1  # drawn afresh
    with pytest.raises(ValueError, match="grad_chunks"):
        TrainConfig(grad_chunks=-1)


def test_a_tiny_models_adapter_trains_lowers_its_kl_and_resumes(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBLEND_CACHE_DIR", str(tmp_path / "cache"))
    e = engine("qwen2", stale_key_scale=1.0)
    examples = teach(e, [prompt(seed=s) for s in range(3)], positions=6, progress=False)
    assert (tmp_path / "cache" / "adapter-teacher").is_dir()  # the teacher is kept for the next run
    cfg = TrainConfig(steps=12, batch=3, lr=3e-3, warmup=1, rank=4, dev_every=4)
    out, checkpoint = tmp_path / "a.safetensors", tmp_path / "state.pt"
    history = train(e, examples, examples, out, checkpoint, cfg, progress=False)
    assert history.best_step > 0 and history.best_kl < 0.5 * history.dev[0]["kl_answer"]
    adapter = ChunkAdapter.load(out)
    assert adapter.info["step"] == history.best_step
    # Served with the adapter it wrote, the engine's own blend path scores what training measured.
    served = engine("qwen2", adapter=out, stale_key_scale=1.0)
    from kvblend.train.trainer import dev_score
    assert dev_score(served, served.adapter, examples)["kl_answer"] == pytest.approx(history.best_kl, rel=1e-4)
    # Finished: running it again resumes at the end; other settings refuse the checkpoint.
    again = train(e, examples, examples, out, checkpoint, cfg, progress=False)
    assert len(again.steps) == 12
    with pytest.raises(ValueError, match="other settings"):
        train(e, examples, examples, out, checkpoint, replace(cfg, lr=1e-3), progress=False)
    # A checkpoint from before a setting existed resumes where that setting is at its default.
    state = torch.load(checkpoint, weights_only=False)
    del state["config"]["grad_chunks"]
    torch.save(state, checkpoint)
    assert len(train(e, examples, examples, out, checkpoint, cfg, progress=False).steps) == 12
    with pytest.raises(ValueError, match="other settings"):
        train(e, examples, examples, out, checkpoint, replace(cfg, grad_chunks=1), progress=False)
    # Continued from the adapter it wrote: the start is scored as served and is the mark to beat.
    more = train(e, examples, examples, tmp_path / "b.safetensors", tmp_path / "b.pt",
                 replace(cfg, steps=2, lr=1e-4, init=str(out)), progress=False)
    assert more.dev[1]["init"] == str(out)
    assert more.dev[1]["kl_answer"] == pytest.approx(history.best_kl, rel=1e-4)
    assert more.best_kl <= more.dev[1]["kl_answer"]
    assert (more.best_step > 0) == (tmp_path / "b.safetensors").is_file()
    with pytest.raises(ValueError, match="train it on with --rank 4 --alpha 16.0"):
        train(e, examples, examples, out, tmp_path / "c.pt", replace(cfg, rank=8, init=str(out)), progress=False)


def test_teacher_outputs_kept_in_a_folder_of_ones_own_are_read_back_not_recomputed(tmp_path, monkeypatch):
    """--teacher-dir: a folder carried with a checkpoint to another machine spares its teacher."""
    import shutil

    import kvblend.train.data as data

    monkeypatch.setenv("KVBLEND_CACHE_DIR", str(tmp_path / "cache"))
    e = engine("qwen2")
    prompts = [prompt(seed=s) for s in range(2)]
    first = teach(e, prompts, positions=4, progress=False, root=tmp_path / "teacher")
    assert not (tmp_path / "cache" / "adapter-teacher").exists()
    assert len(list((tmp_path / "teacher" / e.model.fingerprint).glob("*.pt"))) == 2
    shutil.copytree(tmp_path / "teacher", tmp_path / "carried")

    def no_teacher(*a, **k):
        raise AssertionError("the teacher was computed again")
    monkeypatch.setattr(data, "full_answer", no_teacher)
    again = teach(e, prompts, positions=4, progress=False, root=tmp_path / "carried")
    for a, b in zip(first, again):
        assert a.answer == b.answer and torch.equal(a.logp, b.logp) and torch.equal(a.idx, b.idx)


def test_dev_records_that_also_train_are_refused():
    from types import SimpleNamespace

    from kvblend.cli_adapter import check_disjoint

    records = [SimpleNamespace(question=f"q{i}", passages=[f"p{i}", "shared"]) for i in range(4)]
    check_disjoint(records[2:], records[:2])  # disjoint: fine
    check_disjoint(records, [SimpleNamespace(question="q0", passages=["other"])])  # same question, other passages
    with pytest.raises(ValueError, match=r"1 --dev-data record\(s\) are also in --data \(e.g. 'q1'\)"):
        check_disjoint(records[1:], records[:2])


def test_records_in_several_passage_orders_are_more_prompts_each_once():
    from serving import tiny_engine

    from kvblend.cli_adapter import prompt_orders
    from kvblend.eval.datasets import QA, RagRecord

    e = tiny_engine()
    records = [RagRecord(f"Question {i}?", ["x"], [f"Passage {i} {j} says something." for j in range(4)], "f1", QA)
               for i in range(3)]
    records.append(RagRecord("One passage?", ["x"], ["Only this passage."], "f1", QA))  # no second chunk: left out
    one = prompt_orders(e, records, 10_000, seed=0, orders=1)
    three = prompt_orders(e, records, 10_000, seed=0, orders=3)
    assert len(one) == 3 and three[:3] == one  # the first order is the one a single order gives
    assert len(three) == len({tuple(p) for p in three}) > 3  # other orders add prompts, never one twice
    assert all(sorted(p) in [sorted(q) for q in one] for p in three)  # the same passages, reordered
    with pytest.raises(ValueError, match="--dev-orders must be >= 1"):
        prompt_orders(e, records, 10_000, seed=0, orders=0, flag="--dev-orders")
