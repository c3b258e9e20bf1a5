"""``with group.coalescing():`` across real processes, on pg-gloo and pg-tcp (which run a batch
one call after another) and on backends with the hook (``Backend.coalesced``) that launch it as
one: a recording one over pg-tcp, and pg-core's ``C10dBackend.coalesced`` over a Gloo that
coalesces the way ProcessGroupNCCL does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as dist
from pg_core import P2POp, ProcessGroup
from pg_core.backend import Backend, Call
from pg_core.c10d import C10dBackend
from pg_core.errors import CollectiveTimeout, NotSupportedError
from pg_core.store import wait_for
from pg_core.testing.pool import RankContext, RankPool
from pg_core.work import Work, all_of
from pg_gloo.backend import GlooBackend
from pg_tcp.backend import TCPBackend

Pools = Callable[[int], RankPool]

BACKENDS = [
    pytest.param("gloo", marks=pytest.mark.requires_backend("gloo")),
    pytest.param("tcp", marks=pytest.mark.requires_backend("tcp")),
]


def _group(ctx: RankContext, backends: Any) -> ProcessGroup:
    return ProcessGroup(ctx.store, ctx.rank, ctx.size, backends=backends, timeout=ctx.timeout)


def _inputs(rank: int) -> list[torch.Tensor]:
    """All-reduce inputs of several sizes and dtypes, one of them a non-contiguous view."""
    g = torch.Generator().manual_seed(rank)
    return [
        torch.randn(5, generator=g),
        torch.randn(1000, generator=g, dtype=torch.float64),
        torch.randint(-(2**20), 2**20, (3, 4), generator=g, dtype=torch.int32),
        torch.randn(6, 4, generator=g).t(),  # staged: copied back after the batch
        torch.randn((), generator=g, dtype=torch.bfloat16),
        torch.randn(0, generator=g),
    ]


# -- a batch gives what the calls give one by one --------------------------------------------


def same_as_one_by_one(ctx: RankContext, backends: Any) -> dict[str, Any]:
    n, r = ctx.size, ctx.rank
    group = _group(ctx, backends)
    try:
        alone = _inputs(r)
        for t in alone:
            group.all_reduce(t)
        batched = _inputs(r)
        gathered, scattered = torch.empty(2 * n), torch.empty(3)
        root = torch.full((4,), float(r))
        before = group._executor._next_seq
        with group.coalescing() as batch:
            for t in batched[:-1]:
                assert group.all_reduce(t) is None  # recorded: nothing sent yet
            last = group.all_reduce(batched[-1], async_op=True)
            group.broadcast(root, src=n - 1)
            group.all_gather_into_tensor(gathered, torch.full((2,), float(r)))
            group.reduce_scatter_tensor(scattered, torch.arange(3.0 * n) + r)
            untouched = [t.clone() for t in batched]
        numbers = group._executor._next_seq - before
        assert last is not None and last.is_completed()
        return {
            "equal": [torch.equal(a, b) for a, b in zip(alone, batched, strict=True)],
            "untouched_inside": [torch.equal(u, t) for u, t in zip(untouched, _inputs(r), strict=True)],
            "broadcast": root.tolist(),
            "gathered": gathered.tolist(),
            "scattered": scattered.tolist(),
            "numbers": numbers,
            "done": batch.work.is_completed(),
        }
    finally:
        group.shutdown()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_batch_of_collectives_gives_what_they_give_one_by_one(rank_pools: Pools, backend: str) -> None:
    n = 3
    for r, got in enumerate(rank_pools(n).run(same_as_one_by_one, backend, timeout=120)):
        assert got["equal"] == [True] * 6, got
        assert got["untouched_inside"] == [True] * 6  # nothing moved before the block's exit
        assert got["broadcast"] == [float(n - 1)] * 4
        assert got["gathered"] == [float(s) for s in range(n) for _ in range(2)]
        assert got["scattered"] == [float(sum(3 * r + i + s for s in range(n))) for i in range(3)]
        assert got["numbers"] == 9  # one sequence number per collective, as one by one
        assert got["done"] is True


def numbered_alike(ctx: RankContext, backend: str) -> list[Any]:
    """Rank 0 coalesces three all-reduces, the others call them one by one: the object
    collective after them (whose messages carry the sequence number) must still match."""
    group = _group(ctx, backend)
    try:
        ts = [torch.full((k + 1,), float(ctx.rank)) for k in range(3)]
        if ctx.rank == 0:
            with group.coalescing():
                for t in ts:
                    group.all_reduce(t)
        else:
            for t in ts:
                group.all_reduce(t)
        return [group.all_gather_object(ctx.rank), [t.tolist() for t in ts]]
    finally:
        group.shutdown()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_batch_takes_the_sequence_numbers_its_collectives_would_take(rank_pools: Pools, backend: str) -> None:
    n = 3
    total = float(sum(range(n)))
    for got in rank_pools(n).run(numbered_alike, backend, timeout=120):
        assert got == [list(range(n)), [[total] * (k + 1) for k in range(3)]]


# -- point to point in a block ----------------------------------------------------------------


def ring(ctx: RankContext, backends: Any, async_block: bool) -> dict[str, Any]:
    n, r = ctx.size, ctx.rank
    right, left = (r + 1) % n, (r - 1) % n
    group = _group(ctx, backends)
    try:
        got = torch.zeros(4)
        strided = torch.zeros(4, 2)[:, 0]  # a non-contiguous receive buffer: copied back with the batch
        total = torch.full((3,), float(r + 1))
        with group.coalescing(async_op=async_block) as batch:
            recv = group.irecv(got, left)
            group.irecv(strided, left, tag=7)
            group.isend(torch.full((4,), float(r)), right)
            group.all_reduce(total)
            group.isend(torch.full((4,), 10.0 + r), right, tag=7)
        if async_block:
            batch.wait(timeout=60)
        pairs = [torch.full((2,), float(r)), torch.zeros(2)]
        works = group.batch_isend_irecv(
            [P2POp(group.isend, pairs[0], right, tag=3), P2POp(group.irecv, pairs[1], left, tag=3)]
        )
        for work in works:
            work.wait(timeout=60)
        return {
            "recv": got.tolist(),
            "strided": strided.tolist(),
            "sum": total.tolist(),
            "recv_done": recv.is_completed(),
            "batch_done": batch.work.is_completed(),
            "batched_pairs": pairs[1].tolist(),
        }
    finally:
        group.shutdown()


@pytest.mark.parametrize("async_block", [False, True], ids=["blocking", "async"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_ring_of_isend_irecv_and_a_collective_in_one_block(
    rank_pools: Pools, backend: str, async_block: bool
) -> None:
    n = 3
    for r, got in enumerate(rank_pools(n).run(ring, backend, async_block, timeout=120)):
        left = (r - 1) % n
        assert got["recv"] == [float(left)] * 4
        assert got["strided"] == [10.0 + left] * 4
        assert got["sum"] == [6.0] * 3
        assert got["recv_done"] and got["batch_done"]
        assert got["batched_pairs"] == [float(left)] * 2


# -- what a block refuses, and what a failed block leaves --------------------------------------


def bad_input_sends_nothing(ctx: RankContext, backend: str) -> dict[str, Any]:
    n, r = ctx.size, ctx.rank
    right, left = (r + 1) % n, (r - 1) % n
    group = _group(ctx, backend)
    try:
        out: dict[str, Any] = {}
        kept = torch.full((3,), float(r + 1))
        stale = torch.full((2,), -1.0)
        with pytest.raises(ValueError, match="out of range") as err, group.coalescing():
            group.all_reduce(kept)
            sent = group.isend(stale, right)
            group.broadcast(torch.zeros(1), src=n)  # bad input: raises here, before anything is sent
        out["error"] = str(err.value)
        out["kept"] = kept.tolist()  # not reduced: the batch was never issued
        with pytest.raises(RuntimeError, match="not sent"):
            sent.wait(timeout=10)
        with pytest.raises(NotSupportedError), group.coalescing():  # not declared: raises at the call as well
            group.all_reduce(torch.ones(2, dtype=torch.complex64), op="max")
        # the next ops work: no rank sent anything of the failed blocks, so none is out of step
        fresh = torch.zeros(2)
        with group.coalescing():
            group.irecv(fresh, left)
            group.isend(torch.full((2,), float(r)), right)
            group.all_reduce(kept)
        out["after"] = (fresh.tolist(), kept.tolist())
        return out
    finally:
        group.shutdown()


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input_in_a_block_raises_at_the_call_and_sends_nothing(rank_pools: Pools, backend: str) -> None:
    n = 3
    for r, got in enumerate(rank_pools(n).run(bad_input_sends_nothing, backend, timeout=120)):
        assert "src=3 is out of range" in got["error"]
        assert got["kept"] == [float(r + 1)] * 3
        assert got["after"] == ([float((r - 1) % n)] * 2, [6.0] * 3)


class MetaNull(Backend):
    """A backend for ``meta`` tensors (no data): here so a group has a second device type."""

    def all_reduce(self, tensor: torch.Tensor, op: Any, *, timeout: float) -> None:
        pass


def refusals(ctx: RankContext, backend: str) -> dict[str, str]:
    group = _group(ctx, {"cpu": backend, "meta": MetaNull})
    right = (ctx.rank + 1) % ctx.size
    try:
        out: dict[str, str] = {}
        cases: dict[str, Callable[[], Any]] = {
            "nested": lambda: group.coalescing().__enter__(),
            "object": lambda: group.broadcast_object({"a": 1}, src=0),
            "tensor_dict": lambda: group.send_tensor_dict({"t": torch.ones(1)}, right),
            "barrier": group.barrier,
            "monitored_barrier": group.monitored_barrier,
            "send": lambda: group.send(torch.ones(1), right),
            "device": lambda: group.all_reduce(torch.ones(1, device="meta")),
            "wait_inside": lambda: group.all_reduce(torch.ones(1), async_op=True).wait(timeout=5),  # type: ignore[union-attr]
        }
        if group.supports("recv_anysource"):  # a batch names every peer
            cases["any_source"] = lambda: group.irecv(torch.ones(1), None)
        for name, call in cases.items():
            try:
                with group.coalescing():
                    group.all_reduce(torch.ones(2))
                    call()
            except (RuntimeError, ValueError) as exc:
                out[name] = f"{type(exc).__name__}: {exc}"
        # another group's ops in the block are its own, not captured: they run at once
        other = ProcessGroup(ctx.store, ctx.rank, ctx.size, backends=backend, name="other", timeout=ctx.timeout)
        try:
            mine, theirs = torch.ones(1), torch.ones(1)
            with group.coalescing():
                group.all_reduce(mine)
                other.all_reduce(theirs)
                out["other_group_inside"] = str(theirs.item())
                out["mine_inside"] = str(mine.item())
            out["mine_after"] = str(mine.item())
        finally:
            other.shutdown()
        group.all_reduce(torch.ones(1))  # still in step
        return out
    finally:
        group.shutdown()


@pytest.mark.parametrize("backend", BACKENDS)
def test_what_a_block_refuses(rank_pools: Pools, backend: str) -> None:
    n = 2
    for got in rank_pools(n).run(refusals, backend, timeout=120):
        assert "blocks do not nest" in got["nested"]
        for name in ("object", "tensor_dict", "barrier", "monitored_barrier"):
            assert got[name].startswith("RuntimeError:") and "cannot run inside a coalescing block" in got[name]
        assert "use isend" in got["send"]
        assert got["device"].startswith("ValueError:") and "one device type" in got["device"]
        assert "waited for inside its coalescing block" in got["wait_inside"]
        if "any_source" in got:
            assert (
                got["any_source"].startswith("RuntimeError:") and "cannot join a coalescing block" in got["any_source"]
            )
        assert (got["other_group_inside"], got["mine_inside"], got["mine_after"]) == (str(float(n)), "1.0", "2.0")


def timed_out(ctx: RankContext, backend: str) -> dict[str, Any]:
    """Rank 1 joins the first all-reduce of rank 0's batch, not the second: that one times out,
    named with its own sequence number, and the group's later collectives are refused."""
    group = _group(ctx, backend)
    try:
        group.all_reduce(torch.ones(1))  # both ranks are up (and Gloo connected)
        if ctx.rank == 1:
            group.all_reduce(torch.ones(1))
            wait_for(ctx.store, ["gave_up"], 60)
            return {}
        first = group._executor._next_seq
        with pytest.raises(CollectiveTimeout) as err, group.coalescing():
            group.all_reduce(torch.ones(1))
            group.all_reduce(torch.ones(2), timeout=1)
        with pytest.raises(CollectiveTimeout) as refused:
            group.all_reduce(torch.ones(1))
        ctx.store.set("gave_up", "1")
        return {"op": err.value.op, "seq": err.value.seq, "first": first, "refused": str(refused.value)}
    finally:
        group.shutdown()


