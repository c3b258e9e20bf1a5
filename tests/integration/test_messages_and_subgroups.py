"""Objects, tensors of unknown shape, tensor dicts, subgroups and rendezvous, in real
processes over the reference backend, through the public API.

Messages are tried three ways: ``bytes`` (pg-tcp's ``send_bytes``, one message each),
``emulated`` (the same backend with ``send_bytes`` hidden, so the core's eager emulation
on ``send``/``recv`` carries them) and ``separate`` (tensors described by the message and
sent after it on their device backend, the path CUDA tensors take, exercised on the cpu).
"""

from __future__ import annotations

import math
import threading
from datetime import timedelta

import pytest
import torch
from pg_core import (
    CollectiveMismatchError,
    CollectiveTimeout,
    GroupClosedError,
    PeerFailureError,
    ProcessGroup,
    rendezvous,
)
from pg_core.backend import Backend
from pg_core.store import wait_for

pytestmark = pytest.mark.requires_backend("tcp")  # in-repo: missing or broken fails, never skips

FLAVORS = ["bytes", "emulated", "separate"]


def _emulated_backend():
    from pg_tcp.backend import TCPBackend

    class EmulatedTCP(TCPBackend):
        """pg-tcp without variable-size messages: the core emulates them on send/recv."""

        send_bytes = Backend.send_bytes  # type: ignore[assignment]
        recv_bytes = Backend.recv_bytes  # type: ignore[assignment]

    return EmulatedTCP


def _group(ctx, flavor: str = "bytes", **kw) -> ProcessGroup:
    kw.setdefault("timeout", ctx.timeout)
    kw.setdefault("backends", _emulated_backend() if flavor == "emulated" else "tcp")
    group = ProcessGroup(ctx.store, rank=ctx.rank, size=ctx.size, **kw)
    if flavor == "separate":
        group._separate_devices = frozenset({"cpu"})
    return group


