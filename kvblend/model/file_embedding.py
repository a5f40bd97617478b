"""An input embedding read from its file row by row, never held in memory.

A prompt looks up a few thousand of the vocabulary's rows (151,936 on Qwen2.5), yet a loaded
table is resident whole: 272 MB in bf16 on Qwen2.5-Coder-0.5B. Mapping the file instead is not
enough: the page cache holds a file in large folios and a fault maps a whole folio, so ten tokens
of a mapped fp32 table made 14 MiB resident, and an 8k-token prompt 280 MiB. Rows read with
`pread` go through the page cache without entering this process's memory. Each row is cast to the
activation dtype after the lookup, which gives the same values as casting the whole table first
(a cast is elementwise), so outputs are unchanged bit for bit.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch
import torch.nn.functional as F

FILE_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


class FileRows:
    """A 2-D tensor of a safetensors file, read a row at a time."""

    def __init__(self, path: Path, offset: int, shape: list[int], dtype: torch.dtype):
        self.file = open(path, "rb")  # held open: the rows are read for as long as the model lives
        self.offset, self.shape, self.dtype = offset, list(shape), dtype
        self.row_bytes = shape[1] * dtype.itemsize

    def rows(self, ids: list[int]) -> torch.Tensor:
        fd, n = self.file.fileno(), self.row_bytes
        data = b"".join(os.pread(fd, n, self.offset + i * n) for i in ids)
        return torch.frombuffer(bytearray(data), dtype=self.dtype).view(len(ids), self.shape[1])


class FileEmbedding(torch.nn.Module):
    def __init__(self, table: FileRows, dtype: torch.dtype):
        super().__init__()
        self.table, self.dtype = table, dtype  # a plain attribute: .to() and state_dict leave it alone

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        unique, inverse = torch.unique(ids, return_inverse=True)  # each row read once, ascending
        if unique.numel() and (int(unique[0]) < 0 or int(unique[-1]) >= self.table.shape[0]):
            raise IndexError(f"token id out of range for a vocabulary of {self.table.shape[0]}")
        rows = self.table.rows(unique.tolist())
        return F.embedding(inverse, rows).to(self.dtype)


def file_rows(path: Path, name: str) -> FileRows | None:
    """The 2-D tensor `name` of a safetensors file as rows to read, or None where the file does
    not hold it in a dtype read here."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        entry = json.loads(f.read(n)).get(name)
    if entry is None or entry["dtype"] not in FILE_DTYPES or len(entry["shape"]) != 2:
        return None
    return FileRows(path, 8 + n + entry["data_offsets"][0], entry["shape"], FILE_DTYPES[entry["dtype"]])


def embed_from_file(hf: torch.nn.Module, path: Path, name: str, dtype: torch.dtype) -> bool:
    """Swap the model's input embedding for one read from `path` where that is exact: a plain
    embedding whose table the output head does not share (a tied head reads every row)."""
    embed = hf.get_input_embeddings()
    head = hf.get_output_embeddings()
    if type(embed) is not torch.nn.Embedding or embed.max_norm is not None:
        return False  # e.g. Gemma's scales its rows in the table's dtype
    if head is not None and head.weight is embed.weight:
        return False
    table = file_rows(path, name)
    if table is None or table.shape != list(embed.weight.shape):
        return False
    hf.set_input_embeddings(FileEmbedding(table, dtype))
    return True