@pytest.mark.requires_backend("tcp")
def test_a_collective_that_fails_in_a_batch_is_named_and_stops_the_groups_collectives(rank_pools: Pools) -> None:
    got, _ = rank_pools(2).run(timed_out, "tcp", timeout=120)
    assert (got["op"], got["seq"]) == ("all_reduce", got["first"] + 1)
    assert f"stopped after all_reduce (collective #{got['first'] + 1}) failed" in got["refused"]


# -- a backend that coalesces gets the whole batch in one call --------------------------------


class CoalescingTCP(TCPBackend):
    """pg-tcp with the hook: records each batch it gets, then runs it (receives and sends as
    ``irecv``/``isend``, collectives in order) and returns one work for all of it."""

    coalesces = True
    batches: ClassVar[list[list[tuple[str, tuple[int, ...]]]]] = []

    def coalesced(self, calls: Sequence[Call]) -> Work:
        CoalescingTCP.batches.append([(c.op, tuple(c.args[0].shape)) for c in calls])
        works = []
        for c in calls:
            if c.op in ("send", "recv"):
                works.append(getattr(self, "i" + c.op)(*c.args, timeout=c.timeout))
            else:
                getattr(self, c.op)(*c.args, timeout=c.timeout)
        return all_of("coalesced", works)


