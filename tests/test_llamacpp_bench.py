"""The TTFT benchmark against llama.cpp, its kvblend side on tiny input (llama.cpp is not installed here)."""

import json
import sys
from pathlib import Path

import pytest
import torch
from serving import tiny_engine

from kvblend.eval.datasets import QA, RagRecord

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import llamacpp_bench as bench  # noqa: E402
from long_prompts import prompt_of_length  # noqa: E402

PASSAGES = [" ".join(f"Town {i} lies {j} miles north of the river crossing." for j in range(12)) for i in range(6)]
RECORDS = [RagRecord("Which town lies north?", ["Town 1"], PASSAGES[:3], "f1", QA),
           RagRecord("Which town is last?", ["Town 5"], PASSAGES[3:], "f1", QA)]


def test_prompts_come_out_at_the_asked_length_made_of_whole_passages_then_a_cut_one():
    engine = tiny_engine()
    for n in (150, 400, 700):
        ids = prompt_of_length(engine.tokenizer, engine.sep_ids, RECORDS, n)
        assert abs(len(ids) - n) <= 3
        chunks = engine.segments(ids).chunks
        texts = [engine.tokenizer.decode(ids[a:b]) for a, b in chunks]
        assert texts[:-1] == PASSAGES[:len(texts) - 1]  # passages in file order, across records
        assert PASSAGES[len(texts) - 1].startswith(texts[-1].strip())
    with pytest.raises(ValueError, match="at most"):
        prompt_of_length(engine.tokenizer, engine.sep_ids, RECORDS, 10_000)


def test_every_system_is_timed_on_the_same_prompt_and_blend_reuses_the_stored_chunks(tmp_path, capsys):
    engine = tiny_engine()
    prompts = bench.stored_prompts(engine, RECORDS, [200, 400])
    rows = []
    for ids in prompts:
        row = bench.measure_length(engine, None, ids, repeats=2, n_batches=[512], with_hf=True)
        row["ratios"] = bench.ratios(row)
        rows.append(row)
    systems = ["kvblend full", "kvblend prefix", "kvblend blend", bench.HF]
    for ids, row in zip(prompts, rows):
        assert row["tokens"] == len(ids)
        assert set(row["ttft_s"]) == set(systems) and all(len(v) == 2 for v in row["samples_s"].values())
        assert set(row["cpu_s"]) == set(systems) and all(c > 0 for c in row["cpu_s"].values())
        # full prefill in kvblend and transformers' forward read the same prompt the same way (fp32)
        assert row["first_token"]["kvblend full"] == row["first_token"][bench.HF]
        assert row["ratios"]["kvblend full / kvblend blend"] > 0
    _, out = engine.prefill(prompts[1], "blend")  # the steady state the timings ran in
    assert out.stats.chunk_misses == 0 and out.stats.chunk_hits >= 2 and out.stats.compute_frac < 0.5

    bench.print_table(rows, systems)
    table = capsys.readouterr().out
    assert "| 200 |" in table and "| 400 |" in table and "kvblend blend TTFT s" in table
    png = tmp_path / "ttft.png"
    bench.plot(rows, systems, "tiny", png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class FakeLlama:
    """Stands for the llama.cpp worker: a prefill takes longer the farther n_batch is from 1024."""

    def __init__(self):
        self.calls = []

    def ttft(self, ids, n_batch):
        self.calls.append(n_batch)
        return 1 + abs(n_batch - 1024) / 1024, 2.0, 7


def test_llama_cpp_tries_each_batch_size_once_then_keeps_the_fastest():
    engine = tiny_engine()
    ids = bench.stored_prompts(engine, RECORDS, [400])[0]
    llama = FakeLlama()
    row = bench.measure_length(engine, llama, ids, repeats=3, n_batches=[2048, 256, 1024, 512], with_hf=False)
    # 512 and up all hold the 400-token prompt: only the smallest of them is a different run from 256
    assert llama.calls == [256, 512, 512, 512]
    assert row["llama_n_batch"] == 512 and set(row["llama_round1_by_n_batch_s"]) == {256, 512}
    assert row["samples_s"][bench.LLAMA] == [1.5, 1.5, 1.5] and row["cpu_s"][bench.LLAMA] == 2.0
    assert row["first_token"][bench.LLAMA] == 7
    ratios = bench.ratios(row)
    assert ratios["llama.cpp full / kvblend blend"] == 1.5 / row["ttft_s"]["kvblend blend"]
    assert ratios["llama.cpp full / kvblend full (CPU time)"] == 2.0 / row["cpu_s"]["kvblend full"]


def test_a_llama_python_without_llama_cpp_stops_with_the_workers_own_error(tmp_path):
    with pytest.raises(SystemExit, match="llama_cpp"):
        bench.LlamaWorker(sys.executable, tmp_path / "m.gguf", 1, tmp_path / "worker.log")


def test_the_command_runs_and_says_llama_cpp_was_skipped(tiny_model_folder, tmp_path, capsys):
    data = tmp_path / "rag.json"
    data.write_text(json.dumps([{"question": r.question, "answers": r.answers,
                                 "ctxs": [{"title": "", "text": p} for p in r.passages]} for r in RECORDS]))
    out = tmp_path / "bench.json"
    torch_threads = torch.get_num_threads()
    try:
        report = bench.main(["--model", tiny_model_folder, "--lengths", "128,256", "--repeats", "1", "--threads", "1",
                             "--data", str(data), "--out", str(out), "--dtype", "float32",
                             "--weights", "auto,bf16-fp32"])
    finally:
        torch.set_num_threads(torch_threads)
    assert "llama.cpp skipped: no --llama-python given" in capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved["llama_skipped"] and [r["tokens"] for r in saved["rows"]] == [128, 256]
    assert saved["systems"] == report["systems"] and "llama.cpp full" not in saved["systems"]
    # a second weight format is timed in the same rounds, on the same prompts, its chunks stored too
    assert "kvblend full (bf16-fp32)" in saved["systems"] and "fp32 and bf16-fp32 weights" in saved["dtype"]
    assert all(r["ttft_s"]["kvblend blend (bf16-fp32)"] > 0 for r in saved["rows"])
    with pytest.raises(SystemExit):  # auto is fp32 here: the same format twice
        bench.main(["--model", tiny_model_folder, "--lengths", "128", "--repeats", "1", "--threads", "1",
                    "--data", str(data), "--out", str(out), "--dtype", "float32", "--weights", "auto,fp32"])
    assert Path(saved["plot"]).read_bytes()[:4] == b"\x89PNG"
