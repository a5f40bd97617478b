"""Loading a model's tokenizer without the Python copies of its vocabulary that nothing reads.

transformers 5 builds a BPE tokenizer (Qwen2.5's, SmolLM2's) from its vocabulary and merges, and
keeps both on the object as a Python dict and list after handing them to the Rust tokenizer, which
holds its own. For Qwen2.5's 151k tokens they took 60 MiB of a serving process, where the Rust
tokenizer takes 47. Only a tokenizer's constructor reads them for the families kvblend serves
(Whisper and a few Unigram tokenizers read them again when saving, and keep them here).
"""

from __future__ import annotations

from pathlib import Path

# Tokenizer classes whose Python vocabulary and merges are read only while they are built.
BUILT_ONCE = ("Qwen2Tokenizer", "GPT2Tokenizer", "LlamaTokenizer", "GemmaTokenizer")
CONSTRUCTION_COPIES = ("_vocab", "_merges")


def load_tokenizer(source: str | Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source)
    drop_construction_copies(tokenizer)
    return tokenizer


def drop_construction_copies(tokenizer) -> list[str]:
    """Drop the Python vocabulary and merges a Rust-backed tokenizer was built from; returns the
    names dropped (none for classes that may read them again)."""
    if type(tokenizer).__name__ not in BUILT_ONCE or getattr(tokenizer, "_tokenizer", None) is None:
        return []
    dropped = [name for name in CONSTRUCTION_COPIES if isinstance(getattr(tokenizer, name, None), (dict, list))]
    for name in dropped:
        delattr(tokenizer, name)
    return dropped
