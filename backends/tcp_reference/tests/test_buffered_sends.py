"""A blocking send never waits for its receiver (``eager_limit_bytes=None``), even when its
frame is larger than the kernels' socket buffers: what the kernel did not take is copied and
finished by the transport, within the ``max_buffered_send_bytes`` budget.

Each sender tells its receiver through the store only after its send returned; the receiver
makes no pg-tcp call before that (its backend exists: that only publishes an address), so a
send that waited for a receive would never return and the receiver's wait for the store key
would fail first.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
import torch
from pg_core.backend import BackendContext
from pg_core.errors import CollectiveTimeout, PeerFailureError
from pg_core.store import PrefixStore
from pg_core.testing.pool import RankContext, RankPool
from pg_tcp.backend import TCPBackend

Pools = Callable[[int], RankPool]

MiB = 1024 * 1024
#: how long a receiver waits for its sender's "returned" key before calling the send stuck
STUCK_S = 60.0


def make_backend(ctx: RankContext, *, timeout: float | None = None, **options: Any) -> TCPBackend:
    bctx = BackendContext(
        store=PrefixStore("g/cpu/tcp", ctx.store),
        rank=ctx.rank,
        size=ctx.size,
        device=torch.device("cpu"),
        timeout=timeout or ctx.timeout,
        group_name="g",
        group_uid=f"g-{ctx.job}",
        backend_name="tcp",
        options=options,
    )
    return TCPBackend(bctx)


@contextmanager
def backend(ctx: RankContext, **options: Any) -> Iterator[TCPBackend]:
    b = make_backend(ctx, **options)
    try:
        yield b
    finally:
        b.shutdown()


def pattern(nbytes: int, seed: int) -> torch.Tensor:
    """``nbytes`` of int32 whose every element differs (so a shifted or mixed-up copy shows)."""
    return torch.arange(nbytes // 4, dtype=torch.int32) * 7 + seed


def told(ctx: RankContext, key: str) -> None:
    ctx.store.wait([key], timedelta(seconds=STUCK_S))


def large_send_returns_first(ctx: RankContext, nbytes: int, as_bytes: bool) -> float | None:
    with backend(ctx) as b:
        if ctx.rank == 0:
            t = pattern(nbytes, 3)
            start = time.monotonic()
            if as_bytes:
                data = bytearray(t.numpy().tobytes())
                b.send_bytes(data, 1, 0, timeout=30.0)
                data[:] = bytes(len(data))  # reused at once: what arrives must not change
            else:
                b.send(t, 1, 0, timeout=30.0)
                t.fill_(-1)  # reused at once: what arrives must not change
            took = time.monotonic() - start
            ctx.store.set("returned", "1")
            told(ctx, "received")
            return took
        told(ctx, "returned")  # the first pg-tcp call of this rank comes after the send returned
        if as_bytes:
            got = b.recv_bytes(0, 0, timeout=30.0)
            assert bytes(got) == pattern(nbytes, 3).numpy().tobytes(), "send_bytes: the bytes differ"
        else:
            into = torch.empty(nbytes // 4, dtype=torch.int32)
            b.recv(into, 0, 0, timeout=30.0)
            assert torch.equal(into, pattern(nbytes, 3)), "send: the tensor differs"
        ctx.store.set("received", "1")
        return None


@pytest.mark.parametrize("as_bytes", [False, True], ids=["send", "send_bytes"])
@pytest.mark.parametrize("mib", [8, 64])
def test_a_large_blocking_send_returns_before_the_receiver_calls(rank_pools: Pools, mib: int, as_bytes: bool) -> None:
    took, _ = rank_pools(2).run(large_send_returns_first, mib * MiB, as_bytes, timeout=150)
    assert took is not None and took < 20.0, took


def several_buffered_in_order(ctx: RankContext) -> None:
    """Buffered sends to one peer on two tags keep their order per tag, small ones behind
    large ones included."""
    with backend(ctx) as b:
        sizes = [8 * MiB, 4, 3 * MiB, 12, 8 * MiB]
        if ctx.rank == 0:
            for i, n in enumerate(sizes):
                b.send(pattern(n, i), 1, i % 2, timeout=30.0)
            ctx.store.set("returned", "1")
            told(ctx, "received")
            return
        told(ctx, "returned")
        for tag in (1, 0):  # the other tag first: each tag in its own order
            for i, n in enumerate(sizes):
                if i % 2 == tag:
                    into = torch.empty(n // 4, dtype=torch.int32)
                    b.recv(into, 0, tag, timeout=30.0)
                    assert torch.equal(into, pattern(n, i)), f"message {i} (tag {tag}) differs"
        ctx.store.set("received", "1")


def test_buffered_sends_keep_their_order_per_tag(rank_pools: Pools) -> None:
    rank_pools(2).run(several_buffered_in_order, timeout=150)


def budget_exceeded(ctx: RankContext) -> str | None:
    with backend(ctx, max_buffered_send_bytes=4 * MiB) as b:
        if ctx.rank == 0:
            b.send(pattern(8 * MiB, 1), 1, 0, timeout=30.0)  # nothing buffered before: it goes
            with pytest.raises(CollectiveTimeout) as info:
                b.send(pattern(8 * MiB, 2), 1, 1, timeout=2.0)
            ctx.store.set("returned", "1")
            told(ctx, "received")
            b.send(pattern(64, 3), 1, 2, timeout=30.0)  # the connection still works
            return str(info.value)
        told(ctx, "returned")
        into = torch.empty(2 * MiB, dtype=torch.int32)
        b.recv(into, 0, 0, timeout=30.0)
        assert torch.equal(into, pattern(8 * MiB, 1))
        ctx.store.set("received", "1")
        small = torch.empty(16, dtype=torch.int32)
        b.recv(small, 0, 2, timeout=30.0)
        assert torch.equal(small, pattern(64, 3))
        return None


def test_a_send_beyond_the_buffered_budget_times_out_saying_what_to_do(rank_pools: Pools) -> None:
    message = rank_pools(2).run(budget_exceeded, timeout=150)[0]
    assert message is not None
    assert "max_buffered_send_bytes" in message and "rank 1" in message, message
    assert "isend" in message and "receive" in message, message


def drains_while_the_sender_computes(ctx: RankContext) -> float | None:
    """The sender computes outside pg-tcp after its send returned; the receiver calls recv
    2 s later. The buffered rest must flow then, without the sender entering pg-tcp."""
    with backend(ctx) as b:
        if ctx.rank == 0:
            b.send(pattern(8 * MiB, 5), 1, 0, timeout=30.0)
            ctx.store.set("returned", "1")
            a = torch.randn(64, 64)
            guard = time.monotonic() + STUCK_S  # a hang guard only
            while not ctx.store.check(["received"]) and time.monotonic() < guard:
                a = torch.tanh(a @ a)
            return None
        told(ctx, "returned")
        time.sleep(2.0)  # the scenario: a receiver busy elsewhere for 2 s (not synchronisation)
        into = torch.empty(2 * MiB, dtype=torch.int32)
        start = time.monotonic()
        b.recv(into, 0, 0, timeout=30.0)
        took = time.monotonic() - start
        ctx.store.set("received", "1")
        assert torch.equal(into, pattern(8 * MiB, 5))
        return took


def test_a_buffered_send_drains_while_the_sender_computes(rank_pools: Pools) -> None:
    took = rank_pools(2).run(drains_while_the_sender_computes, timeout=150)[1]
    assert took is not None and took < 2.0, f"the receive of 8 MiB took {took:.3f} s"


def shutdown_delivers(ctx: RankContext) -> None:
    b = make_backend(ctx)
    try:
        if ctx.rank == 0:
            b.send(pattern(64 * MiB, 7), 1, 0, timeout=30.0)
            b.send(pattern(16, 8), 1, 0, timeout=30.0)
            ctx.store.set("returned", "1")
            b.shutdown()  # flushes both before its BYE (the receiver reads meanwhile)
            ctx.store.set("shut", "1")
            return
        told(ctx, "returned")
        into = torch.empty(16 * MiB, dtype=torch.int32)
        b.recv(into, 0, 0, timeout=30.0)
        assert torch.equal(into, pattern(64 * MiB, 7))
        small = torch.empty(4, dtype=torch.int32)
        b.recv(small, 0, 0, timeout=30.0)
        assert torch.equal(small, pattern(16, 8))
        told(ctx, "shut")
    finally:
        b.shutdown()


def test_shutdown_delivers_buffered_sends(rank_pools: Pools) -> None:
    rank_pools(2).run(shutdown_delivers, timeout=150)


def abort_drops(ctx: RankContext) -> float | str:
    b = make_backend(ctx)
    try:
        if ctx.rank == 0:
            b.send(pattern(64 * MiB, 6), 1, 0, timeout=30.0)
            start = time.monotonic()
            b.abort()  # drops what is buffered: never waits for the receiver
            took = time.monotonic() - start
            ctx.store.set("aborted", "1")
            return took
        told(ctx, "aborted")
        with pytest.raises(PeerFailureError) as info:  # the frame was cut short: never a partial tensor
            b.recv(torch.empty(16 * MiB, dtype=torch.int32), 0, 0, timeout=30.0)
        return str(info.value)
    finally:
        b.shutdown()


def test_abort_drops_buffered_sends(rank_pools: Pools) -> None:
    took, message = rank_pools(2).run(abort_drops, timeout=150)
    assert isinstance(took, float) and took < 5.0, took
    assert "rank 0" in str(message), message


# -- last: a rank that dies takes its pool with it ------------------------------------------


def receiver_dies_with_data_buffered(ctx: RankContext) -> tuple[str, str] | None:
    b = make_backend(ctx, timeout=3600.0)
    b.barrier(timeout=60.0)  # connected
    if ctx.rank == 1:
        told(ctx, "returned")
        os._exit(0)  # die without a word, 64 MiB on its way
    try:
        b.send(pattern(64 * MiB, 9), 1, 0, timeout=60.0)
        ctx.store.set("returned", "1")
        with pytest.raises(PeerFailureError) as received:
            b.recv(torch.empty(1), 1, 0, timeout=3600.0)  # far beyond the hang guard: noticed, not timed out
        with pytest.raises(PeerFailureError) as sent:
            b.send(torch.ones(1), 1, 0, timeout=3600.0)
        return str(received.value), str(sent.value)
    finally:
        b.shutdown()


def test_a_receiver_that_dies_with_data_buffered_fails_the_next_operation(rank_pools: Pools) -> None:
    result = rank_pools(2).run(receiver_dies_with_data_buffered, may_exit=[1], timeout=90)[0]
    assert result is not None
    for message in result:
        assert "rank 1" in message, message