def one_launch(ctx: RankContext) -> dict[str, Any]:
    n, r = ctx.size, ctx.rank
    right, left = (r + 1) % n, (r - 1) % n
    CoalescingTCP.batches = []
    group = _group(ctx, CoalescingTCP)
    try:
        a, b = torch.full((2,), float(r)), torch.full((3, 1), float(r), dtype=torch.float64)
        got = torch.zeros(1)
        with group.coalescing(async_op=True) as batch:
            group.all_reduce(a)
            group.irecv(got, left)
            group.isend(torch.full((1,), float(r)), right)
            group.all_reduce(b)
        batch.wait(timeout=60)
        pair = torch.zeros(4)
        for work in group.batch_isend_irecv(
            [P2POp("irecv", pair, left), P2POp("isend", torch.full((4,), float(r)), right)]
        ):
            work.wait(timeout=60)
        return {
            "batches": CoalescingTCP.batches,
            "values": (a.tolist(), b.flatten().tolist(), got.item(), pair.tolist()),
        }
    finally:
        group.shutdown()


@pytest.mark.requires_backend("tcp")
def test_a_backend_that_coalesces_gets_the_whole_batch_in_one_call(rank_pools: Pools) -> None:
    n = 3
    total = float(sum(range(n)))
    for r, got in enumerate(rank_pools(n).run(one_launch, timeout=120)):
        left = float((r - 1) % n)
        assert got["batches"] == [
            [("all_reduce", (2,)), ("recv", (1,)), ("send", (1,)), ("all_reduce", (3, 1))],
            [("recv", (4,)), ("send", (4,))],  # batch_isend_irecv: the same mechanism
        ]
        assert got["values"] == ([total] * 2, [total] * 3, left, [left] * 4)


