"""Results' captions name the CPU: its model name, core generation and best matrix extension."""

import subprocess

from kvblend.eval import machine

LSCPU = """Architecture:            x86_64
Vendor ID:               AuthenticAMD
Model name:              AMD EPYC
CPU family:              {family}
Model:                   {model}
Flags:                   fpu avx2 avx512f avx512_bf16
"""


def fake_lscpu(monkeypatch, text):
    monkeypatch.setattr(machine.subprocess, "run",
                        lambda *a, **kw: subprocess.CompletedProcess(a, 0, stdout=text, stderr=""))


def test_generation_tells_apart_cpus_that_share_a_model_name():
    assert machine.generation("AuthenticAMD", 25, 0x11) == "Zen 4"
    assert machine.generation("AuthenticAMD", 25, 0x01) == "Zen 3"
    assert machine.generation("AuthenticAMD", 26, 0x02) == "Zen 5"
    assert machine.generation("GenuineIntel", 6, 0x8F) == "Sapphire Rapids"
    assert machine.generation("GenuineIntel", 25, 0x11) is None  # the vendor is part of the id


def test_cpu_name_names_generation_and_matrix_extension(monkeypatch):
    fake_lscpu(monkeypatch, LSCPU.format(family=25, model=17))
    assert machine.cpu_name() == "AMD EPYC (Zen 4, AVX512-BF16)"
    fake_lscpu(monkeypatch, LSCPU.format(family=99, model=1))  # unknown: no generation, no error
    assert machine.cpu_name() == "AMD EPYC (AVX512-BF16)"
    fake_lscpu(monkeypatch, "Model name: Some CPU\nFlags: avx2\n")  # no family lines at all
    assert machine.cpu_name() == "Some CPU (AVX2)"
