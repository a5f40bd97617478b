"""The machine a measurement ran on, for results' captions: speed-ups depend on the CPU's matrix
units (bf16 is fast only with AMX or AVX512-BF16) and on the threads the run had."""

from __future__ import annotations

import platform
import subprocess


def cpu_name() -> str:
    """"AMD EPYC 7B13 (AVX2)": the model name and the best matrix extension it has."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return platform.processor() or "unknown CPU"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    isa = "AMX" if "amx_bf16" in flags else "AVX512-BF16" if "avx512_bf16" in flags else \
        "AVX512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return f"{fields.get('Model name', '?').strip()} ({isa})"
