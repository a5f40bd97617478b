"""Process-wide memory settings for CPU inference: keep freed activation memory in the process
instead of handing it back to the OS, and bound the kernels cached per matrix shape.

glibc serves each large allocation (a layer's activations: tens of MB at a few thousand tokens)
with a fresh mmap and unmaps it on free, so the next layer's same-sized tensor is faulted in again
page by page. On a 4k-token prefill of Qwen2.5 0.5B that made an int8 matrix product 4x slower
than the kernel (its output's page faults) and the whole prefill 10-26% slower. Raising glibc's
mmap and trim thresholds makes such blocks come from the heap and stay there for reuse; the
resident set then stays near its high-water mark, which the working set bounds anyway.

oneDNN compiles a kernel for each matrix product shape it meets and keeps up to 1,024 of them, and
torch's ideep layer keeps as many computations of its own: about 0.65 MiB a shape together on an
AMX Xeon. Chunks, probes and checks of every length make new shapes, so a process serving prompts
of ever new lengths kept growing there (12 blends of new 1-2k-token prompts ended 250 MiB higher
than with oneDNN's cache at 128). Each cache is bounded to KERNEL_CACHE shapes: more than one
request uses.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
THRESHOLD = 512 << 20  # blocks above this (rare: none in a prefill up to 8k tokens) still map and unmap
KERNEL_CACHE = 64
# Read once, at the first product: set before it, and never over a value the user chose. (An
# ideep capacity of 0 crashes torch 2.13, so it is never that.)
KERNEL_CACHE_VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def _glibc():
    """The C library, where it is glibc (it has mallopt and malloc_trim); else None."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


@functools.cache
def keep_freed_memory() -> bool:
    """Set glibc's thresholds once per process; False where the C library is not glibc."""
    libc = _glibc()
    ok = libc is not None and libc.mallopt(M_MMAP_THRESHOLD, THRESHOLD) == 1 \
        and libc.mallopt(M_TRIM_THRESHOLD, THRESHOLD) == 1
    if not ok:
        log.debug("mallopt unavailable: large blocks go back to the OS on free")
    return ok


def release_freed_memory() -> bool:
    """Hand the pages of the heap's free blocks back to the OS (glibc's malloc_trim), after one-off
    work whose transients requests never reuse in the same shape: loading a model (its fp32 reads,
    95 MiB of Qwen2.5 0.5B's), precomputing chunks (their encodings' caches and activations). With
    the thresholds above nothing else returns them. False where the C library is not glibc."""
    libc = _glibc()
    return libc is not None and bool(libc.malloc_trim(0))


def bound_kernel_caches() -> None:
    for var in KERNEL_CACHE_VARS:
        os.environ.setdefault(var, str(KERNEL_CACHE))
