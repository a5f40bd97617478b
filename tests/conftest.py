import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tiny_models

# tests/in_vllm runs in the vLLM venv (`make test` runs both suites): vLLM pins its own transformers, so
# it lives beside kvblend's venv, not in it.
collect_ignore = [] if importlib.util.find_spec("vllm") else ["in_vllm"]


@pytest.fixture(scope="session")
def default_fp32():
    """The default model (SmolLM2-135M-Instruct GGUF) in fp32, loaded once for the session."""
    from kvblend.model.loader import load_model

    return load_model("smollm2-135m-instruct", dtype="float32", device="cpu")
