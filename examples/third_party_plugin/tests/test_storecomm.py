"""pg-storecomm end to end: found through its entry point, driven through ProcessGroup
in real rank processes (the workspace's ``rank_pools`` fixture), at world sizes 2 and 3."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from pg_core import CollectiveMismatchError, CollectiveTimeout, ProcessGroup, ReduceOp

pytestmark = pytest.mark.requires_backend("storecomm")  # in-repo: missing or broken fails, never skips

SIZES = [2, 3]


def _group(ctx, **kw) -> ProcessGroup:
    kw.setdefault("timeout", ctx.timeout)
    return ProcessGroup(ctx.store, rank=ctx.rank, size=ctx.size, backends="storecomm", **kw)


# -- rank functions (module level: the pool imports them in every rank) -----------------
def _collectives(ctx) -> None:
    r, n = ctx.rank, ctx.size
    with _group(ctx) as g:
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            t = torch.arange(5, dtype=dtype) + r
            g.all_reduce(t)
            assert torch.equal(t, (torch.arange(5) * n + sum(range(n))).to(dtype)), (dtype, t)

        t = torch.tensor([float(r), float(-r), 2.0 * r])
        g.all_reduce(t, op=ReduceOp.MAX)
        assert t.tolist() == [n - 1.0, 0.0, 2.0 * (n - 1)], t

        t = torch.full((3, 2), float(r)) if r == n - 1 else torch.zeros(3, 2)
        g.broadcast(t, src=n - 1)
        assert torch.equal(t, torch.full((3, 2), float(n - 1))), t

        out = [torch.empty(4, dtype=torch.int32) for _ in range(n)]
        g.all_gather(out, torch.full((4,), r, dtype=torch.int32))
        assert [o.tolist() for o in out] == [[k] * 4 for k in range(n)], out

        # rank k contributes (k + 1) * (j + 1) to chunk j; rank r gets the sum of its chunk
        inputs = [torch.full((2, 3), float((r + 1) * (j + 1))) for j in range(n)]
        output = torch.empty(2, 3)
        g.reduce_scatter(output, inputs, op=ReduceOp.SUM)
        assert torch.equal(output, torch.full((2, 3), float((r + 1) * sum(k + 1 for k in range(n))))), output

        # uneven: rank r sends r + j + 1 rows of value 100 * r + j to rank j
        in_splits = [r + j + 1 for j in range(n)]
        out_splits = [j + r + 1 for j in range(n)]
        inp = torch.cat([torch.full((s, 2), 100.0 * r + j) for j, s in enumerate(in_splits)])
        out = torch.empty(sum(out_splits), 2)
        g.all_to_all_single(out, inp, out_splits, in_splits)
        expected = torch.cat([torch.full((s, 2), 100.0 * j + r) for j, s in enumerate(out_splits)])
        assert torch.equal(out, expected), (out, expected)

        g.barrier()


def _p2p_out_of_order(ctx) -> None:
    r, n = ctx.rank, ctx.size
    with _group(ctx) as g:
        peer = (r + 1) % n
        prev = (r - 1) % n
        # Blocking sends before anyone receives: a store write never waits for the receiver.
        for tag in (1, 2, 3):
            g.send(torch.full((tag,), 10.0 * r + tag), dst=peer, tag=tag)
        g.send(torch.tensor([r, 7]), dst=peer, tag=2)  # second message on (peer, tag 2)
        for tag in (3, 1, 2):  # received in another order than sent
            t = torch.empty(tag)
            g.recv(t, src=prev, tag=tag)
            assert torch.equal(t, torch.full((tag,), 10.0 * prev + tag)), (tag, t)
        t = torch.empty(2, dtype=torch.int64)
        g.recv(t, src=prev, tag=2)  # in order per (peer, tag)
        assert t.tolist() == [prev, 7], t
        g.barrier()


def _recv_timeout(ctx) -> tuple[str, str, tuple[int, ...]] | None:
    result = None
    # The group's own timeout is far beyond the test's hang guard (the pool's 60 s): only the
    # recv's own 0.3 s can end the recv in time for the test to pass.
    with _group(ctx, timeout=3600) as g:
        if ctx.rank == 0:
            try:
                g.recv(torch.empty(3), src=ctx.size - 1, tag=99, timeout=0.3)
            except CollectiveTimeout as exc:
                result = (type(exc).__name__, str(exc), tuple(exc.peers))
            else:
                raise AssertionError("recv from a silent peer returned")
        g.barrier()
    return result


def _stale_collective(ctx) -> tuple[str, list[float]]:
    with _group(ctx) as g:
        if ctx.rank == 0:
            try:
                g.all_reduce(torch.ones(3), timeout=0.3)
            except CollectiveTimeout:
                pass
            else:
                raise AssertionError("all_reduce with a silent peer returned")
            ctx.store.set("rank0-timed-out", "1")
            t = torch.full((3,), 10.0)
            try:
                g.all_reduce(t)  # would pair with rank 1's late message from the first one
            except (CollectiveMismatchError, CollectiveTimeout) as exc:  # the core refuses first
                return str(exc), t.tolist()
            raise AssertionError(f"a collective after a timed-out one returned {t.tolist()}")
        ctx.store.wait(["rank0-timed-out"])
        t = torch.ones(3)
        g.all_reduce(t)  # late: rank 0's eager message is still there, so this one completes
        return "", t.tolist()


def _size_mismatch(ctx) -> str | None:
    result = None
    with _group(ctx) as g:
        if ctx.rank == 1:
            g.send(torch.zeros(4), dst=0, tag=5)
            g.send(torch.ones(2), dst=0, tag=5)
        if ctx.rank == 0:
            try:
                g.recv(torch.empty(3), src=1, tag=5)
            except CollectiveMismatchError as exc:
                result = str(exc)
            t = torch.empty(2)
            g.recv(t, src=1, tag=5)  # the bad message was consumed; the stream goes on
            assert torch.equal(t, torch.ones(2)), t
        g.barrier()
    return result


# -- tests ------------------------------------------------------------------------------
@pytest.mark.parametrize("world_size", SIZES)
def test_collectives(rank_pools, world_size):
    rank_pools(world_size).run(_collectives, timeout=60)


@pytest.mark.parametrize("world_size", SIZES)
def test_send_recv_tags_out_of_order(rank_pools, world_size):
    rank_pools(world_size).run(_p2p_out_of_order, timeout=60)


@pytest.mark.parametrize("world_size", SIZES)
def test_recv_timeout_names_the_peer(rank_pools, world_size):
    results = rank_pools(world_size).run(_recv_timeout, timeout=60)
    assert results[0] is not None
    name, message, peers = results[0]
    assert name == "CollectiveTimeout"
    assert world_size - 1 in peers, peers
    assert str(world_size - 1) in message, message
    assert results[1:] == [None] * (world_size - 1)


def test_collective_after_a_timed_out_one_is_refused(rank_pools):
    (message, t0), (_, t1) = rank_pools(2).run(_stale_collective, timeout=60)
    assert "out of step" in message, message
    assert t0 == [10.0, 10.0, 10.0]  # untouched, not silently reduced with stale data
    assert t1 == [2.0, 2.0, 2.0]


def test_recv_size_mismatch(rank_pools):
    message = rank_pools(2).run(_size_mismatch, timeout=60)[0]
    assert message is not None and "rank 1" in message, message


def test_cli_lists_the_plugin():
    proc = subprocess.run(
        [sys.executable, "-m", "pg_core", "backends", "--json"], capture_output=True, text=True, timeout=60, check=True
    )
    entries = {e["name"]: e for e in json.loads(proc.stdout)}
    entry = entries.get("storecomm")
    assert entry is not None, proc.stdout
    assert entry["distribution"] == "pg-storecomm", entry
    assert entry["status"] == "available", entry
    assert entry["devices"] == ["cpu"], entry
    assert entry["priority"] < entries.get("tcp", {"priority": 10})["priority"], entries


def _large_messages(ctx) -> list[int]:
    """Messages past a store value's bound (torch's TCPStore drops a client that sends one over
    8 MiB): sent in pieces, received whole, and the store connection still works after."""
    group = _group(ctx)
    try:
        sizes = [0, 4 * 1024 * 1024, 4 * 1024 * 1024 + 1, 20 * 1024 * 1024 + 3]
        got = []
        for i, size in enumerate(sizes):
            if group.rank == 0:
                group.send(torch.arange(size, dtype=torch.uint8), 1, tag=i)
            else:
                buf = torch.empty(size, dtype=torch.uint8)
                group.recv(buf, 0, tag=i)
                assert torch.equal(buf, torch.arange(size, dtype=torch.uint8))
                got.append(size)
        group.barrier()
        return got
    finally:
        group.shutdown()


def test_messages_past_a_store_values_bound_arrive_whole(rank_pools):
    _, received = rank_pools(2).run(_large_messages, timeout=120)
    assert received == [0, 4 * 1024 * 1024, 4 * 1024 * 1024 + 1, 20 * 1024 * 1024 + 3]
