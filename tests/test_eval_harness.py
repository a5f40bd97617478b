"""The benchmarks' yardstick: full prefill's greedy answer, teacher-forced into any mode."""

import torch
from serving import tiny_engine

from kvblend.eval.datasets import QA, RagRecord
from kvblend.eval.harness import forced_logits, full_reference, prompt_ids
from kvblend.eval.metrics import kl_divergence


def test_a_mode_is_scored_on_full_prefills_own_answer_positions():
    engine = tiny_engine()
    record = RagRecord("Where is the bridge?", ["north"], ["The bridge stands north of town.",
                                                            "The market opens at dawn."], "f1", QA)
    ids = prompt_ids(engine, record)
    full, answer, ref = full_reference(engine, ids)
    assert 1 <= len(answer) <= 17 and ref.shape == (min(16, len(answer)), full.logits.shape[0])
    assert torch.equal(ref[0], full.logits)  # the first position is the prefill's own last row
    again, out = forced_logits(engine, ids, "full", None, answer)
    assert torch.equal(again, ref) and float(kl_divergence(ref, again).max()) == 0.0
    reused, out = forced_logits(engine, ids, "reuse", None, answer)
    assert reused.shape == ref.shape and out.stats.chunk_hits == 2 and out.stats.compute_frac < 1
