"""benchmarks/verify_model.py, the check a new model's README row cites, runs as written and finds what
the suite's invariants say it should. On a tiny random model with the default model's tokenizer: the
invariants hold on any model, and the real models' own are tested in test_default_model.py,
test_qwen_model.py and test_gemma_model.py."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from verify_model import table, verify  # noqa: E402


def test_verify_model_on_a_tiny_model(tiny_model_folder):
    row = verify(tiny_model_folder, "float32", repeat=1)
    assert row["rotary_gate"] and row["blend_0_equals_reuse"] and row["tokens"] > 300
    assert row["runner_vs_transformers"]["max_abs"] < 1e-3 and row["runner_vs_transformers"]["top1"] == 1.0
    assert row["blend_1_vs_full"]["max_abs"] < 1e-3
    assert f"| {tiny_model_folder} | float32 |" in table([row])
