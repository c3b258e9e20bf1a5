"""Check mode in one process: the fingerprints tell mismatching collectives apart, the
setting comes from ``check=`` or ``PG_CORE_CHECK``, and a group in check mode compares a
fingerprint before each collective, raising instead of running it where the other side's
differs. The other side is played by the backend's ``all_gather_into_tensor``, which fills
the peer's row with the fingerprint of what the test says the peer called (across real
processes: tests/integration/test_check_mode.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from pg_core import Backend, BackendContext, Capabilities, CollectiveMismatchError, HashStore, ProcessGroup, ReduceOp
from pg_core.check import ENV, Checker, check_mode, describe, fingerprint

#: what the peer (rank 1) calls, given this rank's sequence number: ``(op, args)``
Peer = Callable[[int], tuple[str, tuple[Any, ...]]]


class Twin(Backend):
    """Rank 0 of 2 with a scripted rank 1: collectives are recorded (all_reduce adds 1). The
    check's one-element int64 all_reduce gives rank 1 the same digest as this rank's, or,
    where ``options['peer']`` scripts what rank 1 called (``peer(seq)``), another: and then
    the fingerprints' all_gather gives rank 1's row the fingerprint of that call."""

    name = "twin"
    capabilities = Capabilities()

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        self.log: list[str] = ctx.options["log"]
        self.peer: list[Peer | None] = ctx.options["peer"]

    def send(self, tensor: torch.Tensor, dst: int, tag: int, *, timeout: float) -> None:
        self.log.append("send")

    def recv(self, tensor: torch.Tensor, src: int, tag: int, *, timeout: float) -> None:
        self.log.append("recv")

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, *, timeout: float) -> None:
        if tensor.dtype == torch.int64 and tensor.numel() == 1:
            self.log.append("digest")
            tensor.mul_(2).add_(0 if self.peer[0] is None else 1)
            return
        self.log.append("all_reduce")
        tensor.add_(1)

    def broadcast(self, tensor: torch.Tensor, src: int, *, timeout: float) -> None:
        self.log.append("broadcast")

    def all_to_all_single(self, output: Any, input: Any, out_splits: Any, in_splits: Any, *, timeout: float) -> None:
        self.log.append("all_to_all_single")

    def barrier(self, *, timeout: float) -> None:
        self.log.append("barrier")

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor, *, timeout: float) -> None:
        width = input.numel()
        self.log.append(f"gather[{width}]")
        output[:width] = input
        peer = self.peer[0]
        if peer is None or width != 16:  # the same as this rank (and all-to-all counts: the same)
            output[width:] = input
            return
        op, args = peer(int(input[2]))
        output[width:] = torch.tensor(fingerprint(op, int(input[2]), "cpu", args)[0])


@pytest.fixture
def log() -> list[str]:
    return []


@pytest.fixture
def peer() -> list[Peer | None]:
    return [None]


def make(log: list[str], peer: list[Peer | None], **kw: Any) -> ProcessGroup:
    opts = {"twin": {"log": log, "peer": peer}}
    return ProcessGroup(HashStore(), rank=0, size=2, backends=Twin, options=opts, **kw)


# -- the setting ------------------------------------------------------------------------------------
def test_the_argument_wins_else_the_environment_decides() -> None:
    assert check_mode(None, {}) is False
    assert check_mode(None, {ENV: "1"}) is True
    assert check_mode(None, {ENV: " On "}) is True
    assert check_mode(None, {ENV: "0"}) is False
    assert check_mode(False, {ENV: "1"}) is False
    assert check_mode(True, {ENV: "0"}) is True
    with pytest.raises(ValueError, match="PG_CORE_CHECK='maybe' is neither on"):
        check_mode(None, {ENV: "maybe"})
    with pytest.raises(TypeError, match="check must be True, False or None"):
        check_mode(1, {})  # type: ignore[arg-type]


def test_a_group_reads_the_environment_once_and_subgroups_inherit(
    log: list[str], peer: list[Peer | None], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV, "1")
    on = make(log, peer)
    off = make(log, peer, check=False)
    monkeypatch.delenv(ENV)
    try:
        assert on.check and not off.check
        assert "check" in repr(on) and "check" not in repr(off)
        assert on.new_group([0]).check  # inherited, not read again (the variable is gone now)
        assert not on.new_group([0], check=False).check
        assert off.new_group([0], check=True).check
        assert not off.new_group([0]).check
    finally:
        on.abort()
        off.abort()


# -- fingerprints -----------------------------------------------------------------------------------
def rows(op: str, *args: Any, seq: int = 5) -> list[int]:
    return fingerprint(op, seq, "cpu", args)[0]


def test_fingerprints_tell_apart_what_the_backends_cannot() -> None:
    f4, i4 = torch.zeros(4), torch.zeros(4, dtype=torch.int32)
    base = rows("all_reduce", f4, ReduceOp.SUM)
    assert base == rows("all_reduce", torch.ones(4), ReduceOp.SUM)  # values do not matter
    assert base != rows("all_reduce", torch.zeros(8), ReduceOp.SUM)  # size
    assert base != rows("all_reduce", i4, ReduceOp.SUM)  # dtype of the same byte count
    assert base != rows("all_reduce", torch.zeros(2, 2), ReduceOp.SUM)  # shape of the same count
    assert base != rows("all_reduce", f4, ReduceOp.MAX)  # reduce op
    assert base != rows("all_reduce", f4, ReduceOp.SUM, seq=6)  # sequence number
    assert base != rows("broadcast", f4, 0)  # op
    assert rows("broadcast", f4, 0) != rows("broadcast", f4, 1)  # root
    # past the dims a fingerprint spells out, the shape's digest still tells them apart
    assert rows("broadcast", torch.zeros((1,) * 7 + (2, 1)), 0) != rows("broadcast", torch.zeros((1,) * 7 + (1, 2)), 0)
    # gather: only the root passes a list; what every rank must agree on is its own tensor and the root
    assert rows("gather", f4, None, 0) == rows("gather", f4, [f4, f4], 0)
    # all-to-all: the split sizes go to the second exchange, in elements
    _, counts = fingerprint("all_to_all_single", 1, "cpu", (torch.zeros(3, 2), torch.zeros(4, 2), [1, 2], [3, 1]))
    assert counts == [6, 2, 2, 4]


def test_a_fingerprint_reads_as_the_call() -> None:
    assert describe(rows("all_reduce", torch.zeros(4, 2), ReduceOp.MAX)) == "all_reduce #5 float32[4, 2] MAX on cpu"
    assert describe(rows("broadcast", torch.zeros(3, dtype=torch.int32), 1)) == "broadcast #5 int32[3] root 1 on cpu"
    assert describe(rows("barrier")) == "barrier #5 on cpu"
    assert describe([0] * 16).startswith("something else than a check-mode fingerprint")


# -- a group in check mode --------------------------------------------------------------------------
def test_off_nothing_is_exchanged(log: list[str], peer: list[Peer | None]) -> None:
    group = make(log, peer)
    try:
        for _ in range(3):
            group.all_reduce(torch.zeros(2))
        group.barrier()
        assert log == ["all_reduce"] * 3 + ["barrier"]
    finally:
        group.abort()


def test_on_each_collective_is_compared_first_and_matching_ones_run(log: list[str], peer: list[Peer | None]) -> None:
    group = make(log, peer, check=True)
    try:
        t = torch.zeros(2)
        for _ in range(3):  # the blocking all_reduce's fast path never skips the check
            group.all_reduce(t)
        assert t.tolist() == [3.0, 3.0]
        work = group.broadcast(torch.zeros(1), src=1, async_op=True)
        assert work is not None
        work.wait()
        with group.coalescing():
            group.all_reduce(torch.zeros(1))
            group.all_reduce(torch.zeros(1))
        assert log == [
            *["digest", "all_reduce"] * 3,
            "digest",
            "broadcast",
            "digest",  # the batch, once
            "all_reduce",
            "all_reduce",
        ]
    finally:
        group.abort()


@pytest.mark.parametrize(
    ("mine", "theirs", "said"),
    [
        (("all_reduce", (torch.zeros(4),)), ("all_reduce", (torch.zeros(8), ReduceOp.SUM)), "float32[8] SUM"),
        (("all_reduce", (torch.zeros(4),)), ("all_reduce", (torch.zeros(4, dtype=torch.int32), ReduceOp.SUM)), "int32"),
        (("all_reduce", (torch.zeros(4), ReduceOp.SUM)), ("all_reduce", (torch.zeros(4), ReduceOp.MAX)), "MAX"),
        (("broadcast", (torch.zeros(4), 0)), ("broadcast", (torch.zeros(4), 1)), "root 1"),
        (("barrier", ()), ("all_reduce", (torch.zeros(1), ReduceOp.SUM)), "all_reduce #1 float32[1] SUM"),
    ],
    ids=["size", "dtype", "reduce-op", "root", "op"],
)
def test_a_mismatch_raises_naming_both_sides_and_nothing_runs_after_it(
    log: list[str],
    peer: list[Peer | None],
    mine: tuple[str, tuple[Any, ...]],
    theirs: tuple[str, tuple[Any, ...]],
    said: str,
) -> None:
    group = make(log, peer, check=True)
    peer[0] = lambda seq: theirs
    try:
        with pytest.raises(CollectiveMismatchError) as caught:
            getattr(group, mine[0])(*mine[1])
        message = str(caught.value)
        assert "rank 0: " in message and "rank 1: " in message
        assert f"rank 1: {theirs[0]} #1" in message and said in message
        assert caught.value.peers == (1,)
        assert log == ["digest", "gather[16]"]  # the collective itself never ran
        peer[0] = None
        with pytest.raises(CollectiveMismatchError, match="stopped after"):
            group.all_reduce(torch.zeros(1))  # the group's collectives stop, as after any mismatch
        assert log == ["digest", "gather[16]"]
    finally:
        group.abort()


def test_split_sizes_that_disagree_raise_naming_both_ranks(log: list[str], peer: list[Peer | None]) -> None:
    class Lopsided(Twin):
        """Rank 1 sends rank 0 two elements, where rank 0 expects one: the digests differ,
        the fingerprints read alike, and the counts tell."""

        def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, *, timeout: float) -> None:
            super().all_reduce(tensor, op, timeout=timeout)
            tensor.add_(1)

        def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor, *, timeout: float) -> None:
            super().all_gather_into_tensor(output, input, timeout=timeout)
            if input.numel() == 4:
                output[4:] = torch.tensor([2, 1, 1, 1])

    opts = {"twin": {"log": log, "peer": peer}}
    group = ProcessGroup(HashStore(), rank=0, size=2, backends=Lopsided, options=opts, check=True)
    try:
        with pytest.raises(CollectiveMismatchError, match="rank 1 sends rank 0 2 elements, rank 0 expects 1"):
            group.all_to_all_single(torch.zeros(2), torch.zeros(2), [1, 1], [1, 1])
        assert "all_to_all_single" not in log
    finally:
        group.abort()


# -- the verdict, across ranks ----------------------------------------------------------------------
class World:
    """``size`` ranks as threads, each with a checker whose message backend is this object:
    every collective waits for all ranks, as a real one does."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=30)
        self.slots: list[Any] = [None] * size

    def endpoint(self, rank: int) -> Any:
        world = self

        class Exchange:
            def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, *, timeout: float) -> None:
                tensor.copy_(torch.tensor([sum(world.exchange(rank, int(tensor)))]))

            def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor, *, timeout: float) -> None:
                output.copy_(torch.cat(world.exchange(rank, input.clone())))

        class Inst:
            device = torch.device("cpu")
            backend = Exchange()

        return Inst()

    def exchange(self, rank: int, value: Any) -> list[Any]:
        self.slots[rank] = value
        self.barrier.wait()
        got = list(self.slots)
        self.barrier.wait()
        return got


