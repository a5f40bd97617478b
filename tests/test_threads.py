"""The layer loader runs its ops on one thread without changing any other thread's count: a
process-wide change once made the server's scheduler thread, started after a blend, prefill on
one core."""

import threading

import pytest
import torch
from test_blend_invariants import chunks, make_engine, prompt

from kvblend.model.threads import limit_this_thread


def in_new_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_a_limited_thread_leaves_the_others_alone(two_threads):
    assert in_new_thread(lambda: (limit_this_thread(1), torch.get_num_threads())) == (True, 1)
    assert in_new_thread(torch.get_num_threads) == 2
    assert torch.get_num_threads() == 2


def test_threads_started_after_a_read_ahead_blend_keep_the_process_count(two_threads):
    engine = make_engine(prefetch_depth=2)
    ids = prompt(chunks(3))
    engine.precompute(ids)
    _, out = engine.prefill(ids, "blend")
    assert out.stats.reused_tokens > 0  # the loader thread really read stored KV
    assert in_new_thread(torch.get_num_threads) == 2
    assert torch.get_num_threads() == 2
