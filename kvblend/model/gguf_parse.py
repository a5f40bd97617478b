"""Speed-ups for transformers' GGUF conversion, which kvblend runs once per GGUF file: transformers parses
the file's metadata anew for the config, the tokenizer and the weights, one value at a time, and maps
tensor names module by module. On an AVX2-only EPYC that took most of a conversion: Qwen2.5 0.5B took 73 s,
49 s with one shared reader, 33 s with all of these (SmolLM2 27 -> 12 s, Gemma 3 270M 45 -> 31 s). The
outputs are the same bytes (tests/test_model_folder.py)."""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_SWAP = threading.Lock()


@contextmanager
def one_gguf_parse() -> Iterator[None]:
    """While open: each GGUF file is parsed once and its reader (read-only, over a memory map) shared;
    numbers and strings are parsed directly; gguf's tensor-name map is built once per
    architecture (transformers asks for it again for each of a model's few hundred modules). The swaps
    are process-wide, so conversions in one process take turns: two at once would restore each other's."""
    import gguf
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    with _SWAP:
        original = gguf.GGUFReader, gguf.get_tensor_name_map, hf_gguf._gguf_parse_value
        readers = {}

        def shared(path, mode="r"):
            key = (str(Path(path).resolve()), mode)
            if key not in readers:
                readers[key] = _plain_array_reader()(path, mode)
            return readers[key]

        gguf.GGUFReader = shared
        gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original[1])  # read-only maps
        hf_gguf._gguf_parse_value = _direct(original[2])
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map, hf_gguf._gguf_parse_value = original


# GGUF's value types: an array's elements are parsed one by one with the type [ARRAY, element type].
INTS, FLOATS, STRING = {0, 1, 2, 3, 4, 5, 10, 11}, {6, 12}, 8


def _direct(parse):
    """transformers' value parser with the scalar and string types parsed directly: a vocabulary (Gemma 3's
    262k tokens) is three arrays of them, where the parser normalizes each element's type first, and
    builds a Python list of a string's bytes before decoding them."""

    def parse_value(value, data_type):
        kind = data_type[-1] if type(data_type) is list else data_type
        if kind == STRING:
            return value.tobytes().decode()
        if kind in INTS:
            return int(value[0])
        if kind in FLOATS:
            return float(value[0])
        return parse(value, data_type)

    return parse_value


def _plain_array_reader():
    """gguf's reader over a plain-array view of its memory map: the parse slices the map once per
    token and merge (about a million times for a 150k vocabulary), and each slice of an np.memmap pays
    for a Python-level __array_finalize__ (a third of a conversion's time)."""
    import numpy as np
    from gguf.gguf_reader import GGUFReader

    class PlainArrayReader(GGUFReader):
        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, mapped):
            self._plain = mapped.view(np.ndarray)

    return PlainArrayReader
