"""Each chunk of a known collection and its most similar other chunks (FusionRAG-style context).

A chunk precomputed after its nearest neighbour stores KV that has already attended to related
text, so it starts closer to the KV full prefill gives it among the chunks it is retrieved with
(docs/experiments.md#chunk-context). Similarity is TF-IDF cosine over token ids: cheap, model-free and
deterministic. A chunk may also be precomputed after a few more of its nearest chunks (`more`,
chosen when it joins, farthest first, its neighbour last): a longer context like the prompts it
is retrieved into (`neighbour_count`; docs/experiments.md#chunk-context).

The collection grows: when chunks join it, an older chunk for which a much closer chunk arrived
(REENCODE_MARGIN) gets that one as its `pending` neighbour. Lookups keep using `neighbour`, whose
KV is stored, until the chunk's KV after the pending one is stored too (Engine.reencode_neighbours,
in the background); then `promote` switches the chunk to it. A key in use thus always names stored
KV. The file keeps the first format: `pending` and `more` are added fields, an index without them
has none.
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
# Cosine similarity a later chunk must beat a chunk's neighbour by (no neighbour counts as 0) to
# replace it: a switch costs an encode and orphans the old KV, and idf drifts as the collection grows.
REENCODE_MARGIN = 0.1


class NeighbourIndex:
    def __init__(self, chunks: list[list[int]] | None = None, neighbour: list[int] | None = None,
                 pending: list[int] | None = None, more: list[list[int]] | None = None):
        self.chunks = chunks or []
        self.neighbour = neighbour or []  # index into chunks, or -1: no similar chunk
        # A much closer chunk found later, used once the chunk's KV after it is stored; -1: none.
        self.pending = pending or [-1] * len(self.chunks)
        # The next most similar chunks after the neighbour when the chunk joined, nearest first:
        # precomputed before the neighbour, farthest first. Fixed: a switch changes the neighbour only.
        self.more = more or [[] for _ in self.chunks]
        self._at = {tokens_hash(c): i for i, c in enumerate(self.chunks)}

    def __len__(self) -> int:
        return len(self.chunks)

    def neighbour_of(self, chunk_ids: Sequence[int]) -> list[int] | None:
        """The neighbour's token ids; None for a chunk outside the collection or without one."""
        i = self._at.get(tokens_hash(chunk_ids))
        j = self.neighbour[i] if i is not None else -1
        return self.chunks[j] if j >= 0 else None

    def lead_of(self, chunk_ids: Sequence[int]) -> list[list[int]]:
        """The chunks a chunk is precomputed after, farthest first, its neighbour last; [] for a
        chunk outside the collection or without a neighbour."""
        i = self._at.get(tokens_hash(chunk_ids))
        return self._lead(i, self.neighbour[i]) if i is not None else []

    def _lead(self, i: int, neighbour: int) -> list[list[int]]:
        if neighbour < 0:
            return []
        return [self.chunks[j] for j in reversed(self.more[i]) if j != neighbour] + [self.chunks[neighbour]]

    def waiting(self) -> list[tuple[list[int], list[int], list[list[int]]]]:
        """(chunk, its pending neighbour, the lead it would be precomputed after) of each chunk
        whose KV after a closer chunk is not stored yet."""
        return [(self.chunks[i], self.chunks[j], self._lead(i, j)) for i, j in enumerate(self.pending) if j >= 0]

    def promote(self, chunk_ids: Sequence[int], candidate_ids: Sequence[int]) -> bool:
        """The chunk's KV after `candidate_ids` is stored: lookups use that neighbour from now on.
        False when it is no longer the chunk's pending one (another process switched it first, or
        a closer one came since): nothing changes."""
        i, j = self._at.get(tokens_hash(chunk_ids)), self._at.get(tokens_hash(candidate_ids))
        if i is None or j is None or self.pending[i] != j:
            return False
        self.neighbour[i], self.pending[i] = j, -1
        return True

    def add(self, chunks: Iterable[Sequence[int]], count: int = 1) -> int:
        """Index new chunks; each one's neighbour is its most similar other chunk of the whole
        collection, and its `count - 1` next most similar ones are kept as `more`. An old chunk
        keeps its neighbour; a new chunk much closer to it becomes its pending one. Returns how many
        were new."""
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
        self.pending += [-1] * len(new)
        x = _tfidf(self.chunks)
        closest, closest_at = torch.zeros(first), torch.full((first,), -1)  # each old chunk's closest new one
        for a in range(first, len(self.chunks), _BLOCK):
            b = min(a + _BLOCK, len(self.chunks))
            sims = torch.sparse.mm(x, x.index_select(0, torch.arange(a, b)).to_dense().T)  # [all, block]
            sims[torch.arange(a, b), torch.arange(b - a)] = -1.0  # never itself
            best, at = sims.max(0)
            self.neighbour += [int(j) if s > 0 else -1 for s, j in zip(best.tolist(), at.tolist())]
            self.more += _next_nearest(sims, at, count - 1)
            if first:
                best, at = sims[:first].max(1)
                closer = best > closest
                closest, closest_at = torch.where(closer, best, closest), torch.where(closer, at + a, closest_at)
        self._rechoose(x, closest, closest_at)
        return len(new)

    def _rechoose(self, x: torch.Tensor, closest: torch.Tensor, closest_at: torch.Tensor) -> None:
        """Make each old chunk's closest new chunk its pending neighbour where it beats the chunk's
        neighbour by REENCODE_MARGIN and is closer than the chunk's pending one."""
        rows = (closest > REENCODE_MARGIN).nonzero().flatten()
        if not len(rows):
            return
        now = _pair_sims(x, rows, [self.neighbour[i] for i in rows.tolist()])
        waiting = _pair_sims(x, rows, [self.pending[i] for i in rows.tolist()])
        for i, s, j, n, w in zip(rows.tolist(), closest[rows].tolist(), closest_at[rows].tolist(), now, waiting):
            if s > n + REENCODE_MARGIN and s > w:
                self.pending[i] = j

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "chunks": self.chunks, "neighbour": self.neighbour,
                           "pending": self.pending, "more": self.more})

    @classmethod
    def from_json(cls, text: str | bytes, where: str = "neighbour index") -> "NeighbourIndex":
        """Parse and check an index; ValueError naming `where` if it is not a whole, valid one."""
        try:
            data = json.loads(text)
            chunks, neighbour = data["chunks"], data["neighbour"]
            pending = data.get("pending", [-1] * len(chunks))  # an index written before chunks could switch
            more = data.get("more", [[] for _ in chunks])  # one written before chunks had more context
            ok = (data.get("format") == FORMAT and len(chunks) == len(neighbour) == len(pending) == len(more)
                  and all(isinstance(j, int) and -1 <= j < len(chunks) for j in neighbour + pending)
                  and all(isinstance(m, list) and all(isinstance(j, int) and 0 <= j < len(chunks) for j in m)
                          for m in more)
                  and all(isinstance(c, list) and all(isinstance(t, int) for t in c) for c in chunks))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"neighbour index {where} cannot be read: {e}") from e
        if not ok:
            raise ValueError(f"neighbour index {where} is not a {FORMAT} file")
        return cls(chunks, neighbour, pending, more)

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


def _next_nearest(sims: torch.Tensor, nearest: torch.Tensor, n: int) -> list[list[int]]:
    """For each column of sims [all, block]: its `n` most similar rows after `nearest`, with a
    positive similarity, nearest first."""
    if n <= 0:
        return [[] for _ in range(sims.shape[1])]
    best, at = sims.topk(min(n + 1, sims.shape[0]), dim=0)
    return [[j for s, j in zip(col_s, col_j) if s > 0 and j != first][:n]
            for col_s, col_j, first in zip(best.T.tolist(), at.T.tolist(), nearest.tolist())]


def _pair_sims(x: torch.Tensor, rows: torch.Tensor, others: list[int]) -> list[float]:
    """Cosine similarity of each row of `x` in `rows` with the row in `others` beside it (-1: 0)."""
    others = torch.tensor(others, dtype=torch.long)
    products = x.index_select(0, rows) * x.index_select(0, others.clamp(min=0))
    return torch.where(others >= 0, torch.sparse.sum(products, 1).to_dense(), 0.0).tolist()


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
