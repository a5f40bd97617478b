"""Build a transformers model from safetensors files one tensor at a time, casting each to the
activation dtype and quantizing each decoder layer as soon as it is whole.

transformers' own loader maps whole files: every page of a cached fp32 folder it reads stays
resident until the end, so a bf16 0.5B model peaked near 4 GB to hold 1.3. Here the model is built
with empty (untouched, so not resident) tensors, each tensor is copied in from a file opened for
that tensor or for a block of its rows and closed again, and a quantized layer's linears are built
from the files' weights, their dense tensors never filled: the peak stays near the loaded model
plus one tensor. An untied input embedding is not loaded at all but read from the file row by row
(file_embedding.py).
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from .file_embedding import embed_from_file
from .weights import HELD_DTYPES, QUANTIZED, WidenedEmbedding, WidenedLinear, quantized_linear, quantized_paths

BLOCK_BYTES = 64 << 20  # a large tensor (embedding, output head) is read in blocks of rows this big
LAYER = re.compile(r"\.layers\.(\d+)\.")


def _tensor_files(folder: Path) -> dict[str, Path]:
    where = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                where[name] = path
    return where


def _copy_in(path: Path, name: str, dest: torch.Tensor) -> None:
    """dest <- the file's tensor, cast; a large one a block of rows at a time, the file closed
    after each block so that its pages leave this process."""
    rows = dest.shape[0] if dest.dim() > 1 else 1
    step = rows if dest.numel() * 4 <= BLOCK_BYTES else max(1, BLOCK_BYTES * rows // (dest.numel() * 4))
    for start in range(0, rows, step):
        with safe_open(path, framework="pt") as f:
            sl = f.get_slice(name)
            if list(sl.get_shape()) != list(dest.shape):
                raise ValueError(f"{name}: {sl.get_shape()} in {path.name}, {list(dest.shape)} in the model")
            if step == rows:
                dest.copy_(f.get_tensor(name))
            else:
                dest[start:start + step].copy_(sl[start:start + step])


def _read(path: Path, name: str) -> torch.Tensor:
    with safe_open(path, framework="pt") as f:
        return f.get_tensor(name)


def _quantize_from_files(prefix: str, layer: torch.nn.Module, files: dict[str, Path], weights: str,
                         dtype: torch.dtype) -> set[str]:
    """Build the layer's quantized linears straight from the files' (fp32) weights, so their dense
    tensors are never filled; the names of the parameters this covered."""
    covered = set()
    for path in quantized_paths(layer, weights):
        lin = layer.get_submodule(path)
        names = [f"{prefix}.{path}.{p}" for p, t in lin.named_parameters() if t is not None]
        if not all(n in files for n in names):
            continue
        w = _read(files[f"{prefix}.{path}.weight"], f"{prefix}.{path}.weight")
        b = _read(files[f"{prefix}.{path}.bias"], f"{prefix}.{path}.bias") if lin.bias is not None else None
        parent, _, attr = path.rpartition(".")
        setattr(layer.get_submodule(parent), attr, quantized_linear(weights, w, b, dtype))
        covered.update(names)
    return covered


def _read_held(files: dict[str, Path], name: str, shape: torch.Size, held: torch.dtype) -> torch.Tensor:
    table = torch.empty(shape, dtype=held)
    _copy_in(files[name], name, table)
    return table


def _hold_ends(hf: torch.nn.Module, params: dict[str, torch.nn.Parameter], files: dict[str, Path],
               held: torch.dtype) -> None:
    """For the held formats: the input embedding and the output head held in `held`, read from the
    files (a tied head shares the embedding's table), their parameters taken out of `params` so the
    fp32 tensors are never filled. An embedding of another kind (Gemma's scales its rows) stays
    fp32, and so does a head tied to it."""
    embed, head = hf.get_input_embeddings(), hf.get_output_embeddings()
    embed_weight = getattr(embed, "weight", None)  # none where the embedding is read from its file
    names = {id(p): n for n, p in params.items() if n in files}  # a tied tensor by its name in the files
    table = None
    if type(embed) is torch.nn.Embedding and embed.max_norm is None and id(embed.weight) in names:
        table = _read_held(files, names[id(embed.weight)], embed.weight.shape, held)
        hf.set_input_embeddings(WidenedEmbedding(table, held))
    if type(head) is not torch.nn.Linear or head.bias is not None or id(head.weight) not in names:
        head_table = None
    elif head.weight is embed_weight:
        head_table = table
    else:
        head_table = _read_held(files, names[id(head.weight)], head.weight.shape, held)
    if head_table is not None:
        hf.set_output_embeddings(WidenedLinear(head_table, None, held=held))
    taken = {id(embed_weight)} if table is not None else set()
    taken |= {id(head.weight)} if head_table is not None else set()
    for name in [n for n, p in params.items() if id(p) in taken]:
        params.pop(name)


def load_layerwise(folder: Path, config, dtype: torch.dtype, weights: str,
                   progress: bool = True) -> torch.nn.Module | None:
    """The model in `dtype` with its decoder layers in `weights` format, or None where the folder's
    tensors do not name every parameter (the caller then uses transformers' loader)."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    files = _tensor_files(folder)
    if not files:
        return None
    with no_init_weights():
        hf = AutoModelForCausalLM.from_config(config, dtype=dtype)
    hf.tie_weights()  # a tied output head shares the embedding's tensor (from_config leaves it apart)
    params = dict(hf.named_parameters(remove_duplicate=False))
    if {id(params[n]) for n in files if n in params} != {id(p) for p in params.values()}:
        return None
    embed = next(n for n, p in params.items() if p is hf.get_input_embeddings().weight)
    if embed_from_file(hf, files[embed], embed, dtype):
        params.pop(embed)
    if weights in HELD_DTYPES:
        _hold_ends(hf, params, files, HELD_DTYPES[weights])
    by_layer: dict[int, list[str]] = defaultdict(list)
    for name in params:
        m = LAYER.search(name)
        by_layer[int(m.group(1)) if m else -1].append(name)
    done: set[int] = set()
    for layer in tqdm(sorted(by_layer), desc="loading weights", disable=not progress, leave=False):
        names = by_layer[layer]
        if layer >= 0 and weights in QUANTIZED:
            prefix = names[0][: LAYER.search(names[0]).end() - 1]
            covered = _quantize_from_files(prefix, hf.get_submodule(prefix), files, weights, dtype)
            names = [n for n in names if n not in covered]
        for name in names:
            p = params[name]
            if id(p) not in done and name in files:
                _copy_in(files[name], name, p.data)
                done.add(id(p))
    return hf.eval().requires_grad_(False)
