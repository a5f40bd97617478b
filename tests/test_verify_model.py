"""benchmarks/verify_model.py, the check a new model's README row cites, runs on the default model
and finds what the suite's invariants say it should."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from verify_model import table, verify  # noqa: E402

pytestmark = pytest.mark.real_model


def test_verify_model_on_the_default_model():
    row = verify("smollm2-135m-instruct", "float32", repeat=1)
    assert row["rotary_gate"] and row["blend_0_equals_reuse"] and row["tokens"] > 300
    assert row["runner_vs_transformers"]["max_abs"] < 1e-3 and row["runner_vs_transformers"]["top1"] == 1.0
    assert row["blend_1_vs_full"]["max_abs"] < 1e-3
    assert "| smollm2-135m-instruct | float32 |" in table([row])