# -- C10dBackend.coalesced, on CPU: a Gloo that coalesces as ProcessGroupNCCL does --------------


class _Coalesced:
    """Torch's work for a batch: completes when all of the batch's torch works have."""

    def __init__(self, works: list[Any]) -> None:
        self._works = works

    def get_future(self) -> Any:
        return torch.futures.collect_all([w.get_future() for w in self._works])

    def wait(self, timeout: Any = None) -> bool:
        for w in self._works:
            w.wait()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)


class _GroupCalls:
    """A ``ProcessGroupGloo`` that coalesces, the way ProcessGroupNCCL's calls behave: between
    ``_start_coalescing()`` and ``_end_coalescing()`` a call is held (it returns no work) and
    the end posts them all and returns one work. Records what it held, per thread."""

    supports_coalescing = True

    def __init__(self, pg: Any) -> None:
        self._pg = pg
        self._held: list[tuple[str, Callable[[], Any]]] | None = None
        self.batches: list[list[str]] = []

    def _start_coalescing(self) -> None:
        assert self._held is None, "torch's coalescing does not nest"
        self._held = []

    def _end_coalescing(self) -> Any:
        held, self._held = self._held, None
        assert held is not None
        self.batches.append([name for name, _ in held])
        return _Coalesced([post() for _, post in held])

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._pg, name)
        if not callable(attr) or (name.startswith("_") and name not in ("_allgather_base", "_reduce_scatter_base")):
            return attr

        def call(*args: Any) -> Any:
            if self._held is None:
                return attr(*args)
            self._held.append((name, lambda: attr(*args)))
            return None

        return call


class CoalescingGloo(GlooBackend):
    """pg-gloo whose torch object coalesces (:class:`_GroupCalls`): what pg-nccl gets from NCCL."""

    last: ClassVar[CoalescingGloo]
    coalesces = C10dBackend.coalesces  # what pg-gloo turns off: the torch object's own word, as for pg-nccl

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self._pg = _GroupCalls(self._pg)
        CoalescingGloo.last = self