def verdicts(calls: list[tuple[str, tuple[Any, ...]]]) -> list[str | None]:
    """What each rank's check says when rank ``r`` calls ``calls[r]`` (``None``: it passed)."""
    world = World(len(calls))
    out: list[str | None] = [None] * len(calls)

    def rank(r: int) -> None:
        inst = world.endpoint(r)
        checker = Checker(rank=r, size=len(calls), name="w", endpoint=lambda: inst)
        try:
            checker.verify(calls[r][0], 1, "cpu", calls[r][1], 30.0)
        except CollectiveMismatchError as exc:
            out[r] = str(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_every_rank_reaches_the_same_verdict() -> None:
    f = torch.zeros
    same = [("all_reduce", (f(4), ReduceOp.SUM))] * 3
    assert verdicts(same) == [None, None, None]
    three_ways = [("all_reduce", (f(4), ReduceOp.SUM)), ("all_reduce", (f(5), ReduceOp.SUM)), ("barrier", ())]
    said = [s or "(passed)" for s in verdicts(three_ways)]
    assert all("rank 0: all_reduce #1 float32[4] SUM on cpu; rank 1: all_reduce #1 float32[5]" in s for s in said)
    assert all("rank 2: barrier #1 on cpu" in s for s in said)
    # all-to-all: the splits agree pairwise, or every rank says which pair does not
    a2a = [
        ("all_to_all_single", (f(3), f(3), [1, 1, 1], [1, 1, 1])),
        ("all_to_all_single", (f(4), f(3), [1, 1, 2], [1, 1, 1])),
        ("all_to_all_single", (f(3), f(4), [1, 1, 1], [1, 2, 1])),
    ]
    assert verdicts(a2a) == [None, None, None]
    a2a[2] = ("all_to_all_single", (f(3), f(4), [1, 1, 1], [2, 1, 1]))  # rank 2 sends rank 0 the row rank 1 expects
    said = [s or "(passed)" for s in verdicts(a2a)]
    assert all("rank 2 sends rank 1 1 elements, rank 1 expects 2 from rank 2" in s for s in said)
