"""`kvblend store put|ls|evict|verify|size` and the storage flags."""

from __future__ import annotations

import pytest
from redis_cluster import any_redis, redis_cluster  # noqa: F401  (fixtures)
from test_store_engine import STORED, damage, make_engine

from kvblend.cli import build_parser, main


def filled(tmp_path, url=None):
    engine = make_engine(disk=tmp_path / "kv", redis_url=url, memory=False)
    engine.precompute(STORED)
    engine.close()
    return engine


def test_ls_lists_every_entry_of_every_tier(tmp_path, any_redis, capsys):
    engine = filled(tmp_path, any_redis.url)
    disk_keys = engine.store.tier("disk").keys()
    assert main(["store", "ls", "--local-disk", str(tmp_path / "kv"), "--remote-url", any_redis.url]) == 0
    out = capsys.readouterr().out
    assert f"{2 * len(disk_keys)} entries" in out and out.count("│ disk ") == out.count("│ redis ") == 6
    assert main(["store", "ls", "--tier", "redis", "--local-disk", str(tmp_path / "kv"),
                 "--remote-url", any_redis.url]) == 0
    assert "6 entries" in capsys.readouterr().out


def test_verify_and_evict_a_redis_tier(tmp_path, any_redis, capsys):
    engine = filled(tmp_path, any_redis.url)
    keys = engine.store.tier("redis").keys()
    damage(engine, "redis", "corrupt", keys[0])
    url = ["--remote-url", any_redis.url]
    assert main(["store", "verify", *url]) == 1
    assert "5 good, 1 bad (deleted)" in capsys.readouterr().out
    assert main(["store", "verify", *url]) == 0 and "5 good, 0 bad" in capsys.readouterr().out
    chunk = next(k for k in keys[1:] if k.startswith("chunk-"))
    assert main(["store", "evict", chunk[:20], *url]) == 0 and "evicted 1 entries" in capsys.readouterr().out
    assert main(["store", "evict", "--all", *url]) == 0 and "evicted 4 entries" in capsys.readouterr().out
    assert engine.store.tier("redis").keys() == []


def test_verify_deletes_bad_entries_and_keeps_good_ones(tmp_path, capsys):
    engine = filled(tmp_path)
    keys = engine.store.tier("disk").keys()
    damage(engine, "disk", "corrupt", keys[0])
    damage(engine, "disk", "truncate", keys[1])
    assert main(["store", "verify", "--local-disk", str(tmp_path / "kv")]) == 1  # a script sees the fault
    out = capsys.readouterr().out
    assert "4 good, 2 bad (deleted)" in out and "checksum mismatch" in out
    assert sorted(p.stem for p in (tmp_path / "kv").iterdir()) == sorted(keys[2:])
    assert main(["store", "verify", "--local-disk", str(tmp_path / "kv")]) == 0  # what is left is good
    assert "4 good, 0 bad" in capsys.readouterr().out


def test_evict_by_prefix_and_all(tmp_path, capsys):
    engine = filled(tmp_path)
    chunk = next(k for k in engine.store.tier("disk").keys() if k.startswith("chunk-"))
    assert main(["store", "evict", chunk[:20], "--local-disk", str(tmp_path / "kv")]) == 0
    assert "evicted 1 entries" in capsys.readouterr().out
    assert main(["store", "evict", "--all", "--local-disk", str(tmp_path / "kv")]) == 0
    assert "evicted 5 entries" in capsys.readouterr().out and not list((tmp_path / "kv").iterdir())


def test_store_commands_need_a_persistent_tier_and_a_choice(tmp_path, capsys):
    assert main(["store", "ls"]) == 2
    assert "no persistent tier" in capsys.readouterr().err
    assert main(["store", "evict", "--local-disk", str(tmp_path)]) == 2
    assert "--all" in capsys.readouterr().err
    assert main(["store", "ls", "--remote-url", "lm://host:1"]) == 2
    assert "redis://" in capsys.readouterr().err


def test_storage_flags_reach_the_settings():
    from kvblend.cli import _settings

    args = build_parser().parse_args(["generate", "--prompt", "x", "--no-local-cpu", "--local-disk", "/tmp/kv",
                                      "--max-local-disk-size", "2", "--remote-url", "redis://h:1",
                                      "--remote-ttl", "60", "--prefetch-depth", "3", "--no-layerwise",
                                      "--remote-cluster"])
    s = _settings(args)
    assert (s.local_cpu, s.local_disk, s.max_local_disk_size, s.remote_url) == (False, "/tmp/kv", 2.0, "redis://h:1")
    assert s.remote_cluster and not _settings(build_parser().parse_args(["generate", "--prompt", "x"])).remote_cluster
    assert (s.remote_ttl, s.prefetch_depth, s.layerwise) == (60, 3, False)


