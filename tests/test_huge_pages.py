"""Importing kvblend asks torch for transparent huge pages for large tensors (a fresh KV cache
otherwise costs a page fault per 4 KB page), and leaves a user's own choice alone."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = """
import os, kvblend, torch
x = torch.ones(16 << 20)  # 64 MB, every page touched
huge = sum(int(line.split()[1]) for line in open("/proc/self/smaps") if line.startswith("AnonHugePages"))
print(os.environ["THP_MEM_ALLOC_ENABLE"], huge)
"""


def thp_mode() -> str | None:
    """The kernel's transparent huge page mode: always, madvise, never (None: not Linux)."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return text.split("[", 1)[1].split("]", 1)[0]


def probe(setting: str | None) -> tuple[str, int]:
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if setting is not None:
        env["THP_MEM_ALLOC_ENABLE"] = setting
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    value, huge = out.stdout.split()
    return value, int(huge)


@pytest.mark.skipif(thp_mode() is None, reason="transparent huge pages are a Linux feature")
def test_large_tensors_get_huge_pages_unless_the_user_opts_out():
    value, huge = probe(None)
    assert value == "1"
    if thp_mode() in ("always", "madvise"):
        assert huge > 0
    value, huge = probe("0")
    assert value == "0"  # the user's setting stands
    if thp_mode() == "madvise":  # only kvblend's request would have given them
        assert huge == 0
