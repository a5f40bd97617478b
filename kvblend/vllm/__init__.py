"""kvblend inside vLLM: `KVBlendConnector`, a vLLM v1 KV connector that blends a prompt's chunks on
vLLM's own layers and writes the result into vLLM's paged cache (docs/vllm.md).

Importing this package imports vLLM (`pip install 'kvblend[vllm]'`); the rest of kvblend never does.
"""

from .connector import KVBlendConnector, KVBlendMetadata, KVBlendStats
from .prompts import rag_messages, rag_prompt_text

__all__ = ["KVBlendConnector", "KVBlendMetadata", "KVBlendStats", "rag_messages", "rag_prompt_text"]
