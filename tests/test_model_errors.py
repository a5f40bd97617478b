"""Model names, paths and architectures that cannot be served fail with a clear message."""

import json

import pytest
import torch
from tiny_models import tiny_hf

from kvblend.model.loader import (ModelLoadError, auto_dtype, fingerprint, load_model, resolve_model_path,
                                  weights_identity)


def test_unknown_model_name():
    with pytest.raises(ModelLoadError, match="unknown model 'no-such-model'"):
        load_model("no-such-model")


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_model_path(str(tmp_path))


def test_file_that_is_not_gguf(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        resolve_model_path(str(f))


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1}))
    (tmp_path / "model.safetensors").write_bytes(b"0" * 16)
    with pytest.raises(ModelLoadError, match="'gpt2'.*supported: llama, mistral, qwen2, qwen3"):
        load_model(str(tmp_path))


def test_gemma3_variants_the_runner_cannot_run_are_refused():
    from kvblend.model.loader import from_hf

    with pytest.raises(ModelLoadError, match="soft-caps attention logits"):
        from_hf(tiny_hf("gemma3", attn_logit_softcapping=50.0))
    with pytest.raises(ModelLoadError, match="bidirectional"):
        from_hf(tiny_hf("gemma3", use_bidirectional_attention=True))


def test_safetensors_folder_loads_and_fingerprint_tracks_weights_and_dtype(tmp_path):
    hf = tiny_hf("qwen2")
    hf.save_pretrained(tmp_path / "a")
    m32 = load_model(str(tmp_path / "a"), dtype="float32", device="cpu")
    ids = torch.arange(1, 20)[None]
    torch.testing.assert_close(m32.hf(ids).logits, hf(ids).logits)
    assert load_model(str(tmp_path / "a"), dtype="float32").fingerprint == m32.fingerprint
    assert load_model(str(tmp_path / "a"), dtype="bfloat16").fingerprint != m32.fingerprint
    tiny_hf("qwen2", seed=1).save_pretrained(tmp_path / "b")
    assert load_model(str(tmp_path / "b"), dtype="float32").fingerprint != m32.fingerprint
    assert weights_identity(tmp_path / "a") != weights_identity(tmp_path / "b")
    assert fingerprint(hf.config, "w", torch.float32) != fingerprint(tiny_hf("llama").config, "w", torch.float32)


def test_dtype_choices():
    cpu = torch.device("cpu")
    assert auto_dtype("float32", cpu) == torch.float32
    assert auto_dtype("bf16", cpu) == torch.bfloat16
    assert auto_dtype("auto", cpu) in (torch.float32, torch.bfloat16)
    with pytest.raises(ModelLoadError, match="unknown dtype"):
        auto_dtype("float8", cpu)


@pytest.mark.parametrize("flags,capability,want", [
    ({"avx2", "amx_bf16"}, "AVX512", torch.bfloat16), ({"avx2", "avx512_bf16"}, "AVX512", torch.bfloat16),
    ({"avx2"}, "AVX2", torch.float32),
    ({"avx2", "amx_bf16"}, "AVX2", torch.float32),  # ATEN_CPU_CAPABILITY=avx2: torch's kernels lack bf16
    ({"avx2", "amx_bf16"}, "DEFAULT", torch.float32)])
def test_auto_dtype_follows_the_cpu_and_torch_kernels(monkeypatch, flags, capability, want):
    import kvblend.model.loader as loader
    monkeypatch.setattr(loader, "cpu_flags", lambda: flags)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    assert auto_dtype("auto", torch.device("cpu")) == want
