"""kvblend: CacheBlend for RAG serving (reuse chunk KV at any position, recompute what matters)."""

import os

# Large tensors (a request's KV cache, a long prompt's activations) on transparent huge pages where
# the kernel offers them: fresh memory costs a page fault per 4 KB page on first touch, about a
# tenth of reuse's TTFT on a 6k-token prompt (docs/experiments.md#speed). torch reads this
# once, at its first large allocation, so it is set before anything is loaded; 0 opts out.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from .api import LLM, RequestOutput, SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "RequestOutput"]
__version__ = "0.1.0"
