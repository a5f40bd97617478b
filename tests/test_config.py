"""Settings: defaults, the KVBLEND_/LMCACHE_ environment names, YAML, priority, errors."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from kvblend.config import Settings, load_settings


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # The developer's shell may export KVBLEND_*/LMCACHE_* settings: tests must not see them.
    for name in list(os.environ):
        if name.upper().startswith(("KVBLEND_", "LMCACHE_")):
            monkeypatch.delenv(name)


def write_yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvblend.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_defaults() -> None:
    s = Settings()
    assert s.model == "smollm2-135m-instruct"
    assert s.dtype == "auto" and s.device == "auto"
    assert s.mode == "blend"
    assert s.separator == " # # "
    assert s.check_layers == [1]
    assert s.recompute_ratios == [0.08]
    assert s.deviation == "v"
    assert s.check_layer_kv == "fresh"
    assert s.weight_by_attention is True
    assert s.chunk_context == "prefix"
    assert s.layerwise is True
    assert s.namespace == "default"
    assert s.chunk_size == 256
    assert s.local_cpu is True
    assert s.max_local_cpu_size == 4.0
    assert s.local_disk is None
    assert s.max_local_disk_size == 20.0
    assert s.remote_url is None
    assert s.max_model_len is None
    assert s.seed == 0
    assert load_settings() == s


@pytest.mark.parametrize(
    ("env_name", "raw", "field", "expected"),
    [
        ("LMCACHE_ENABLE_BLENDING", "true", "mode", "blend"),
        ("LMCACHE_ENABLE_BLENDING", "False", "mode", "full"),
        ("LMCACHE_BLEND_SPECIAL_STR", " ## ", "separator", " ## "),
        ("LMCACHE_BLEND_CHECK_LAYERS", "1", "check_layers", [1]),
        ("LMCACHE_BLEND_CHECK_LAYERS", "1,5", "check_layers", [1, 5]),
        ("LMCACHE_BLEND_CHECK_LAYERS", "[1, 5]", "check_layers", [1, 5]),
        ("LMCACHE_BLEND_RECOMPUTE_RATIOS", "0.3", "recompute_ratios", [0.3]),
        ("LMCACHE_USE_LAYERWISE", "false", "layerwise", False),
        ("LMCACHE_CHUNK_SIZE", "128", "chunk_size", 128),
        ("LMCACHE_LOCAL_CPU", "False", "local_cpu", False),
        ("LMCACHE_MAX_LOCAL_CPU_SIZE", "2.5", "max_local_cpu_size", 2.5),
        ("LMCACHE_LOCAL_DISK", "file:///tmp/kv/", "local_disk", "/tmp/kv/"),
        ("LMCACHE_LOCAL_DISK", "/tmp/kv", "local_disk", "/tmp/kv"),
        ("LMCACHE_MAX_LOCAL_DISK_SIZE", "5", "max_local_disk_size", 5.0),
        ("LMCACHE_REMOTE_URL", "redis://host:6379", "remote_url", "redis://host:6379"),
    ],
)
def test_lmcache_names(monkeypatch: pytest.MonkeyPatch, env_name: str, raw: str, field: str, expected: object) -> None:
    monkeypatch.setenv(env_name, raw)
    assert getattr(Settings(), field) == expected


def test_lmcache_layers_and_ratios_together(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMCACHE_BLEND_CHECK_LAYERS", "[1, 5]")
    monkeypatch.setenv("LMCACHE_BLEND_RECOMPUTE_RATIOS", "[0.3, 0.1]")
    s = Settings()
    assert s.check_layers == [1, 5]
    assert s.recompute_ratios == [0.3, 0.1]


@pytest.mark.parametrize(
    ("env_name", "raw", "field", "expected"),
    [
        ("KVBLEND_MODEL", "my-model", "model", "my-model"),
        ("KVBLEND_DTYPE", "bfloat16", "dtype", "bfloat16"),
        ("KVBLEND_DEVICE", "cpu", "device", "cpu"),
        ("KVBLEND_MODE", "reuse", "mode", "reuse"),
        ("KVBLEND_SEPARATOR", "<sep>", "separator", "<sep>"),
        ("KVBLEND_CHECK_LAYERS", "2,4", "check_layers", [2, 4]),
        ("KVBLEND_RECOMPUTE_RATIOS", "0.2", "recompute_ratios", [0.2]),
        ("KVBLEND_BLEND_RATIOS", "0.25", "recompute_ratios", [0.25]),
        ("KVBLEND_DEVIATION", "kv", "deviation", "kv"),
        ("KVBLEND_CHECK_LAYER_KV", "cached", "check_layer_kv", "cached"),
        ("KVBLEND_WEIGHT_BY_ATTENTION", "off", "weight_by_attention", False),
        ("KVBLEND_CHUNK_CONTEXT", "bos", "chunk_context", "bos"),
        ("KVBLEND_LAYERWISE", "0", "layerwise", False),
        ("KVBLEND_NAMESPACE", "team-a", "namespace", "team-a"),
        ("KVBLEND_CHUNK_SIZE", "64", "chunk_size", 64),
        ("KVBLEND_LOCAL_CPU", "no", "local_cpu", False),
        ("KVBLEND_MAX_LOCAL_CPU_SIZE", "1.5", "max_local_cpu_size", 1.5),
        ("KVBLEND_LOCAL_DISK", "/data/kv", "local_disk", "/data/kv"),
        ("KVBLEND_MAX_LOCAL_DISK_SIZE", "8", "max_local_disk_size", 8.0),
        ("KVBLEND_REMOTE_URL", "redis://r:1", "remote_url", "redis://r:1"),
        ("KVBLEND_MAX_MODEL_LEN", "4096", "max_model_len", 4096),
        ("KVBLEND_SEED", "7", "seed", 7),
        ("kvblend_model", "lower-case", "model", "lower-case"),
    ],
)
def test_kvblend_names(monkeypatch: pytest.MonkeyPatch, env_name: str, raw: str, field: str, expected: object) -> None:
    monkeypatch.setenv(env_name, raw)
    assert getattr(Settings(), field) == expected


def test_empty_env_var_means_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVBLEND_MAX_MODEL_LEN", "")
    assert Settings().max_model_len is None


@pytest.mark.parametrize(
    ("kvblend", "lmcache", "field", "expected"),
    [
        (("KVBLEND_MODE", "reuse"), ("LMCACHE_ENABLE_BLENDING", "true"), "mode", "reuse"),
        (("KVBLEND_CHECK_LAYERS", "3"), ("LMCACHE_BLEND_CHECK_LAYERS", "1"), "check_layers", [3]),
        (("KVBLEND_RECOMPUTE_RATIOS", "0.5"), ("LMCACHE_BLEND_RECOMPUTE_RATIOS", "0.1"), "recompute_ratios", [0.5]),
        (("KVBLEND_CHUNK_SIZE", "32"), ("LMCACHE_CHUNK_SIZE", "512"), "chunk_size", 32),
        (("KVBLEND_REMOTE_URL", "redis://a:1"), ("LMCACHE_REMOTE_URL", "redis://b:2"), "remote_url", "redis://a:1"),
    ],
)
def test_kvblend_name_beats_lmcache_name(
    monkeypatch: pytest.MonkeyPatch,
    kvblend: tuple[str, str],
    lmcache: tuple[str, str],
    field: str,
    expected: object,
) -> None:
    monkeypatch.setenv(*kvblend)
    monkeypatch.setenv(*lmcache)
    assert getattr(Settings(), field) == expected


def test_unprefixed_env_is_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    # populate_by_name must not make bare names like CHECK_LAYERS or MODEL count.
    monkeypatch.setenv("CHECK_LAYERS", "7")
    monkeypatch.setenv("MODEL", "other")
    s = Settings()
    assert s.check_layers == [1]
    assert s.model == "smollm2-135m-instruct"


def test_init_kwargs_by_field_name() -> None:
    s = Settings(check_layers=[1, 4], recompute_ratios="0.4, 0.2", mode="reuse")
    assert s.check_layers == [1, 4]
    assert s.recompute_ratios == [0.4, 0.2]
    assert s.mode == "reuse"


def test_single_ratio_broadcasts() -> None:
    s = Settings(check_layers=[1, 3, 5], recompute_ratios=[0.2])
    assert s.recompute_ratios == [0.2, 0.2, 0.2]


def test_yaml_loading(tmp_path: Path) -> None:
    path = write_yaml(
        tmp_path,
        "model: tiny\ncheck_layers: [1, 2]\nrecompute_ratios: [0.3, 0.2]\nlocal_disk: file:///tmp/y/\n",
    )
    s = load_settings(path)
    assert s.model == "tiny"
    assert s.check_layers == [1, 2]
    assert s.recompute_ratios == [0.3, 0.2]
    assert s.local_disk == "/tmp/y/"
    assert s.chunk_size == 256  # not in the file: default


def test_yaml_does_not_leak_into_later_settings(tmp_path: Path) -> None:
    load_settings(write_yaml(tmp_path, "model: tiny\n"))
    assert Settings().model == "smollm2-135m-instruct"


def test_empty_yaml_is_defaults(tmp_path: Path) -> None:
    assert load_settings(write_yaml(tmp_path, "")) == Settings()


def test_priority_init_env_yaml_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_yaml(tmp_path, "model: from-yaml\nnamespace: from-yaml\nseed: 3\n")
    monkeypatch.setenv("KVBLEND_MODEL", "from-env")
    monkeypatch.setenv("KVBLEND_NAMESPACE", "from-env")
    s = load_settings(path, model="from-init", seed=None)
    assert s.model == "from-init"  # init > env > yaml
    assert s.namespace == "from-env"  # env > yaml
    assert s.seed == 3  # yaml > default; the None override is ignored
    assert s.chunk_size == 256  # default


def test_lmcache_env_beats_yaml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMCACHE_CHUNK_SIZE", "64")
    assert load_settings(write_yaml(tmp_path, "chunk_size: 512\n")).chunk_size == 64


def test_none_overrides_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVBLEND_MODE", "prefix")
    assert load_settings(mode=None, dtype=None).mode == "prefix"


def test_unknown_yaml_key(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="chunk_sise"):
        load_settings(write_yaml(tmp_path, "chunk_sise: 10\n"))


def test_yaml_not_a_mapping(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="mapping"):
        load_settings(write_yaml(tmp_path, "- a\n- b\n"))


def test_missing_yaml(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_settings(tmp_path / "nope.yaml")


def test_invalid_value_in_yaml(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="chunk_size"):
        load_settings(write_yaml(tmp_path, "chunk_size: 0\n"))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"recompute_ratios": [-0.1]}, "recompute_ratios"),
        ({"recompute_ratios": [1.5]}, "recompute_ratios"),
        ({"check_layers": [1, 2], "recompute_ratios": [0.1, 0.3]}, "recompute_ratios"),  # increasing
        ({"check_layers": [1, 2, 3], "recompute_ratios": [0.3, 0.1]}, "recompute_ratios"),  # length mismatch
        ({"check_layers": [5, 1]}, "check_layers"),
        ({"check_layers": [-1]}, "check_layers"),
        ({"check_layers": "x"}, "check_layers"),
        ({"mode": "turbo"}, "mode"),
        ({"dtype": "int8"}, "dtype"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"max_local_cpu_size": -1}, "max_local_cpu_size"),
        ({"separator": ""}, "separator"),
        ({"no_such_field": 1}, "no_such_field"),
    ],
)
def test_bad_values_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        Settings(**kwargs)


def test_bad_env_value_names_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMCACHE_BLEND_RECOMPUTE_RATIOS", "0.1,0.5")
    monkeypatch.setenv("LMCACHE_BLEND_CHECK_LAYERS", "1,2")
    with pytest.raises(ValidationError, match="recompute_ratios"):
        Settings()
