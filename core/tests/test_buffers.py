"""``SpareBuffers``: the buffers a backend keeps for its next messages."""

from __future__ import annotations

import threading

import torch
from pg_core.buffers import SpareBuffers


def test_take_gives_the_smallest_kept_buffer_that_fits_else_a_new_one() -> None:
    spares = SpareBuffers(limit=1 << 20)
    small, large = spares.take(100), spares.take(1000)
    assert (small.numel(), large.numel(), len(spares)) == (100, 1000, 0)
    spares.give(large)
    spares.give(small)
    assert spares.take(50).data_ptr() == small.data_ptr()  # the smallest that fits
    assert spares.take(50).data_ptr() == large.data_ptr()  # then the next
    fresh = spares.take(50)
    assert fresh.numel() == 50 and fresh.dtype == torch.uint8 and len(spares) == 0


def test_the_kept_bytes_stay_within_the_limit_oldest_let_go_first() -> None:
    spares = SpareBuffers(limit=1000)
    first, second, third = spares.take(400), spares.take(400), spares.take(400)
    for buffer in (first, second, third):
        spares.give(buffer)
    assert (len(spares), spares.nbytes) == (2, 800)
    assert {spares.take(1).data_ptr(), spares.take(1).data_ptr()} == {second.data_ptr(), third.data_ptr()}
    spares.give(spares.take(1001))  # larger than the limit: not kept
    assert (len(spares), spares.nbytes) == (0, 0)
    spares.give(first)
    spares.clear()
    assert (len(spares), spares.nbytes) == (0, 0)


def test_a_buffer_is_taken_by_one_thread_only() -> None:
    spares = SpareBuffers()
    for _ in range(8):
        spares.give(torch.empty(4096, dtype=torch.uint8))
    taken: list[int] = []
    start = threading.Barrier(8)

    def take() -> None:
        start.wait(timeout=30)
        taken.append(spares.take(4096).data_ptr())

    threads = [threading.Thread(target=take) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(set(taken)) == 8 and len(spares) == 0