def c10d_coalesced(ctx: RankContext, async_block: bool) -> dict[str, Any]:
    n, r = ctx.size, ctx.rank
    group = _group(ctx, CoalescingGloo)
    try:
        group.all_reduce(torch.ones(1))  # the backend exists: an async block launches in this thread
        backend = CoalescingGloo.last
        alone = _inputs(r)
        for t in alone:
            group.all_reduce(t)
        batched = _inputs(r)
        gathered = torch.empty(n, 2)
        root = torch.full((3,), float(r))
        works = []
        with group.coalescing(async_op=async_block) as batch:
            for t in batched:
                works.append(group.all_reduce(t, async_op=True))
            group.broadcast(root, src=0)
            group.all_gather_into_tensor(gathered, torch.full((2,), float(r)))
        if async_block:
            batch.wait(timeout=60)
        group.all_reduce(torch.ones(3))
        return {
            "coalesces": backend.coalesces,
            "equal": [torch.equal(a, b) for a, b in zip(alone, batched, strict=True)],
            "works_done": [w.is_completed() for w in works],
            "broadcast": root.tolist(),
            "gathered": gathered.flatten().tolist(),
            "batches": backend._pg.batches,  # type: ignore[attr-defined]
        }
    finally:
        group.shutdown()


@pytest.mark.requires_backend("gloo")
@pytest.mark.parametrize("async_block", [False, True], ids=["blocking", "async"])
def test_c10d_backend_posts_a_batch_between_torchs_start_and_end_coalescing(
    rank_pools: Pools, async_block: bool
) -> None:
    n = 2
    for got in rank_pools(n).run(c10d_coalesced, async_block, timeout=120):
        assert got["coalesces"] is True
        assert got["equal"] == [True] * 6
        assert got["works_done"] == [True] * 6
        assert got["broadcast"] == [0.0] * 3
        assert got["gathered"] == [0.0, 0.0, 1.0, 1.0]
        # one launch of the whole batch; the blocking all-reduces before and after were never held
        assert got["batches"] == [["allreduce"] * 6 + ["broadcast", "_allgather_base"]]


# -- torch's own coalescing on group.to_torch() -------------------------------------------------


def torch_side(ctx: RankContext, backend: str) -> dict[str, Any]:
    n, r = ctx.size, ctx.rank
    group = _group(ctx, backend)
    try:
        pg = group.to_torch()
        out: dict[str, Any] = {}
        a, b = torch.full((2,), r + 1.0), torch.full((5,), r + 1.0)
        with dist._coalescing_manager(group=pg):  # torch's fast path: one allreduce_coalesced at the exit
            dist.all_reduce(a, group=pg)
            dist.all_reduce(b, group=pg)
        out["fast"] = (a.tolist(), b.tolist())
        gathered = torch.empty(2 * n)
        with dist._coalescing_manager(group=pg, async_ops=True) as cm:
            dist.all_gather_into_tensor(gathered, torch.full((2,), float(r)), group=pg)
        cm.wait()
        out["fast_async"] = gathered.tolist()
        c, d = torch.full((3,), r + 1.0), torch.full((1,), float(r))
        try:  # with a device: torch brackets the block with the group's _start/_end_coalescing
            with dist._coalescing_manager(group=pg, device=torch.device("cpu")):
                dist.all_reduce(c, group=pg)
                dist.broadcast(d, group=pg, group_src=n - 1)
            out["device"] = (c.tolist(), d.tolist())
        except RuntimeError as exc:
            out["device"] = str(exc).splitlines()[0]
            # torch's manager raised after entering pg in its global table, and never takes it out
            # (the same with its own groups): the table would keep Gloo's connections alive
            dist.distributed_c10d._world.pg_coalesce_state.pop(pg, None)
        try:  # torch's P2POp resolves the peer through torch's global registry
            dist.P2POp(dist.isend, torch.ones(1), group=pg, group_peer=(r + 1) % n)
            out["p2pop"] = "built"
        except ValueError as exc:
            out["p2pop"] = str(exc)
        group.all_reduce(torch.ones(1))  # still in step, and no block left open
        return out
    finally:
        group.shutdown()


@pytest.mark.parametrize("backend", BACKENDS)
def test_torchs_coalescing_manager_on_to_torch(rank_pools: Pools, backend: str) -> None:
    n = 2
    for got in rank_pools(n).run(torch_side, backend, timeout=120):
        assert got["fast"] == ([3.0] * 2, [3.0] * 5)
        assert got["fast_async"] == [0.0, 0.0, 1.0, 1.0]
        if backend == "gloo":  # registered natively: what torch's Gloo does, which has no startCoalescing
            assert got["device"] == "Backend gloo does not implement startCoalescing"
        else:  # the Python adapter: a coalescing block of the group
            assert got["device"] == ([3.0] * 3, [1.0])
        assert "not registered" in got["p2pop"]
