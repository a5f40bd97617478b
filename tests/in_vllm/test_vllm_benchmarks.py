"""The vLLM benchmarks the docs cite run as written, with tiny inputs; nothing reads their timings or
scores, so they serve a tiny random Llama with SmolLM2's tokenizer (its separator included): vLLM and
kvblend run the same code paths as on a real model, at a hundredth of its compute."""

import json
import os
from pathlib import Path

import pytest
from warm_python import WarmPython

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, tokenizer) -> str:
    """Two layers, hidden size 128, one KV head of 64 dimensions (a head size vLLM's CPU attention takes)."""
    from tiny_models import tiny_hf

    folder = tmp_path_factory.mktemp("model") / "tiny-llama"
    tiny_hf("llama", vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=8192).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def tiny_data(tmp_path: Path) -> Path:
    """Two records of the CacheBlend format, from the demo's passages."""
    from importlib import resources

    demo = json.loads(resources.files("kvblend.demo").joinpath("passages.json").read_text())
    records = [{"question": q["question"], "answers": [q["answer"]],
                "ctxs": [{"title": "", "text": demo["passages"][i]} for i in q["passages"]]}
               for q in demo["questions"][:2]]
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(records))
    return path


def script_env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # as users run them
    return env


@pytest.fixture(scope="module")
def run():
    """Runs a benchmark script in a fork of an interpreter that has imported vLLM and kvblend (warm_python.py);
    the engines it starts are processes of their own, as vLLM starts them."""
    python = WarmPython(script_env(), preload="import vllm, kvblend.vllm, kvblend.eval.harness")

    def run_script(script: str, *args: str) -> None:
        proc = python.run([str(ROOT / "benchmarks" / script), *args], ROOT, script_env(), timeout=900)
        assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"

    yield run_script
    python.close()


def test_vllm_bench(run, tiny_model, tmp_path):
    out = tmp_path / "bench.json"
    run("vllm_bench.py", "--model", tiny_model, "--data", str(tiny_data(tmp_path)),
        "--lengths", "200", "--repeats", "1", "--quality-limit", "1", "--out", str(out))
    report = json.loads(out.read_text())
    assert set(report["rows"][0]["ttft_s"]) == {"vllm", "vllm+kvblend", "kvblend full", "kvblend blend"}
    assert len(report["quality"]["per_record"]) == 1


def test_vllm_serve_bench(run, tiny_model, tmp_path):
    out = tmp_path / "serve.json"
    run("vllm_serve_bench.py", "--model", tiny_model, "--data", str(tiny_data(tmp_path)),
        "--requests", "2", "--concurrency", "2", "--max-tokens", "4", "--out", str(out))
    report = json.loads(out.read_text())
    assert set(report["runs"]) == {"vllm", "vllm+kvblend"}
    assert all(run["requests"] == 2 for run in report["runs"].values())
