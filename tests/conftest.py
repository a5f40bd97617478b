import importlib.util
import os
import sys
from pathlib import Path

import pytest

# `pytest -n N` (make test: two workers, beside the vLLM suite) runs N processes on the same cores: each
# takes its share of threads, where a pool as wide as the machine in each would spin for cores the others
# hold. Set before torch is imported; the subprocesses tests start inherit it.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // _workers)))

sys.path.insert(0, str(Path(__file__).parent))  # tiny_models

# tests/in_vllm runs in the vLLM venv (`make test` runs both suites): vLLM pins its own transformers, so
# it lives beside kvblend's venv, not in it.
collect_ignore = [] if importlib.util.find_spec("vllm") else ["in_vllm"]


@pytest.fixture(scope="session")
def default_fp32():
    """The default model (SmolLM2-135M-Instruct GGUF) in fp32, loaded once for the session."""
    from kvblend.model.loader import load_model

    return load_model("smollm2-135m-instruct", dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def tiny_model_folder(tmp_path_factory) -> str:
    """A 4-layer random Llama folder (hidden size 64) with the default model's tokenizer and chat template:
    commands and benchmarks whose claims hold on any model run on it, at a hundredth of the real one's compute."""
    from serving import default_tokenizer
    from tiny_models import tiny_hf

    tok = default_tokenizer()
    folder = tmp_path_factory.mktemp("model") / "tiny-llama"
    tiny_hf("llama", vocab_size=len(tok), max_position_embeddings=4096).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def warm_python():
    """Runs scripts in forks of one interpreter that has imported torch, transformers and kvblend (warm_python.py)."""
    from warm_python import WarmPython

    python = WarmPython(dict(os.environ))
    yield python
    python.close()


# The longest modules (on the AVX2-only EPYC: over a minute each), started first, longest first.
LONGEST = ("test_short_prompts.py", "test_qwen_model.py", "test_gemma_model.py")


def pytest_collection_modifyitems(items):
    """The longest modules first, then the other modules with real-model tests, in file order, then the rest:
    `make test` hands a whole module to each free worker in this order, so the long ones start first and the
    short ones fill in at the end. A module's tests stay together, so its fixtures are set up once."""
    real = {item.path for item in items if item.get_closest_marker("real_model")}
    items.sort(key=lambda item: (LONGEST.index(item.path.name) if item.path.name in LONGEST else len(LONGEST),
                                 item.path not in real))
