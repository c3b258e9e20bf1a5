"""pg-gloo across real processes: what the wrapper adds to Gloo, and the gaps it declares.

The conformance suite (``tests/conformance/test_backends.py``) certifies the backend; these
tests pin down the behaviour this wrapper exists for: sends up to the eager limit that do not
wait for their receiver (``test_gloo_p2p.py``: both sides of the limit), a wrong-size receive
that is an error instead of Gloo's process abort, Gloo's timeout and what it leaves behind,
and that every declared gap really is one in Gloo.
The rank pool fails a call whose ranks leave threads, sockets or processes behind.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch._C._distributed_c10d as c10d
import torch.distributed as dist
from pg_core import ProcessGroup
from pg_core.errors import CollectiveMismatchError, CollectiveTimeout, NotSupportedError, PeerFailureError
from pg_core.ops import RedOpType, ReduceOp
from pg_core.store import HashStore, PrefixStore, wait_for
from pg_core.testing.pool import RankContext, RankPool
from pg_gloo.messages import _HEAD, _INLINE, _message
from pg_gloo.plugin import CAPABILITIES, MAX_TAG
from pg_gloo.waiting import SLICE, SLICE_EXPIRED, SlicedWaits, confined_to_one_cpu, slice_ended

pytestmark = pytest.mark.requires_backend("gloo")

Pools = Callable[[int], RankPool]


def _group(ctx: RankContext, timeout: float | None = None) -> ProcessGroup:
    return ProcessGroup(ctx.store, ctx.rank, ctx.size, backends="gloo", timeout=timeout or ctx.timeout)


# -- the declared gaps are Gloo's ---------------------------------------------------------------


def _raw_gloo() -> Any:
    return dist.ProcessGroupGloo(HashStore(), 0, 1, timedelta(seconds=10))


def _raw_all_reduce(pg: Any, tensor: torch.Tensor, op: Any) -> None:
    opts = c10d.AllreduceOptions()
    opts.reduceOp = op
    pg.allreduce([tensor], opts).wait()


@pytest.mark.parametrize(
    ("dtype", "op", "reduce_op"),
    [
        (torch.float32, dist._make_nccl_premul_sum(2.0), ReduceOp.premul_sum(2.0)),
        (torch.int16, dist.ReduceOp.SUM, ReduceOp.SUM),
        (torch.complex64, dist.ReduceOp.PRODUCT, ReduceOp.PRODUCT),
    ],
    ids=["premul_sum", "int16-sum", "complex-product"],
)
def test_every_undeclared_reduction_is_one_gloo_refuses(dtype: torch.dtype, op: Any, reduce_op: ReduceOp) -> None:
    """If a torch release teaches Gloo one of these, this fails: declare it then."""
    assert not CAPABILITIES.supports("all_reduce", dtype, reduce_op)
    pg = _raw_gloo()
    with pytest.raises(RuntimeError):
        _raw_all_reduce(pg, torch.ones(4, dtype=dtype), op)


def test_the_declared_tag_range_is_gloos_and_no_wider() -> None:
    pg = _raw_gloo()
    tensor = torch.ones(1)
    with pytest.raises(TypeError):  # Gloo's tag is a C int
        pg.send([tensor], 0, MAX_TAG + 1)
    assert CAPABILITIES.max_tag == MAX_TAG == 2**31 - 1


def test_an_undeclared_reduction_is_refused_before_anything_is_sent() -> None:
    with ProcessGroup(HashStore(), 0, 1, backends="gloo", timeout=10) as group:
        with pytest.raises(NotSupportedError, match="PREMUL_SUM"):
            group.all_reduce(torch.ones(2), ReduceOp.premul_sum(2.0))
        t = torch.arange(4, dtype=torch.int16)
        group.broadcast(t, 0)  # int16 moves (as bytes), it just does not reduce
        assert t.tolist() == [0, 1, 2, 3]


# -- point to point ---------------------------------------------------------------------------------


def ping_pong_reusing_buffers(ctx: RankContext) -> dict[str, Any]:
    """Four 8 MiB round trips (a header message, then the payload) with new values each time:
    the buffers that finished sends and receives leave behind are reused and never carry an
    old value; shutdown lets them go."""
    n = 2 << 20
    with _group(ctx) as group:
        backend = group._dispatch.instance(torch.device("cpu")).backend
        peer, got, kept = 1 - ctx.rank, [], []
        for i in range(4):
            t = torch.empty(n)
            if ctx.rank == 0:
                group.send(torch.full((n,), float(i)), peer, tag=7)
                group.recv(t, peer, tag=7)
            else:
                group.recv(t, peer, tag=7)
                group.send(t + 100.0, peer, tag=7)
            got.append(float(t[0]) if bool((t == t[0]).all()) else None)
            kept.append(len(backend._spares))  # at least the receive's first buffer, given back
        group.barrier()
    return {"got": got, "kept_while_running": min(kept) > 0, "kept_after_shutdown": len(backend._spares)}


def test_large_messages_reuse_the_buffers_of_finished_ones(rank_pools: Pools) -> None:
    sender, echo = rank_pools(2).run(ping_pong_reusing_buffers, timeout=120)
    assert sender == {"got": [100.0, 101.0, 102.0, 103.0], "kept_while_running": True, "kept_after_shutdown": 0}
    assert echo == {"got": [0.0, 1.0, 2.0, 3.0], "kept_while_running": True, "kept_after_shutdown": 0}


def many_sends_then_receives(ctx: RankContext) -> list[float] | int:
    """Rank 0 sends 150 small messages before rank 1 receives any, then a large one (which waits
    for its receive): they cross the reaper's batches (64 sends) and arrive in order; what is
    not yet handed over goes to the reaper at shutdown, which waits for it (the pool checks no
    thread is left)."""
    with _group(ctx) as group:
        if ctx.rank == 0:
            backend = group._dispatch.instance(torch.device("cpu")).backend
            for i in range(150):
                group.send(torch.full((4,), float(i)), 1, tag=2)
            group.send(torch.full((2 << 20,), 150.0), 1, tag=2)  # its header joins the batch
            gathered = len(backend._unreaped)
            group.barrier()
            return gathered
        got = []
        for i in range(151):
            t = torch.empty(4 if i < 150 else 2 << 20)
            group.recv(t, 0, tag=2)
            got.append(float(t[0]) if bool((t == t[0]).all()) else -1.0)
        group.barrier()
        return got


def test_sends_reach_the_reaper_in_batches_and_arrive_in_order(rank_pools: Pools) -> None:
    gathered, got = rank_pools(2).run(many_sends_then_receives, timeout=120)
    assert got == [float(i) for i in range(151)]
    # handed over 64 at a time: 23 are left, unless the large send waited for its receive longer than
    # the reaper's own wake-up (50 ms, a busy machine), which takes what is left itself
    assert gathered in (151 % 64, 0)


def wrong_size_then_right(ctx: RankContext) -> str:
    with _group(ctx) as group:
        if ctx.rank == 0:
            group.send(torch.arange(8, dtype=torch.float32), 1)
            group.send(torch.arange(4, dtype=torch.float32) + 100, 1)
            group.send(torch.arange(4, dtype=torch.int32), 1)
            return "sent"
        small = torch.empty(4)
        with pytest.raises(CollectiveMismatchError, match=r"8 x float32 \(32 bytes\).*4 x float32") as err:
            group.recv(small, 0)
        assert err.value.peers == (0,)
        group.recv(small, 0)  # the refused message was drained: the stream is in step
        assert small.tolist() == [100.0, 101.0, 102.0, 103.0]
        with pytest.raises(CollectiveMismatchError, match="int32"):
            group.recv(small, 0)  # same size, other dtype
        return "refused"


def test_a_receive_of_the_wrong_size_is_an_error_not_gloos_abort(rank_pools: Pools) -> None:
    assert rank_pools(2).run(wrong_size_then_right, timeout=120) == ["sent", "refused"]


#: payload sizes around what travels with the header: in its Gloo message, or just past it (two)
_EDGES = [0, 1, 16 * 1024, _INLINE - 1, _INLINE, _INLINE + 1, 3 * _INLINE + 5]


def messages_around_the_header(ctx: RankContext) -> list[str]:
    """Rank 0 sends, per size in ``_EDGES``: a tensor refused for its size, the same tensor, then
    the bytes with send_bytes in two parts; rank 1 receives and reports what it got."""
    got = []
    with _group(ctx) as group:
        backend = group._dispatch.instance(torch.device("cpu")).backend  # send_bytes is the core's to call
        for n in _EDGES:
            data = torch.arange(n, dtype=torch.uint8)
            raw = data.numpy().tobytes()
            if ctx.rank == 0:
                group.send(data, 1)
                group.send(data, 1)
                backend.send_bytes([raw[: n // 2], raw[n // 2 :]], 1, 77, timeout=30.0)
                continue
            with pytest.raises(CollectiveMismatchError):
                group.recv(torch.empty(n + 1, dtype=torch.uint8), 0)  # refused, and drained
            into = torch.full((n,), 7, dtype=torch.uint8)
            group.recv(into, 0)
            message = backend.recv_bytes(0, 77, timeout=30.0)
            got.append(f"{n}: {torch.equal(into, data)} {bytes(message) == raw}")
    return got


def test_messages_with_and_past_the_header_arrive_whole_and_a_wrong_size_is_refused(rank_pools: Pools) -> None:
    _, got = rank_pools(2).run(messages_around_the_header, timeout=120)
    assert got == [f"{n}: True True" for n in _EDGES]


# -- receiving from any source: Gloo can, pg-gloo's two-part messages cannot ------------------------


def _two_part_send(pg: Any, payload: torch.Tensor, dst: int, tag: int) -> list[Any]:
    """A message too large to travel with its header as pg-gloo sends it: the header (size, dtype
    code) alone, then the payload, on one tag."""
    return [pg.send([_message(payload.numel() * payload.element_size(), 7)], dst, tag), pg.send([payload], dst, tag)]


#: a payload past what travels with the header, yet no larger than a first receive's buffer
_TWO_PART_FLOATS = (_HEAD + _INLINE) // 4


def gloo_any_source(ctx: RankContext) -> dict[str, Any] | None:
    """Raw Gloo on three ranks. First, Gloo's own any-source receive of whole messages: ranks 1
    and 2 send two each, rank 0 takes them with ``recv_anysource``. Then pg-gloo's two-part
    messages: rank 1 sends one of ``_TWO_PART_FLOATS`` float32 and rank 0 reads its header
    naming rank 1, as pg-gloo's ``recv`` does; an any-source receive that runs before the
    payload is read (another thread's, or the core's helper thread's) takes the payload."""
    pg = dist.ProcessGroupGloo(PrefixStore("raw-gloo", ctx.store), ctx.rank, ctx.size, timedelta(seconds=60))
    payload = torch.arange(_TWO_PART_FLOATS, dtype=torch.float32) + 0.5
    try:
        if ctx.rank != 0:
            works = [pg.send([torch.tensor([ctx.rank * 10.0 + k])], 0, 3) for k in range(2)]
            if ctx.rank == 1:
                works += _two_part_send(pg, payload, 0, 4)
            for work in works:
                work.wait()
            wait_for(ctx.store, ["done"], 60)
            return None
        whole = []
        for _ in range(4):
            t = torch.empty(1)
            work = pg.recv_anysource([t], 3)
            work.wait()
            whole.append((work._source_rank(), t.item()))
        first = torch.empty(_HEAD + _INLINE, dtype=torch.uint8)
        pg.recv([first], 1, 4).wait()  # a receive naming rank 1 has read its header...
        taken = torch.empty(_HEAD + _INLINE, dtype=torch.uint8)
        work = pg.recv_anysource([taken], 4)  # ...and a receive from any source comes before its payload
        work.wait()
        ctx.store.set("done", "1")
        return {
            "whole": whole,
            "header": first[:_HEAD].view(torch.int64).tolist(),
            "taken_from": work._source_rank(),
            "taken_is_payload": torch.equal(taken.view(torch.float32), payload),
            "taken_as_header": taken[:_HEAD].view(torch.int64).tolist(),
        }
    finally:
        pg.shutdown()


def test_gloo_receives_from_any_source_but_pg_gloos_two_part_messages_cannot_be(rank_pools: Pools) -> None:
    """Why ``recv_anysource`` is not declared: Gloo's any-source receive works and keeps each sender's
    order, but a pg-gloo message too large to travel with its header is two Gloo messages on one
    tag, and an any-source receive takes whichever comes next from any peer, a payload too. A
    payload no larger than a first receive's buffer is read as a header (garbage); a larger one
    makes Gloo abort the process (``op.preamble.length <= op.nbytes``). If this stops holding, or
    pg-gloo's messages change, declare the op and let the suite certify it."""
    got = rank_pools(3).run(gloo_any_source, timeout=120)[0]
    assert got is not None
    whole = got["whole"]
    assert sorted(whole) == [(1, 10.0), (1, 11.0), (2, 20.0), (2, 21.0)]  # Gloo's own: the right senders
    assert [v for s, v in whole if s == 1] == [10.0, 11.0] and [v for s, v in whole if s == 2] == [20.0, 21.0]
    assert got["header"] == [_TWO_PART_FLOATS * 4, 7]
    assert got["taken_from"] == 1 and got["taken_is_payload"]  # the payload, taken as a first message
    assert got["taken_as_header"][0] != _TWO_PART_FLOATS * 4  # whose "header" is garbage
    assert "recv_anysource" not in CAPABILITIES.ops


def test_a_receive_from_any_source_is_refused_before_anything_is_received() -> None:
    with ProcessGroup(HashStore(), 0, 1, backends="gloo", timeout=10) as group:
        assert not group.supports("recv_anysource")
        with pytest.raises(
            NotSupportedError, match=r"backend 'gloo' on cpu does not declare 'recv_anysource'.*src=RANK"
        ):
            group.recv(torch.zeros(2))
        with pytest.raises(NotSupportedError, match="recv_anysource"):
            group.irecv(torch.zeros(2), None, 5)


# -- Gloo's timeout ---------------------------------------------------------------------------------


def timeout_then_anything(ctx: RankContext) -> list[str]:
    group = _group(ctx, timeout=30)
    said = []
    try:
        group.barrier()  # the group is up on both ranks
        if ctx.rank == 0:
            with pytest.raises(CollectiveTimeout) as err:
                group.all_reduce(torch.ones(2), timeout=0.5)
            said.append(str(err.value))
            ctx.store.set("timed_out", "1")
            with pytest.raises(PeerFailureError) as gone:
                group.send(torch.ones(2), 1)  # refused at once: Gloo's connections are closed
            said.append(str(gone.value))
        else:
            wait_for(ctx.store, ["timed_out"], 30)
            with pytest.raises(PeerFailureError) as gone:
                group.recv(torch.ones(2), 0, timeout=10)
            said.append(str(gone.value))
    finally:
        group.shutdown()
    return said


def test_a_timeout_is_a_collective_timeout_and_the_backend_then_refuses_with_the_reason(rank_pools: Pools) -> None:
    (timed_out, refused), (peer_side,) = rank_pools(2).run(timeout_then_anything, timeout=120)
    assert "after 0.5 s" in timed_out and "form a new group" in timed_out
    assert "all_reduce timed out" in refused and "form a new group" in refused
    # the other rank sees Gloo close the connection, or (its watch first) rank 0 leave: a PeerFailureError
    assert "closed" in peer_side or "rank 0 shut down" in peer_side, peer_side


def prepared_timeout(ctx: RankContext) -> list[str]:
    group = _group(ctx, timeout=5)
    said = []
    try:
        for _ in range(2):  # the first goes the full way, the second takes the prepared call
            x = torch.full((2,), float(ctx.rank + 1))
            group.all_reduce(x)
            said.append(str(x.tolist()))
        said.append(str(group._lanes[(x.device, x.dtype, RedOpType.SUM)] is not None))
        if ctx.rank == 0:  # alone, through the prepared call, on the group's 5 s
            with pytest.raises(CollectiveTimeout) as err:
                group.all_reduce(x)
            said.append(str(err.value))
            with pytest.raises(CollectiveTimeout) as refused:
                group.all_reduce(x)
            said.append(str(refused.value))
            ctx.store.set("timed_out", "1")
        else:
            wait_for(ctx.store, ["timed_out"], 60)
    finally:
        group.shutdown()
    return said


def test_a_timeout_in_the_prepared_all_reduce_is_pg_cores_and_stops_the_group(rank_pools: Pools) -> None:
    (*values, prepared, timed_out, refused), peer = rank_pools(2).run(prepared_timeout, timeout=120)
    assert values == ["[3.0, 3.0]"] * 2 and peer == [*values, "True"] and prepared == "True"
    assert "after 5 s" in timed_out and "form a new group" in timed_out
    assert "stopped after all_reduce (collective #3) failed" in refused


# -- coalescing: Gloo has none, so pg-gloo claims none ------------------------------------------------


def gloo_coalescing(ctx: RankContext) -> dict[str, Any]:
    group = _group(ctx)
    try:
        first = torch.full((2,), float(ctx.rank))
        second = torch.full((3,), float(ctx.rank), dtype=torch.float64)
        with group.coalescing():  # pg-gloo's batch: one call after another, as the core runs it
            group.all_reduce(first)
            group.all_reduce(second)
        backend = group._dispatch.instance(torch.device("cpu")).backend
        gloo = backend.c10d  # the ProcessGroupGloo itself, connected to the other rank
        out: dict[str, Any] = {
            "values": (first.tolist(), second.tolist()),
            "claims": backend.coalesces,
            "supports_coalescing": gloo.supports_coalescing,
        }
        try:
            gloo._start_coalescing()
            out["start"] = "started"
            gloo._end_coalescing()
        except RuntimeError as exc:
            out["start"] = str(exc).splitlines()[0]
        return out
    finally:
        group.shutdown()


def test_gloo_has_no_coalescing(rank_pools: Pools) -> None:
    """Torch 2.13's ProcessGroupGloo cannot launch several operations as one: it says so
    (``supports_coalescing``) and refuses ``_start_coalescing``. If a torch release changes
    that, this fails: check that Gloo then really launches a batch as one, and drop pg-gloo's
    ``coalesces = False`` so that C10dBackend.coalesced serves it (docs/decisions.md)."""
    for got in rank_pools(2).run(gloo_coalescing, timeout=120):
        assert got["values"] == ([1.0, 1.0], [1.0, 1.0, 1.0])
        assert got["claims"] is False
        assert got["supports_coalescing"] is False
        assert got["start"] == "Backend gloo does not implement startCoalescing"


# -- helpers for the tests above ---------------------------------------------------------------------


def test_the_raw_gloo_probe_helper_reduces() -> None:
    """The probe of the gap tests reaches Gloo for real: a declared reduction goes through it."""
    pg = _raw_gloo()
    t = torch.arange(3, dtype=torch.float32)
    _raw_all_reduce(pg, t, dist.ReduceOp.SUM)
    assert t.tolist() == [0.0, 1.0, 2.0]
    assert CAPABILITIES.supports("all_reduce", torch.float32, ReduceOp.SUM)


# -- a slice that expires as the operation ends -------------------------------------------------


class _EndsAsTheSliceExpires:
    """A Gloo work whose first timed wait expires in the instant the operation ends: torch has
    raised "Operation timed out!" (it looked under its lock before the end), and
    ``is_completed()`` says True by the time the caller asks. ``error``: the operation's own."""

    def __init__(self, error: str | None = None, *, ends: bool = True) -> None:
        self.error, self.ends, self.completed = error, ends, False

    def wait(self, timeout: timedelta | None = None) -> bool:
        if timeout is not None and not self.completed:
            self.completed = self.ends
            raise RuntimeError(SLICE_EXPIRED)
        if self.error is not None:
            raise RuntimeError(self.error)
        return True

    def is_completed(self) -> bool:
        return self.completed


class _Waits(SlicedWaits):
    """The waiting rules alone, with nothing alarming and errors passed through as they are."""

    rank, _pg, _broken, _aborted, _everyone, _one_cpu = 0, None, None, False, (0, 1), False

    def __init__(self) -> None:
        self._closing = threading.Lock()

    def _alarm(self, what: str, peers: Any, **_: Any) -> None:
        return None

    def _error(self, exc: BaseException, what: str, timeout: float, peers: Any = ()) -> BaseException:
        return exc


def test_a_slice_that_expires_as_the_operation_ends_is_the_operations_outcome() -> None:
    assert slice_ended(_EndsAsTheSliceExpires(), SLICE) is True
    assert slice_ended(_EndsAsTheSliceExpires(ends=False), SLICE) is False
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        slice_ended(_EndsAsTheSliceExpires("Connection closed by peer"), SLICE)


@pytest.mark.parametrize("how", ["blocking", "async"])
def test_a_collective_that_ends_as_its_slice_expires_succeeds(how: str) -> None:
    """Once in CI every rank had finished a reduce_scatter_tensor, and the one whose first
    slice expired in that instant reported "Gloo gave up" (conformance, gloo, 4 ranks)."""
    waits = _Waits()
    if how == "blocking":
        waits._finish(_EndsAsTheSliceExpires(), "all_reduce", 10.0, (0, 1))
    else:
        assert waits._launched(_EndsAsTheSliceExpires(), "all_reduce", 10.0, (0, 1)).wait() is True
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        waits._finish(_EndsAsTheSliceExpires("Connection closed by peer"), "all_reduce", 10.0, (0, 1))


@pytest.mark.parametrize("one_cpu", [True, False])
def test_an_asynchronous_post_yields_the_cpu_where_the_process_has_one(
    one_cpu: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gloo's threads run a collective; on a process pinned to one CPU they start only once the
    caller lets go of it, so an asynchronous post yields it before the Python that follows."""
    import pg_gloo.waiting

    yields: list[None] = []
    monkeypatch.setattr(pg_gloo.waiting.os, "sched_yield", lambda: yields.append(None))
    waits = _Waits()
    waits._one_cpu = one_cpu
    work = waits._launched(_EndsAsTheSliceExpires(), "all_reduce", 10.0, (0, 1))
    assert len(yields) == (1 if one_cpu else 0)
    assert work.wait() is True


def test_a_process_pinned_to_one_cpu_is_confined_to_it() -> None:
    if not hasattr(os, "sched_setaffinity"):  # the platform says nothing of CPUs: never taken for confined
        assert confined_to_one_cpu() is False
        return
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(before)})
        assert confined_to_one_cpu() is True
    finally:
        os.sched_setaffinity(0, before)
    assert confined_to_one_cpu() is (len(before) == 1)