@pytest.mark.parametrize("file_end", ["", "\n", "\r\n\n"])
def test_put_precomputes_documents_into_the_disk_tier(tiny_model_folder, tmp_path, capsys, file_end):
    texts = ["Marrowick is a town on the Tesk river.", "The Tesk rises in the Ollin hills."]
    docs = []
    for i, text in enumerate(texts):
        docs.append(tmp_path / f"d{i}.txt")
        docs[-1].write_bytes((text + file_end).encode())  # an editor's trailing newline is no part of it
    kv = tmp_path / "kv"
    assert main(["store", "put", *map(str, docs), "--model", tiny_model_folder, "--local-disk", str(kv),
                 "--no-local-cpu"]) == 0
    assert "stored 2 new chunks" in capsys.readouterr().out
    assert main(["store", "verify", "--local-disk", str(kv)]) == 0
    out = capsys.readouterr().out
    assert "0 bad" in out and int(out.split(" good")[0].split()[-1]) >= 3  # 2 chunks + prefix blocks
    # A request for those documents now reads them from disk (the first as exact prefix blocks).
    from kvblend.api import LLM, SamplingParams

    llm = LLM(model=tiny_model_folder, local_disk=str(kv), local_cpu=False)
    out = llm.generate("Where does the Tesk rise?", SamplingParams(max_tokens=2),
                       documents=texts)[0]
    assert out.metrics.chunk_tiers == ["prefix", "disk"] and out.metrics.prefix_hit_tokens > 0


@pytest.mark.parametrize("yaml_text, field, value", [
    ("local_disk: /tmp/kvb\nmax_local_disk_size: 1.5\n", "max_local_disk_size", 1.5),
    ("remote_url: redis://127.0.0.1:6390\nremote_ttl: 30\n", "remote_ttl", 30),
])
def test_storage_settings_from_yaml(tmp_path, yaml_text, field, value):
    from kvblend.config import load_settings

    path = tmp_path / "c.yaml"
    path.write_text(yaml_text)
    assert getattr(load_settings(path), field) == value


def test_put_precomputes_a_dataset_as_eval_lays_it_out(tiny_model_folder, tmp_path, capsys):
    from test_cli import _tiny_dataset

    data = tmp_path / "tiny.json"
    _tiny_dataset(data)
    kv = tmp_path / "kv"
    assert main(["store", "put", "--data", str(data), "--model", tiny_model_folder, "--local-disk", str(kv),
                 "--no-local-cpu"]) == 0
    stored = int(capsys.readouterr().out.split("stored ")[1].split()[0])
    assert stored >= 2
    assert main(["store", "ls", "--local-disk", str(kv)]) == 0
    assert f"{len(list(kv.glob('*.safetensors')))} entries" in capsys.readouterr().out
    assert (kv / "neighbours.json").exists()  # the dataset is the collection its chunks are indexed over


def test_size_reports_what_an_entry_takes_per_token(tmp_path, capsys):
    """The bytes per token `store size` prints are what the tiers write for that model's chunks."""
    from test_store_engine import make_engine as tiny_engine_of
    from tiny_models import tiny_hf

    from kvblend.store.sizing import Shape, entry_bytes

    folder = tmp_path / "tiny"
    tiny_hf("llama").save_pretrained(folder)
    assert main(["store", "size", "--model", str(folder), "--dtype", "float32", "--chunk-tokens", "24",
                 "--tokens", "1000000"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    engine = tiny_engine_of(disk=tmp_path / "kv", memory=False)
    r = engine.runner
    shape = Shape(r.n_layers, r.n_kv_heads, r.head_dim)
    for label, quant in (("float32", ""), ("bfloat16 (kv_half)", "bf16"), ("int8 (kv_int8)", "int8")):
        per_token = [f"{entry_bytes(shape, 'float32', quant, c, 24) / 24:,.0f}" for c in (False, True)]
        assert f"│ {label} │ {per_token[0]} │ {per_token[1]} │" in out, out
    # A real chunk of 24 tokens written to disk: its file holds what the table counts, give or take
    # safetensors' own header (tensor names and offsets).
    engine.precompute(STORED)
    engine.store.flush()
    chunk = next(k for k in engine.store.tier("disk").keys() if k.startswith("chunk-"))
    meta = engine.store.tier("disk").header(chunk)
    size = engine.store.tier("disk").path(chunk).stat().st_size
    counted = entry_bytes(shape, "float32", meta.quant, bool(meta.probe), meta.n_tokens)
    assert counted <= size <= counted + 100 * (2 + 4 * bool(meta.probe)) * shape.n_layers
    assert "1,000,000 tokens stored as int8" in out
    with pytest.raises(SystemExit):
        main(["store", "size", "--dtype", "float64"])
