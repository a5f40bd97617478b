"""Process-wide memory settings: the kernel caches are bounded unless the user chose a bound."""

import os

from kvblend.model.allocator import KERNEL_CACHE, KERNEL_CACHE_VARS, bound_kernel_caches


def test_kernel_caches_are_bounded_unless_the_user_set_them(monkeypatch):
    onednn, ideep = KERNEL_CACHE_VARS
    monkeypatch.delenv(onednn, raising=False)
    monkeypatch.setenv(ideep, "512")
    bound_kernel_caches()
    assert os.environ[onednn] == str(KERNEL_CACHE)
    assert os.environ[ideep] == "512"  # the user's own value stays


def test_freed_memory_goes_back_to_the_os_and_a_libc_without_malloc_trim_is_no_error(monkeypatch):
    import ctypes

    import torch

    from kvblend.model import allocator

    def rss_mib():
        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20

    allocator.keep_freed_memory()  # freed blocks stay in the heap from here on
    blocks = [torch.ones(1 << 20) for _ in range(64)]  # 256 MiB in 4 MiB blocks: below the mmap threshold
    held = rss_mib()
    del blocks
    assert allocator.release_freed_memory()
    assert rss_mib() < held - 128

    def no_libc(name):
        raise OSError(name)

    monkeypatch.setattr(ctypes, "CDLL", no_libc)
    assert allocator.release_freed_memory() is False
