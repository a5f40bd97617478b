"""Thread counts: for side threads (the layer loader), leaving every other thread's alone, and
the cores the process may use.

`torch.set_num_threads` is process-wide: it sets the count every thread takes at its first
parallel op (and MKL's), so one call from a side thread made the server's scheduler thread,
started later, compute prefills on one core. OpenMP's own `omp_set_num_threads` sets only the
calling thread's team; this calls it in the OpenMP runtime torch loaded.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

import torch

log = logging.getLogger(__name__)


@functools.cache
def _openmp_runtime() -> ctypes.CDLL | None:
    """The OpenMP library in this process (torch's), found in its memory map; None if none."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line or "libiomp" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path)  # already loaded: the same library, not a second copy
        except OSError:
            continue
    return None


def limit_this_thread(n: int) -> bool:
    """Run this thread's torch ops on at most `n` OpenMP threads, other threads unchanged. False
    where the OpenMP runtime cannot be reached (the thread then keeps the process's count)."""
    torch.get_num_threads()  # torch sets a thread's count at its first parallel op: do that first
    runtime = _openmp_runtime()
    if runtime is None:
        log.debug("no OpenMP runtime found: this thread keeps %d threads", torch.get_num_threads())
        return False
    runtime.omp_set_num_threads(ctypes.c_int(n))
    return True


def usable_cores() -> int:
    """The cores this process may run on (all of them where the OS cannot say)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
