"""The machine a measurement ran on, for results' captions: speed-ups depend on the CPU's matrix
units (bf16 is fast only with AMX or AVX512-BF16) and on the threads the run had."""

from __future__ import annotations

import platform
import subprocess

# Core generations by (vendor, CPU family, model range). Cloud CPUs often report a bare model
# name ("AMD EPYC"), and one name may hide cores whose bf16 rates differ twofold (Zen 4 runs
# AVX-512 on 256-bit units, Zen 5 on 512-bit ones), so captions name the generation too.
GENERATIONS = [
    ("AuthenticAMD", 23, range(0x00, 0x30), "Zen"),
    ("AuthenticAMD", 23, range(0x30, 0x100), "Zen 2"),
    ("AuthenticAMD", 25, range(0x00, 0x10), "Zen 3"),
    ("AuthenticAMD", 25, range(0x10, 0x20), "Zen 4"),
    ("AuthenticAMD", 25, range(0x20, 0x60), "Zen 3"),
    ("AuthenticAMD", 25, range(0x60, 0xB0), "Zen 4"),
    ("AuthenticAMD", 26, range(0x00, 0x100), "Zen 5"),
    ("GenuineIntel", 6, range(0x55, 0x56), "Skylake/Cascade Lake"),
    ("GenuineIntel", 6, range(0x6A, 0x6B), "Ice Lake"),
    ("GenuineIntel", 6, range(0x8F, 0x90), "Sapphire Rapids"),
    ("GenuineIntel", 6, range(0xCF, 0xD0), "Emerald Rapids"),
    ("GenuineIntel", 6, range(0xAD, 0xAE), "Granite Rapids"),
]


def generation(vendor: str, family: int, model: int) -> str | None:
    """The core generation of a CPU id ("Zen 4" for AMD family 25 model 17), or None if unknown."""
    for v, fam, models, name in GENERATIONS:
        if v == vendor and fam == family and model in models:
            return name
    return None


def cpu_name() -> str:
    """"AMD EPYC (Zen 4, AVX512-BF16)": the model name, the core generation where it is known,
    and the best matrix extension the CPU has."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return platform.processor() or "unknown CPU"
    fields = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in out.splitlines() if ":" in line)}
    flags = fields.get("Flags", "").split()
    isa = "AMX" if "amx_bf16" in flags else "AVX512-BF16" if "avx512_bf16" in flags else \
        "AVX512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    try:
        gen = generation(fields.get("Vendor ID", ""), int(fields["CPU family"]), int(fields["Model"]))
    except (KeyError, ValueError):
        gen = None
    return f"{fields.get('Model name', '?')} ({gen + ', ' if gen else ''}{isa})"
