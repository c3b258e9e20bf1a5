"""ProcessGroup end to end over the reference backend, in real processes:
every operation at world sizes 1-4 (and some at 8) through the public API,
groups sharing a store, groups driven from two threads at once, failures."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from pg_core import (
    CollectiveMismatchError,
    CollectiveTimeout,
    GroupClosedError,
    NotSupportedError,
    PeerFailureError,
    ProcessGroup,
    ReduceOp,
)

pytestmark = pytest.mark.requires_backend("tcp")  # in-repo: missing or broken fails, never skips

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.int64, torch.uint8]


def _group(ctx, **kw) -> ProcessGroup:
    kw.setdefault("timeout", ctx.timeout)
    return ProcessGroup(ctx.store, rank=ctx.rank, size=ctx.size, backends="tcp", **kw)


def _input(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    base = torch.arange(n, dtype=torch.float64) % 7 + rank + 1
    if dtype.is_complex:
        return (base + 1j * (rank + 1)).to(dtype)
    return base.to(dtype)


def every_op(ctx, dtype_name: str):
    """Every collective and p2p op through the public API; returns nothing, asserts everything."""
    dtype = getattr(torch, dtype_name)
    r, n = ctx.rank, ctx.size
    with _group(ctx) as g:
        inputs = [_input(q, 5, dtype) for q in range(n)]
        ref_sum = sum(i.to(torch.complex128 if dtype.is_complex else torch.float64) for i in inputs)
        tol = {"rtol": 1e-2, "atol": 1e-2} if dtype in (torch.float16, torch.bfloat16) else {}

        def close(actual, expected):
            torch.testing.assert_close(actual.to(expected.dtype), expected, check_dtype=False, **tol)

        t = inputs[r].clone()
        g.all_reduce(t)
        if dtype == torch.uint8:
            assert torch.equal(t, ref_sum.to(torch.int64).remainder(256).to(dtype))
        else:
            close(t, ref_sum)
        # bitwise agreement across ranks
        everyone = [torch.empty_like(t) for _ in range(n)]
        g.all_gather(everyone, t)
        for other in everyone:
            assert torch.equal(other.view(torch.uint8), t.view(torch.uint8))
        for q in range(n):
            assert torch.equal(everyone[q], t)

        if not dtype.is_complex:
            m = inputs[r].clone()
            g.all_reduce(m, ReduceOp.MAX)
            assert torch.equal(m, torch.stack(inputs).amax(0))

        root = n - 1
        b = inputs[r].clone() if r == root else torch.zeros(5, dtype=dtype)
        g.broadcast(b, src=root)
        assert torch.equal(b, inputs[root])

        red = inputs[r].clone()
        g.reduce(red, dst=0)
        if r == 0 and dtype != torch.uint8:
            close(red, ref_sum)
        elif r != 0:
            assert torch.equal(red, inputs[r])

        out = torch.empty(5 * n, dtype=dtype)
        g.all_gather_into_tensor(out, inputs[r])
        assert torch.equal(out, torch.cat(inputs))

        blocks = [_input(q * 10 + r, 3, dtype) for q in range(n)]  # block q goes to rank q
        rs = torch.empty(3, dtype=dtype)
        g.reduce_scatter(rs, blocks)
        expected = sum(
            _input(r * 10 + q, 3, dtype).to(torch.complex128 if dtype.is_complex else torch.float64) for q in range(n)
        )
        if dtype != torch.uint8:
            close(rs, expected)
        rst = torch.empty(3, dtype=dtype)
        g.reduce_scatter_tensor(rst, torch.cat(blocks))
        assert torch.equal(rst, rs)

        sends = [torch.full((q + 1,), r * 100 + q).to(dtype) for q in range(n)]  # uneven sizes
        recvs = [torch.empty(r + 1, dtype=dtype) for _ in range(n)]
        g.all_to_all(recvs, sends)
        for q in range(n):
            assert torch.equal(recvs[q], torch.full((r + 1,), q * 100 + r).to(dtype))

        in_splits = [q % 2 + 1 for q in range(n)]
        inp = torch.cat([torch.full((s, 2), r * 10 + q).to(dtype) for q, s in enumerate(in_splits)])
        out_splits = [r % 2 + 1] * n
        o = torch.empty(sum(out_splits), 2, dtype=dtype)
        g.all_to_all_single(o, inp, out_splits, in_splits)
        assert torch.equal(o, torch.cat([torch.full((out_splits[q], 2), q * 10 + r).to(dtype) for q in range(n)]))

        gl = [torch.empty(5, dtype=dtype) for _ in range(n)] if r == 1 % n else None
        g.gather(inputs[r], gl, dst=1 % n)
        if gl is not None:
            for q in range(n):
                assert torch.equal(gl[q], inputs[q])

        sc = torch.empty(5, dtype=dtype)
        g.scatter(sc, list(inputs) if r == 0 else None, src=0)
        assert torch.equal(sc, inputs[r])

        g.barrier()

        if n > 1:
            right, left = (r + 1) % n, (r - 1) % n
            got = torch.empty(5, dtype=dtype)
            w = g.irecv(got, src=left, tag=3)
            g.send(inputs[r], dst=right, tag=3)
            w.wait()
            assert torch.equal(got, inputs[left])


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_op_float32(rank_pools, world_size):
    rank_pools(world_size).run(every_op, "float32")


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.float32], ids=str)
def test_every_op_across_dtypes(rank_pools, dtype):
    rank_pools(3).run(every_op, str(dtype).removeprefix("torch."))


def test_every_op_at_eight_ranks(rank_pools):
    rank_pools(8).run(every_op, "float64", timeout=240)


def shapes_and_async(ctx):
    """0-element, 0-d, non-contiguous and large tensors; async ops with out-of-order waits."""
    r, n = ctx.rank, ctx.size
    with _group(ctx) as g:
        z = torch.empty(0)
        g.all_reduce(z)
        s = torch.tensor(float(r + 1))
        g.all_reduce(s)
        assert s.item() == n * (n + 1) / 2
        base = torch.arange(12.0).reshape(3, 4) * (r + 1)
        view = base.t()
        g.all_reduce(view)
        assert torch.equal(base, torch.arange(12.0).reshape(3, 4) * (n * (n + 1) / 2))
        big = torch.full((3_000_001,), float(r + 1))  # odd, large: ring path
        g.all_reduce(big, ReduceOp.AVG)
        assert torch.all(big == (n + 1) / 2)
        works = [g.all_reduce(torch.full((4,), float(i)), async_op=True) for i in range(6)]
        tensors = [torch.full((4,), float(i + r)) for i in range(6)]
        works = [g.all_reduce(t, async_op=True) for t in tensors]
        for w in reversed(works):
            w.wait()
        for i, t in enumerate(tensors):
            assert torch.equal(t, torch.full((4,), float(n * i + n * (n - 1) / 2)))
        f = torch.ones(3)
        g.all_reduce(f, ReduceOp.premul_sum(0.5))
        assert torch.equal(f, torch.full((3,), 0.5 * n))


@pytest.mark.parametrize("world_size", [2, 4])
def test_shapes_and_async(rank_pools, world_size):
    rank_pools(world_size).run(shapes_and_async)


def two_groups_on_one_store(ctx):
    """Two groups with different names (and one over a subset) on one store, interleaved."""
    r = ctx.rank
    with _group(ctx, name="a") as a, _group(ctx, name="b") as b:
        x, y = torch.ones(2), torch.full((2,), 2.0)
        a.all_reduce(x)
        b.all_reduce(y)
        assert x.tolist() == [ctx.size] * 2 and y.tolist() == [2.0 * ctx.size] * 2
        pair = None
        if r < 2:
            pair = ProcessGroup(ctx.store, rank=1 - r, size=2, name="pair", backends="tcp", timeout=ctx.timeout)
            t = torch.tensor([float(r)])
            pair.all_reduce(t)
            assert t.item() == 1.0
            pair.shutdown()
        a.barrier()
    # re-forming a name after shutdown starts a new generation
    with _group(ctx, name="a") as again:
        t = torch.ones(1)
        again.all_reduce(t)
        assert t.item() == ctx.size
        return again.uid


def test_groups_with_different_names_share_a_store(rank_pools):
    uids = rank_pools(3).run(two_groups_on_one_store)
    assert len(set(uids)) == 1 and uids[0].startswith("a#1-")


def concurrent_threads(ctx):
    """Two groups over the same processes, each driven by its own thread at the same time."""
    errors: list[BaseException] = []
    groups = [_group(ctx, name=f"thread{i}") for i in range(2)]

    def drive(g: ProcessGroup, k: int) -> None:
        try:
            for i in range(50):
                t = torch.full((64,), float(ctx.rank + i + k))
                g.all_reduce(t)
                n = ctx.size
                assert torch.all(t == n * (i + k) + n * (n - 1) / 2), (k, i, t[0])
                if ctx.size > 1:
                    peer = (ctx.rank + 1) % ctx.size
                    got = torch.empty(3)
                    w = g.irecv(got, src=(ctx.rank - 1) % ctx.size, tag=k)
                    g.send(torch.full((3,), float(i)), dst=peer, tag=k)
                    w.wait()
                    assert torch.all(got == i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=drive, args=(g, k)) for k, g in enumerate(groups)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for g in groups:
        g.shutdown()
    if errors:
        raise errors[0]


@pytest.mark.parametrize("world_size", [2, 4])
def test_two_groups_driven_from_two_threads(rank_pools, world_size):
    rank_pools(world_size).run(concurrent_threads)


#: the survivors' all_reduce timeout: longer than the group's (ctx.timeout), so a survivor that
#: only learned of the death at its timeout would report CollectiveTimeout, not PeerFailureError
DEAD_PEER_TIMEOUT_S = 120.0


def dead_peer(ctx):
    g = _group(ctx)
    g.barrier()
    if ctx.rank == 1:
        os._exit(1)
    try:
        g.all_reduce(torch.ones(4), timeout=DEAD_PEER_TIMEOUT_S)
    except (PeerFailureError, CollectiveTimeout) as exc:
        g.abort()
        return (type(exc).__name__, str(exc))
    g.abort()
    return ("no error", "")


def test_a_dead_peer_is_a_peer_failure_not_a_timeout(rank_pools):
    # No clock: the survivors must fail with PeerFailureError, which only the death itself
    # can cause; reaching the timeout is CollectiveTimeout. The pool's bound is a hang guard.
    results = rank_pools(3).run(dead_peer, may_exit=[1], timeout=DEAD_PEER_TIMEOUT_S + 60)
    for rank in (0, 2):
        kind, message = results[rank]
        assert kind == "PeerFailureError", f"rank {rank} got {kind} instead of PeerFailureError: {message}"


def mismatch(ctx):
    g = _group(ctx, timeout=20)
    g.barrier()
    try:
        if ctx.rank == 0:
            g.all_reduce(torch.ones(4))
        else:
            g.broadcast(torch.ones(4), src=0)
        outcome = "no error"
    except (CollectiveMismatchError, PeerFailureError) as exc:
        outcome = type(exc).__name__
    g.abort()
    return outcome


def test_a_collective_mismatch_is_an_error_not_a_hang(rank_pools):
    outcomes = rank_pools(2).run(mismatch, timeout=60)
    assert "CollectiveMismatchError" in outcomes, outcomes
    assert "no error" not in outcomes, outcomes


def timeout_names_the_silent_peer(ctx):
    g = _group(ctx)
    g.barrier()
    result = None
    if ctx.rank != 2:
        try:
            g.all_reduce(torch.ones(2), timeout=2)
        except CollectiveTimeout as exc:
            result = (exc.op, exc.seq, exc.peers)
        ctx.store.set(f"timed-out/{ctx.rank}", "1")
    # nobody closes a connection until ranks 0 and 1 have both timed out, so they see a timeout, not a death
    ctx.store.wait(["timed-out/0", "timed-out/1"])
    g.abort()
    return result


def test_a_timeout_names_op_sequence_number_and_silent_peer(rank_pools):
    results = rank_pools(3).run(timeout_names_the_silent_peer, timeout=90)
    op, seq, peers = results[0]
    assert op == "all_reduce" and seq == 2 and 2 in peers, results


def closed_and_unsupported(ctx):
    g = _group(ctx)
    with pytest.raises(NotSupportedError):
        g.all_reduce(torch.ones(2, dtype=torch.complex64), ReduceOp.MAX)
    with pytest.raises(NotSupportedError):
        g.all_reduce(torch.ones(2, dtype=torch.uint16))
    g.barrier()
    g.shutdown()
    with pytest.raises(GroupClosedError):
        g.barrier()


def test_unsupported_and_closed_raise_locally(rank_pools):
    rank_pools(2).run(closed_and_unsupported)


def pair_while_third_is_idle(ctx):
    """Ranks 0 and 1 exchange while rank 2, in the group, calls nothing until they are done."""
    with _group(ctx) as g:
        if ctx.rank == 2:
            ctx.store.wait(["pair-done"])  # idle: it touches the group only after the pair finished
        elif ctx.rank == 0:
            g.send(torch.arange(4.0), 1)
            g.send_object({"hello": "from 0"}, 1)
            assert g.recv_object(1) == ["from", 1]
        else:
            t = torch.empty(4)
            g.recv(t, 0)
            assert t.tolist() == [0.0, 1.0, 2.0, 3.0]
            assert g.recv_object(0) == {"hello": "from 0"}
            g.send_object(["from", 1], 0)
            ctx.store.set("pair-done", "1")
        t = torch.full((3,), float(ctx.rank + 1))
        g.all_reduce(t)  # then everyone: the connections to rank 2 are made now
        assert t.tolist() == [6.0, 6.0, 6.0]
        g.barrier()
        return ctx.rank


def test_point_to_point_needs_only_its_two_ranks(rank_pools):
    # the pool fails a call whose ranks leave threads or sockets behind
    assert rank_pools(3).run(pair_while_third_is_idle, timeout=120) == [0, 1, 2]


def recv_object_from_a_silent_peer(ctx):
    with _group(ctx, timeout=2.0) as g:
        if ctx.rank == 1:
            ctx.store.wait(["timed-out"])  # alive, in the group, but sends nothing
            return None
        if ctx.rank == 2:
            return None
        with pytest.raises(CollectiveTimeout) as info:
            g.recv_object(1)
        ctx.store.set("timed-out", "1")
        return info.value.op, str(info.value)


def test_a_first_receive_times_out_as_the_users_op(rank_pools):
    op, message = rank_pools(3).run(recv_object_from_a_silent_peer, timeout=120)[0]
    assert op == "recv_object", message
    assert "connect" not in message and "recv_bytes" not in message, message
