"""An input embedding read straight from its file's pages.

A prompt looks up a few thousand of the vocabulary's rows (151,936 on Qwen2.5), yet a loaded
table is resident whole: 272 MB in bf16 on Qwen2.5-Coder-0.5B. Mapped from the safetensors file,
only the pages of rows looked up are ever read in, and the kernel can drop them again. Each row is
cast to the activation dtype after the lookup, which gives the same values as casting the whole
table first (a cast is elementwise), so outputs are unchanged bit for bit.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import torch
import torch.nn.functional as F

FILE_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


class MappedEmbedding(torch.nn.Module):
    def __init__(self, table: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        self.table, self.dtype = table, dtype  # a plain attribute: .to() and state_dict leave it alone

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.table).to(self.dtype)


def mapped_table(path: Path, name: str) -> torch.Tensor | None:
    """The tensor `name` of a safetensors file as a view of the file's pages (copy-on-write, so
    never written back), or None where the file does not hold it in a dtype read here."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        entry = json.loads(f.read(n)).get(name)
        if entry is None or entry["dtype"] not in FILE_DTYPES:
            return None
        pages = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # the mapping outlives the file handle
    begin, end = entry["data_offsets"]
    dtype = FILE_DTYPES[entry["dtype"]]
    flat = torch.frombuffer(pages, dtype=dtype, count=(end - begin) // dtype.itemsize, offset=8 + n + begin)
    return flat.view(entry["shape"])


def map_embedding(hf: torch.nn.Module, path: Path, name: str, dtype: torch.dtype) -> bool:
    """Swap the model's input embedding for one mapped from `path` where that is exact: a plain
    embedding whose table the output head does not share (a tied head reads every row)."""
    embed = hf.get_input_embeddings()
    head = hf.get_output_embeddings()
    if type(embed) is not torch.nn.Embedding or embed.max_norm is not None:
        return False  # e.g. Gemma's scales its rows in the table's dtype
    if head is not None and head.weight is embed.weight:
        return False
    table = mapped_table(path, name)
    if table is None or list(table.shape) != list(embed.weight.shape):
        return False
    hf.set_input_embeddings(MappedEmbedding(table, dtype))
    return True
