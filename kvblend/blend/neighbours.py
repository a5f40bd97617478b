"""Each chunk of a known collection and its most similar other chunk (FusionRAG-style context).

A chunk precomputed after its nearest neighbour stores KV that has already attended to related
text, so it starts closer to the KV full prefill gives it among the chunks it is retrieved with
(docs/experiments.md#chunk-context). Similarity is TF-IDF cosine over token ids: cheap, model-free and
deterministic. A chunk's neighbour is fixed when the chunk is first indexed, so keys of stored KV
stay valid as the collection grows.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from ..store.index_store import write_atomic
from ..store.keys import tokens_hash

FORMAT = "kvblend-neighbours-1"
_BLOCK = 256  # chunks compared at once: bounds the dense similarity block


class NeighbourIndex:
    def __init__(self, chunks: list[list[int]] | None = None, neighbour: list[int] | None = None):
        self.chunks = chunks or []
        self.neighbour = neighbour or []  # index into chunks, or -1: no similar chunk
        self._at = {tokens_hash(c): i for i, c in enumerate(self.chunks)}

    def __len__(self) -> int:
        return len(self.chunks)

    def neighbour_of(self, chunk_ids: Sequence[int]) -> list[int] | None:
        """The neighbour's token ids; None for a chunk outside the collection or without one."""
        i = self._at.get(tokens_hash(chunk_ids))
        j = self.neighbour[i] if i is not None else -1
        return self.chunks[j] if j >= 0 else None

    def add(self, chunks: Iterable[Sequence[int]]) -> int:
        """Index new chunks; each one's neighbour is its most similar other chunk of the whole
        collection, old chunks' neighbours stay as they were. Returns how many were new."""
        new = []
        for c in chunks:
            h = tokens_hash(c)
            if c and h not in self._at:
                self._at[h] = len(self.chunks) + len(new)
                new.append(list(c))
        if not new:
            return 0
        first = len(self.chunks)
        self.chunks += new
        x = _tfidf(self.chunks)
        for a in range(first, len(self.chunks), _BLOCK):
            b = min(a + _BLOCK, len(self.chunks))
            sims = torch.sparse.mm(x, x.index_select(0, torch.arange(a, b)).to_dense().T)  # [all, block]
            sims[torch.arange(a, b), torch.arange(b - a)] = -1.0  # never itself
            best, at = sims.max(0)
            self.neighbour += [int(j) if s > 0 else -1 for s, j in zip(best.tolist(), at.tolist())]
        return len(new)

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "chunks": self.chunks, "neighbour": self.neighbour})

    @classmethod
    def from_json(cls, text: str | bytes, where: str = "neighbour index") -> "NeighbourIndex":
        """Parse and check an index; ValueError naming `where` if it is not a whole, valid one."""
        try:
            data = json.loads(text)
            chunks, neighbour = data["chunks"], data["neighbour"]
            ok = (data.get("format") == FORMAT and len(chunks) == len(neighbour)
                  and all(-1 <= j < len(chunks) for j in neighbour)
                  and all(isinstance(c, list) and all(isinstance(t, int) for t in c) for c in chunks))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"neighbour index {where} cannot be read: {e}") from e
        if not ok:
            raise ValueError(f"neighbour index {where} is not a {FORMAT} file")
        return cls(chunks, neighbour)

    def save(self, path: str | Path) -> None:
        """Write atomically, so a reader never sees half an index."""
        write_atomic(Path(path), self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> "NeighbourIndex":
        try:
            text = Path(path).read_text()
        except (OSError, ValueError) as e:
            raise ValueError(f"neighbour index {path} cannot be read: {e}") from e
        return cls.from_json(text, str(path))


def _tfidf(chunks: list[list[int]]) -> torch.Tensor:
    """Sparse [chunks, vocabulary seen] rows of L2-normalised term frequency x log(N / df)."""
    counts = [Counter(c) for c in chunks]
    df = Counter(t for c in counts for t in c)
    column = {t: i for i, t in enumerate(df)}
    idf = {t: math.log(len(chunks) / n) for t, n in df.items()}
    rows, cols, vals = [], [], []
    for r, c in enumerate(counts):
        w = {t: n * idf[t] for t, n in c.items()}
        norm = math.sqrt(sum(x * x for x in w.values())) or 1.0
        for t, x in w.items():
            rows.append(r)
            cols.append(column[t])
            vals.append(x / norm)
    return torch.sparse_coo_tensor(torch.tensor([rows, cols]), torch.tensor(vals, dtype=torch.float32),
                                   (len(chunks), len(column)), check_invariants=True).coalesce()
