"""The folder another engine (vLLM) loads, and the keys it must share with kvblend: the dequantized
Hugging Face folder of a shipped model, the alias it came from, the fingerprint without loading."""

import pytest
import torch

from kvblend.cli import main
from kvblend.model.loader import alias_of_folder, cache_dir, dense_fingerprint, hf_folder

pytestmark = pytest.mark.real_model
NAME = "smollm2-135m-instruct"


def test_dense_fingerprint_is_load_models(default_fp32):
    assert dense_fingerprint(NAME, torch.float32) == default_fp32.fingerprint
    assert dense_fingerprint(NAME, torch.bfloat16) != default_fp32.fingerprint


def test_the_folder_names_its_alias(tmp_path):
    folder = hf_folder(NAME)
    assert (folder / "config.json").is_file() and folder.parent == cache_dir() / "models"
    assert alias_of_folder(folder) == NAME
    assert hf_folder(str(folder)) == folder  # a folder is its own
    assert alias_of_folder(tmp_path) is None  # outside the cache: no alias
    assert dense_fingerprint(str(folder), torch.float32) != dense_fingerprint(NAME, torch.float32)  # keyed as given


def test_kvblend_folder_prints_it(capsys):
    assert main(["folder", NAME]) == 0
    assert capsys.readouterr().out.strip() == str(hf_folder(NAME))


def test_loads_of_a_new_gguf_at_once_convert_it_once(tmp_path, monkeypatch):
    """Two loads of a GGUF not converted yet: one converts, the other waits and takes its folder."""
    import threading
    import time

    from kvblend.model import loader

    monkeypatch.setenv("KVBLEND_CACHE_DIR", str(tmp_path))
    converted = []

    def convert(gguf, folder):  # stands in for the dequantization: slow, then a whole folder
        converted.append(folder)
        time.sleep(0.5)
        folder.mkdir()
        (folder / "config.json").write_text("{}")
        (folder / "model.safetensors").write_bytes(b"")

    monkeypatch.setattr(loader, "_convert_gguf", convert)
    got = []
    loads = [threading.Thread(target=lambda: got.append(loader._gguf_as_folder(tmp_path / "m.gguf", "ab" * 16)))
             for _ in range(2)]
    for t in loads:
        t.start()
    for t in loads:
        t.join()
    assert len(converted) == 1 and got == [converted[0]] * 2


def test_a_conversion_parses_its_gguf_once_and_writes_the_same_folder(tmp_path, monkeypatch):
    """transformers reads a GGUF for the config, the tokenizer and the weights; each parse of a large
    vocabulary takes seconds, so a conversion shares one reader (and parses strings and maps tensor names
    faster). The folder is the one converted before, byte for byte."""
    import gguf
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    from kvblend.model import loader

    parses = []
    reader, parse = gguf.GGUFReader, gguf.GGUFReader.__init__
    swapped = gguf.get_tensor_name_map, hf_gguf._gguf_parse_value

    def counted(self, path, mode="r"):
        parses.append(path)
        parse(self, path, mode)

    monkeypatch.setattr(gguf.GGUFReader, "__init__", counted)
    path = loader.resolve_model_path(NAME)
    loader._convert_gguf(path, tmp_path / "m")
    assert len(parses) == 1 and gguf.GGUFReader is reader  # shared while converting, then given back
    assert (gguf.get_tensor_name_map, hf_gguf._gguf_parse_value) == swapped
    before = hf_folder(NAME)
    for name in ("model.safetensors", "tokenizer.json"):
        assert (tmp_path / "m" / name).read_bytes() == (before / name).read_bytes(), name
