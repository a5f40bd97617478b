"""vLLM's CPU build with kvblend's connector, on SmolLM2-135M-Instruct in fp32.

The engine core and the worker run in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so a test
reads both sides of the connector; tests/in_vllm/test_vllm_serve.py runs vLLM's OpenAI server as users do,
with the scheduler and the worker in processes of their own. One connector per process (vLLM keeps
it in a global): every test here shares one, configured once.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: vLLM's default takes most of the machine
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from kvblend.model.loader import hf_folder  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # vllm_server
from vllm_server import free_port  # noqa: E402

MODEL = "smollm2-135m-instruct"
SEPARATOR = "<file_sep>"  # one special token of SmolLM2: it keeps its id inside text vLLM tokenizes whole
ENGINE = dict(dtype="float32", max_model_len=4096, enforce_eager=True, enable_prefix_caching=False)


@pytest.fixture(scope="session")
def folder():
    return hf_folder(MODEL)


@pytest.fixture(scope="session")
def store_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kvblend-disk")


@pytest.fixture(scope="session")
def connector_config(store_dir):
    # A Redis that nobody serves: every request meets an unreachable shared tier and must not notice.
    return {"kv_connector": "KVBlendConnector", "kv_connector_module_path": "kvblend.vllm", "kv_role": "kv_both",
            "kv_connector_extra_config": {"separator": SEPARATOR, "local_disk": str(store_dir),
                                          "remote_url": f"redis://127.0.0.1:{free_port()}"}}


@pytest.fixture(scope="session")
def plain(folder):
    """vLLM without the connector, in processes of its own (the connector in this one is global)."""
    from vllm import LLM

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    try:
        return LLM(model=str(folder), **ENGINE)
    finally:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


@pytest.fixture(scope="session")
def blended(folder, connector_config, plain):  # after `plain`: both live in this process
    from vllm import LLM

    return LLM(model=str(folder), kv_transfer_config=connector_config, **ENGINE)


@pytest.fixture(scope="session")
def worker(blended):
    """The worker side of the connector (its engine, counters and the jobs it loaded)."""
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group

    side = get_kv_transfer_group().worker_side
    if side.engine is None:  # built at the first blended request, on the model vLLM loaded
        blended.generate([f"Notes.{SEPARATOR}A short passage to start with.{SEPARATOR}Why?"],
                         SamplingParams(max_tokens=1), use_tqdm=False)
    assert side.engine is not None
    return side


@pytest.fixture(scope="session")
def tokenizer(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)
