"""kvblend: CacheBlend for RAG serving (reuse chunk KV at any position, recompute what matters)."""

from .api import LLM, RequestOutput, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput"]
__version__ = "0.1.0"
