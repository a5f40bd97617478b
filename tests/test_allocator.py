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