def _value(seed: int) -> object:
    """A deterministic object with tensors of several dtypes, shapes and layouts inside."""
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(300, 70, generator=g)  # 84 KB: past the eager chunk and pg-core's small-message size
    return {
        "seed": seed,
        "text": f"request-{seed} ✓",
        "floats": [0.5, math.inf, -0.0, seed / 7],
        "nested": {"ids": list(range(seed % 5)), "none": None, "flag": bool(seed % 2), "raw": bytes([seed % 256])},
        "tensors": (
            torch.randint(-100, 100, (seed % 4 + 1, 3), generator=g, dtype=torch.int64),
            torch.tensor(seed, dtype=torch.int8),
            torch.empty(0, 2, dtype=torch.bfloat16),
            big.t()[::3],  # non-contiguous
            torch.complex(torch.ones(3), torch.arange(3.0)).conj(),
        ),
        "big": big,
    }


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
            return False
        return torch.equal(a.resolve_conj(), b.resolve_conj())
    if isinstance(a, float) and isinstance(b, float):
        return (a == b and math.copysign(1, a) == math.copysign(1, b)) or (math.isnan(a) and math.isnan(b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def _kv(seed: int) -> dict:
    """A kv-cache transfer: blocks of several shapes and dtypes plus plain metadata."""
    g = torch.Generator().manual_seed(seed)
    return {
        "request_id": f"req-{seed}",
        "block_ids": [3, 1, 4],
        "layers": {
            f"layer{i}": {"k": torch.randn(2, 4, 8, generator=g).half(), "v": torch.randn(2, 4, 8, generator=g)}
            for i in range(3)
        },
        "positions": torch.arange(17, dtype=torch.int32),
        "scale": 0.125,
    }


# -- point to point ------------------------------------------------------------------


def p2p_values(ctx, flavor: str) -> None:
    r = ctx.rank
    with _group(ctx, flavor) as g:
        g.barrier()
        if r == 0:
            g.send(torch.full((3,), 5.0), 1)  # tensor traffic on tag 0 is apart from object traffic on tag 0
            for seed in range(3):
                g.send_object(_value(seed), 1)
            g.send_tensor(torch.arange(12, dtype=torch.float64).reshape(3, 4).t(), 1, tag=5)
            g.send_tensor(torch.tensor(7, dtype=torch.int16), 1, tag=5)
            g.send_tensor(torch.empty(0, 3), 1, tag=5)
            g.send_tensor_dict(_kv(1), 1, tag=2)
            works = [g.send_object(i, 1, tag=9, async_op=True) for i in range(5)]
            for w in works:
                assert w.wait() and w.result() is None
            g.send_object("not a tensor", 1, tag=11)
            w = g.send_tensor_dict(_kv(2), 1, tag=12, async_op=True)
            assert g.recv_object(1, tag=13) == "echo"
            w.wait()
        elif r == 1:
            values = [g.recv_object(0) for _ in range(3)]  # objects first: they wait in the other namespace
            t = torch.empty(3)
            g.recv(t, 0)
            assert torch.equal(t, torch.full((3,), 5.0))
            for seed, got in enumerate(values):
                assert _same(got, _value(seed)), seed
            a, b, c = (g.recv_tensor(0, tag=5) for _ in range(3))
            assert _same(a, torch.arange(12, dtype=torch.float64).reshape(3, 4).t().contiguous())
            assert _same(b, torch.tensor(7, dtype=torch.int16)) and b.dim() == 0
            assert _same(c, torch.empty(0, 3))
            assert _same(g.recv_tensor_dict(0, "cpu", tag=2), _kv(1))
            works = [g.recv_object(0, tag=9, async_op=True) for _ in range(5)]
            assert [w.result() for w in works] == list(range(5))
            with pytest.raises(
                CollectiveMismatchError, match="sent an object with tag 11, where this rank expected a tensor"
            ):
                g.recv_tensor(0, tag=11)
            w = g.recv_tensor_dict(0, tag=12, async_op=True)
            g.send_object("echo", 0, tag=13)
            assert _same(w.result(), _kv(2))
        g.barrier()


@pytest.mark.parametrize("flavor", FLAVORS)
def test_objects_tensors_and_dicts_point_to_point(rank_pools, flavor):
    rank_pools(3).run(p2p_values, flavor)


def bad_input_and_timeouts(ctx) -> None:
    r = ctx.rank
    # the group's own timeout lies far beyond the test's hang guard (the pool's 120 s), so the
    # recv that must time out below can only end in time through its own timeout=0.5
    with _group(ctx, timeout=3600) as g:
        g.barrier()
        with pytest.raises(ValueError, match="cannot send to itself"):
            g.send_object(1, r)
        with pytest.raises(ValueError, match="out of range"):
            g.send_tensor(torch.ones(1), ctx.size)
        with pytest.raises(ValueError, match="tag"):
            g.send_object(1, 1 - r, tag=-1)
        with pytest.raises(TypeError):
            g.send_tensor([1, 2], 1 - r)
        with pytest.raises(TypeError, match="dict"):
            g.send_tensor_dict([torch.ones(1)], 1 - r)
        with pytest.raises((TypeError, AttributeError, Exception), match="pickle|lambda|local"):
            g.send_object({"f": lambda: 1}, 1 - r)
        with pytest.raises(ValueError, match="not a device"):
            g.recv_tensor(1 - r, device="no-such-device")
        with pytest.raises(ValueError, match="one object per rank"):
            g.scatter_object([1], src=r)
        with pytest.raises(ValueError, match="only passed on the source"):
            g.broadcast_tensor_dict({"a": 1}, src=1 - r)
        # nothing of the above was sent: the next message on each stream is the first one
        with pytest.raises(CollectiveTimeout) as info:
            g.recv_object(1 - r, tag=3, timeout=0.5)
        assert info.value.op == "recv_object", info.value
        g.send_object(("first", r), 1 - r)
        assert g.recv_object(1 - r) == ("first", 1 - r)
        g.send_object("late", 1 - r, tag=3)  # the stream that timed out still works
        assert g.recv_object(1 - r, tag=3) == "late"
    with pytest.raises(GroupClosedError):
        g.send_object(1, 1 - r)
    with pytest.raises(GroupClosedError):
        g.all_gather_object(1)


def test_bad_input_fails_locally_and_a_timeout_leaves_the_stream_usable(rank_pools):
    rank_pools(2).run(bad_input_and_timeouts)


def _default_async_backend():
    from pg_tcp.backend import TCPBackend

    class HelperAsyncTCP(TCPBackend):
        """pg-tcp with the core's default isend/irecv (a helper thread per (peer, tag))."""

        isend = Backend.isend  # type: ignore[assignment]
        irecv = Backend.irecv  # type: ignore[assignment]

    return HelperAsyncTCP


def blocking_behind_async(ctx, flavor: str) -> None:
    """A blocking send or receive never overtakes an asynchronous one on the same (peer, tag):
    messages (and tensors over a backend with the default isend/irecv) keep their order."""
    r = ctx.rank
    kw = {"backends": _default_async_backend()} if flavor == "default-async" else {}
    with _group(ctx, "bytes" if flavor == "default-async" else flavor, **kw) as g:
        g.barrier()
        for round_ in range(30):
            big = torch.full((70_000,), float(round_))  # large: its async send is still going
            if r == 0:
                w1 = g.send_tensor(big, 1, tag=1, async_op=True)
                g.send_object(("second", round_), 1, tag=1)
                w2 = g.isend(big, 1, tag=2)
                g.send(torch.full((3,), float(round_)), 1, tag=2)
                w1.wait()
                w2.wait()
                # the receiving side posts asynchronously, then blocks
                g.send_object(("first", round_), 1, tag=3)
                g.send_tensor(torch.arange(3), 1, tag=3)
            else:
                assert torch.equal(g.recv_tensor(0, tag=1), big)
                assert g.recv_object(0, tag=1) == ("second", round_)
                a, b = torch.empty(70_000), torch.empty(3)
                g.recv(a, 0, tag=2)
                g.recv(b, 0, tag=2)
                assert torch.equal(a, big) and torch.equal(b, torch.full((3,), float(round_)))
                w = g.recv_object(0, tag=3, async_op=True)
                assert torch.equal(g.recv_tensor(0, tag=3), torch.arange(3))  # raises if it overtook w
                assert w.result() == ("first", round_)
        g.barrier()


@pytest.mark.parametrize("flavor", [*FLAVORS, "default-async"])
def test_a_blocking_call_never_overtakes_an_asynchronous_one(rank_pools, flavor):
    rank_pools(2).run(blocking_behind_async, flavor)


# -- collectives of objects ------------------------------------------------------------


def object_collectives(ctx, flavor: str) -> None:
    r, n = ctx.rank, ctx.size
    with _group(ctx, flavor) as g:
        for root in range(n):
            mine = _value(root)
            got = g.broadcast_object(mine if r == root else None, src=root)
            assert _same(got, _value(root))
            assert (got is mine) == (r == root)  # the source keeps its own object
        everyone = g.all_gather_object(_value(10 + r))
        assert len(everyone) == n and all(_same(everyone[q], _value(10 + q)) for q in range(n))
        for dst in range(n):
            got = g.gather_object(("from", r, torch.full((r + 1,), float(r))), dst=dst)
            if r == dst:
                assert all(_same(got[q], ("from", q, torch.full((q + 1,), float(q)))) for q in range(n))
            else:
                assert got is None
        for src in range(n):
            got = g.scatter_object([_value(20 + q) for q in range(n)] if r == src else None, src=src)
            assert _same(got, _value(20 + r))
        for src in range(n):
            d = g.broadcast_tensor_dict(_kv(src) if r == src else None, src=src)
            assert _same(d, _kv(src))
        # asynchronous, ordered with the tensor collectives queued around it
        t = torch.ones(2)
        w1 = g.all_reduce(t, async_op=True)
        w2 = g.all_gather_object({"rank": r}, async_op=True)
        w3 = g.broadcast_tensor_dict({"x": torch.arange(3)} if r == 0 else None, async_op=True)
        assert w2.result() == [{"rank": q} for q in range(n)]
        assert _same(w3.result(), {"x": torch.arange(3)})
        w1.wait()
        assert torch.equal(t, torch.full((2,), float(n)))


@pytest.mark.parametrize("flavor", FLAVORS)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_object_collectives(rank_pools, world_size, flavor):
    rank_pools(world_size).run(object_collectives, flavor, timeout=180)


def collective_mismatch(ctx) -> str:
    r = ctx.rank
    with _group(ctx, timeout=10) as g:
        g.barrier()
        try:
            if r == 0:
                g.broadcast_object("hello", src=0)  # rank 1 calls all_gather_object instead
                g.all_gather_object(r)
            else:
                g.all_gather_object(r)
        except CollectiveMismatchError as exc:
            return str(exc)
        finally:
            # rank 1 stays in the group until rank 0 has seen its message: a rank that left is
            # another failure (rank 0's send to it raises PeerFailureError), not this test's
            if r == 0:
                ctx.store.set("mismatch-seen", "1")
            else:
                ctx.store.wait(["mismatch-seen"], timedelta(seconds=30))
        return "no error"


def test_ranks_in_different_object_collectives_get_a_mismatch_error(rank_pools):
    said = rank_pools(2).run(collective_mismatch, timeout=60)
    # the barrier was collective #1
    assert "all_gather_object (collective #2): rank 0 sent a message of broadcast_object (collective #2)" in said[1]
    assert "all_gather_object (collective #3): rank 1 sent a message of all_gather_object (collective #2)" in said[0]


# -- subgroups ---------------------------------------------------------------------------


def split_and_new_group(ctx) -> None:
    r = ctx.rank
    with _group(ctx) as g:
        colors, keys = [0, 1, 0, None], [5, 0, 1, 0]
        sub = g.split(colors[r], key=keys[r])
        if r == 3:
            assert sub is None
        else:
            expected = {0: (2, 0), 1: (1,)}[colors[r]]
            assert sub.parent_ranks == expected and sub.rank == expected.index(r) and sub.size == len(expected)
            assert sub.all_gather_object(r) == list(expected)  # ranked by key, then parent rank
            t = torch.tensor([float(r)])
            sub.all_reduce(t)
            assert t.item() == sum(expected)
            nested = sub.split(0, key=-sub.rank)  # reversed
            assert nested.parent_ranks == tuple(reversed(range(sub.size)))
            assert nested.broadcast_object(("nested", r) if nested.rank == 0 else None) == ("nested", expected[-1])
            nested.shutdown()
            sub.shutdown()
        assert g.parent_ranks is None
        if r in (1, 3):  # the same members twice, both alive at once; ranks in the order given
            a, b = g.new_group([3, 1]), g.new_group([3, 1])
            assert a.rank == b.rank == (0 if r == 3 else 1) and a.parent_ranks == (3, 1)
            assert a.name != b.name
            wa = a.all_gather_object(("a", r), async_op=True)
            assert b.all_gather_object(("b", r)) == [("b", 3), ("b", 1)]
            assert wa.result() == [("a", 3), ("a", 1)]
            if r == 1:
                b.send_tensor(torch.arange(5), 0)
            else:
                assert torch.equal(b.recv_tensor(1), torch.arange(5))
            a.shutdown()
            b.shutdown()
        else:
            with pytest.raises(ValueError, match="only the members call new_group"):
                g.new_group([1, 3])
            with pytest.raises(ValueError, match="twice"):
                g.new_group([r, r])
            with pytest.raises(ValueError, match="out of range"):
                g.new_group([r, 4])
            for _ in range(2):  # a named subgroup formed again after shutdown
                pair = g.new_group([2, 0], name="pair")
                assert pair.name == "pair" and pair.parent_ranks == (2, 0)
                t = torch.ones(1)
                pair.all_reduce(t)
                assert t.item() == 2
                pair.shutdown()
        with pytest.raises(ValueError, match="color"):
            g.split(-1)
        g.barrier()


def test_split_and_new_group(rank_pools):
    rank_pools(4).run(split_and_new_group, timeout=120)


def formed_again_before_the_others_came(ctx) -> list[float]:
    """Rank 0 forms a named subgroup, shuts it down and forms it again before rank 1 has even
    come to the first formation (a subgroup forms without waiting for its members): the second
    formation is a new one for both, not rank 0's old place taken twice."""
    g = _group(ctx)
    try:
        if ctx.rank == 1:
            wait_for(ctx.store, ["reformed/0"], 60)  # rank 0 is done with its first formation
        first = g.new_group([0, 1], name="pair")
        first.shutdown()
        if ctx.rank == 0:
            ctx.store.set("reformed/0", "1")
        again = g.new_group([0, 1], name="pair")
        t = torch.full((1,), float(ctx.rank + 1))
        again.all_reduce(t)
        again.shutdown()
        return t.tolist()
    finally:
        g.shutdown()


def test_a_subgroup_formed_again_before_the_others_came_to_the_first(rank_pools):
    assert rank_pools(2).run(formed_again_before_the_others_came, timeout=120) == [[3.0], [3.0]]


def subgroups_of_two_parents(ctx) -> None:
    """Two parents on the same ranks (in different orders), each splitting and using its
    subgroups from its own thread at the same time."""
    r, n = ctx.rank, ctx.size
    errors: list[BaseException] = []

    def drive(parent: ProcessGroup) -> None:
        try:
            for round_ in range(3):
                sub = parent.split(parent.rank % 2, key=round_)
                got = sub.all_gather_object((parent.name, parent.rank))
                assert got == [(parent.name, p) for p in sub.parent_ranks]
                pair = parent.new_group([0, n - 1]) if parent.rank in (0, n - 1) else None
                if pair is not None:
                    assert pair.broadcast_object(parent.name if pair.rank == 0 else None) == parent.name
                    pair.shutdown()
                sub.shutdown()
        except BaseException as exc:
            errors.append(exc)

    with (
        _group(ctx, name="first") as first,
        ProcessGroup(ctx.store, rank=n - 1 - r, size=n, backends="tcp", name="second", timeout=ctx.timeout) as second,
    ):
        threads = [threading.Thread(target=drive, args=(p,)) for p in (first, second)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=ctx.timeout * 2)
        assert not any(t.is_alive() for t in threads), "a thread is stuck"
        if errors:
            raise errors[0]


@pytest.mark.parametrize("world_size", [3, 4])
def test_subgroups_of_different_parents_in_flight_at_once(rank_pools, world_size):
    rank_pools(world_size).run(subgroups_of_two_parents, timeout=180)


# -- rendezvous -------------------------------------------------------------------------


def arrival_order(ctx) -> tuple[int, list[int]]:
    """Pool rank p calls rendezvous only once pool rank p - 1 has claimed its place (the
    rank key that the store holds for the formation's generation 0)."""
    if ctx.rank > 0:
        wait_for(ctx.store, [f"pg-core/arrivals/0/rank/{ctx.rank - 1}"], ctx.timeout)
    g = rendezvous(ctx.store, "arrivals", ctx.size, backends="tcp", timeout=ctx.timeout)
    with g:  # point to point works as the first operation
        g.send_object(g.rank, (g.rank + 1) % g.size)
        assert g.recv_object((g.rank - 1) % g.size) == (g.rank - 1) % g.size
        return g.rank, g.all_gather_object(ctx.rank)


def test_rendezvous_ranks_by_arrival(rank_pools):
    results = rank_pools(3).run(arrival_order, timeout=120)
    assert [rank for rank, _ in results] == [0, 1, 2]
    assert all(everyone == [0, 1, 2] for _, everyone in results)


def latecomer(ctx) -> str:
    """Ranks 0 and 1 fill a group of two; rank 2 arrives after it filled."""
    if ctx.rank < 2:
        g = rendezvous(ctx.store, "pair", 2, backends="tcp", timeout=ctx.timeout)
        with g:
            ctx.store.set(f"formed/{ctx.rank}", "1")
            g.barrier()
            ctx.store.wait(["latecomer-done"])
            return f"rank {g.rank}"
    ctx.store.wait(["formed/0", "formed/1"])
    try:
        rendezvous(ctx.store, "pair", 2, backends="tcp", timeout=1.0)
    except CollectiveTimeout as exc:
        return str(exc)
    finally:
        ctx.store.set("latecomer-done", "1")
    return "formed a group alone"


def test_a_process_arriving_after_the_group_filled_waits_for_the_next_formation(rank_pools):
    results = rank_pools(3).run(latecomer, timeout=120)
    assert sorted(results[:2]) == ["rank 0", "rank 1"]
    assert "1 of 2 members arrived" in results[2] and "earlier generations" in results[2], results[2]


#: the patient member's rendezvous timeout; reaching it would be CollectiveTimeout, not PeerFailureError
PATIENT_TIMEOUT_S = 120.0


def give_up(ctx) -> tuple[str, str]:
    """A group of three that only two processes join; the impatient one gives up first."""
    if ctx.rank == 2:
        return "absent", ""
    try:
        rendezvous(ctx.store, "trio", 3, backends="tcp", timeout=1.0 if ctx.rank == 0 else PATIENT_TIMEOUT_S)
    except (CollectiveTimeout, PeerFailureError) as exc:
        return type(exc).__name__, str(exc)
    return "formed", ""


def test_a_rendezvous_that_times_out_releases_the_others_at_once(rank_pools):
    # No clock: the patient member is released by the other's giving up (PeerFailureError), not
    # by its own timeout (CollectiveTimeout). The pool's bound is a hang guard.
    results = rank_pools(3).run(give_up, timeout=PATIENT_TIMEOUT_S + 60)
    assert results[0][0] == "CollectiveTimeout", results[0]
    assert results[1][0] == "PeerFailureError", results[1]
