"""``backends=None`` with a default that may refuse the group's members: every member falls
back to the next default together, or, where they did not fare alike, every member raises
naming who did what: in-process backends on thread ranks over one HashStore, then the
installed pg-shm and pg-tcp across real processes (``ProcessGroup.from_env`` with pgrun's
variables), on one host and on two faked ones."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from pg_core import (
    Backend,
    BackendContext,
    BackendSpec,
    BackendUnavailableError,
    Capabilities,
    CollectiveMismatchError,
    HashStore,
    ProcessGroup,
    TCPStore,
)
from pg_core.dispatch import Choice, fallbacks, resolve_backends
from pg_core.ops import ReduceOp
from pg_core.registry import Registry
from pg_core.store import wait_for
from pg_core.testing.pool import RankContext, RankPool


class Summing(Backend):
    """A backend whose all_reduce sums through the store: enough to see which one ran."""

    made: list[tuple[str, str, int]] = []

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        self.calls = 0
        with _lock:
            Summing.made.append((ctx.backend_name, ctx.group_name, ctx.rank))

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, *, timeout: float) -> None:
        self.calls += 1
        store, n = self.ctx.store, self.calls
        store.set(f"ar{n}/{self.ctx.rank}", repr(tensor.tolist()))
        wait_for(store, [f"ar{n}/{r}" for r in range(self.ctx.size)], timeout)
        total = sum(torch.tensor(eval(store.get(f"ar{n}/{r}").decode())) for r in range(self.ctx.size))
        tensor.copy_(total)


class Picky(Summing):
    """Refuses where ``options['picky']['refuse'](rank, group name)`` says so, after a store round
    like pg-shm's (every member publishes first, so all refusals it makes can be alike)."""

    def __init__(self, ctx: BackendContext) -> None:
        ctx.store.set(f"here/{ctx.rank}", "1")
        wait_for(ctx.store, [f"here/{r}" for r in range(ctx.size)], ctx.timeout)
        refuse: Callable[[int, str], str | None] = ctx.options["refuse"]
        why = refuse(ctx.rank, ctx.group_name)
        if why == "timeout":
            raise TimeoutError(f"rank {ctx.rank} timed out forming picky")
        if why is not None:
            raise BackendUnavailableError(f"backend 'picky' refuses rank {ctx.rank}: {why}")
        super().__init__(ctx)


_lock = threading.Lock()


def _registry(*extra: BackendSpec) -> Registry:
    registry = Registry(load_entry_points=False)
    registry.register(BackendSpec(name="picky", factory=Picky, devices=("cpu",), priority=30))
    registry.register(BackendSpec(name="plain", factory=Summing, devices=("cpu",), priority=10))
    registry.register(BackendSpec(name="last", factory=Summing, devices=("cpu",), priority=1))
    for spec in extra:
        registry.register(spec)
    return registry


def _ranks(size: int, fn: Callable[[int, ProcessGroup], Any], refuse: Callable[[int, str], str | None]) -> list[Any]:
    """``fn(rank, group)`` on ``size`` thread ranks of a ``backends=None`` group; each rank's
    result, or the exception it raised."""
    store, registry = HashStore(), _registry()
    results: list[Any] = [None] * size

    def rank_main(rank: int) -> None:
        try:
            group = ProcessGroup(
                store, rank, size, registry=registry, options={"picky": {"refuse": refuse}}, timeout=20
            )
            try:
                results[rank] = fn(rank, group)
            finally:
                group.abort()
        except BaseException as exc:
            results[rank] = exc

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(size)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not any(th.is_alive() for th in threads), "a rank is stuck"
    return results


def _reduce(rank: int, group: ProcessGroup) -> tuple[dict[str, str], float]:
    t = torch.tensor([float(rank + 1)])
    group.all_reduce(t)
    return group.backends, t.item()


def test_the_default_keeps_the_others_in_priority_order_and_a_named_backend_none() -> None:
    registry = _registry()
    choice = resolve_backends(None, registry)
    assert isinstance(choice, Choice) and choice["cpu"].name == "picky"
    assert [s.name for s in fallbacks(choice)["cpu"]] == ["plain", "last"]
    assert fallbacks(resolve_backends("plain", registry)) == {}
    assert fallbacks({"cpu": choice["cpu"]}) == {}


def test_a_default_that_every_member_formed_is_kept() -> None:
    got = _ranks(3, _reduce, lambda rank, name: None)
    assert got == [({"cpu": "picky"}, 6.0)] * 3


def test_a_default_that_refuses_every_member_falls_back_together_to_the_next() -> None:
    got = _ranks(3, _reduce, lambda rank, name: "members on several hosts")
    assert got == [({"cpu": "plain"}, 6.0)] * 3


def test_a_refusal_of_some_members_only_makes_every_member_raise_naming_who_did_what() -> None:
    got = _ranks(3, _reduce, lambda rank, name: "no room" if rank == 1 else None)
    for error in got:
        assert isinstance(error, BackendUnavailableError), got
        text = str(error)
        assert "did not fare alike with the default cpu backend 'picky'" in text, text
        assert "ranks [0, 2] formed it" in text and "ranks [1] were refused it" in text and "no room" in text, text
        assert "backends=" in text, text


def test_a_member_that_fails_otherwise_makes_the_others_raise_not_fall_back() -> None:
    got = _ranks(2, _reduce, lambda rank, name: "timeout" if rank == 0 else "several hosts")
    assert isinstance(got[0], TimeoutError) and "rank 0 timed out" in str(got[0]), got
    assert isinstance(got[1], BackendUnavailableError), got
    assert "ranks [0] failed to form it (TimeoutError: rank 0 timed out" in str(got[1]), got
    assert "ranks [1] were refused it (backend 'picky' refuses rank 1: several hosts)" in str(got[1]), got


def test_members_that_would_fall_back_to_different_backends_raise() -> None:
    store = HashStore()
    results: list[Any] = [None, None]

    def rank_main(rank: int) -> None:
        registry = _registry()
        if rank == 1:  # 'plain' is not installed here: rank 1 would fall back to 'last'
            registry = Registry(load_entry_points=False)
            registry.register(BackendSpec(name="picky", factory=Picky, devices=("cpu",), priority=30))
            registry.register(BackendSpec(name="last", factory=Summing, devices=("cpu",), priority=1))
        try:
            options = {"picky": {"refuse": lambda rank, name: "several hosts"}}
            with ProcessGroup(store, rank, 2, registry=registry, options=options, timeout=20) as group:
                results[rank] = _reduce(rank, group)
        except BaseException as exc:
            results[rank] = exc

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    for error in results:
        assert isinstance(error, CollectiveMismatchError), results
        assert "different ones (last, plain)" in str(error), results


def test_subgroups_decide_for_their_own_members_from_the_parents_default() -> None:
    """A parent refused (members on two hosts: ranks 0-1 and 2-3) falls back; its subgroup of one
    host's ranks forms the default; a subgroup across both falls back as well."""

    def refuse(rank: int, name: str) -> str | None:
        return None if name.endswith("[0,1]") or name.endswith("[2,3]") else "several hosts"

    def body(rank: int, group: ProcessGroup) -> tuple[Any, ...]:
        parent = _reduce(rank, group)
        local = group.new_group([0, 1] if rank < 2 else [2, 3])
        across = group.new_group([0, 2] if rank % 2 == 0 else [1, 3])
        try:
            return parent, _reduce(local.rank, local), _reduce(across.rank, across)
        finally:
            local.abort()
            across.abort()

    got = _ranks(4, body, refuse)
    for rank, result in enumerate(got):
        assert not isinstance(result, BaseException), got
        assert result == (({"cpu": "plain"}, 10.0), ({"cpu": "picky"}, 3.0), ({"cpu": "plain"}, 3.0)), (rank, got)


def test_the_registry_says_what_the_default_is_and_what_follows_it() -> None:
    text = _registry().describe_defaults()
    assert text == "cpu: picky, else plain for a group whose members picky refuses", text
    alone = Registry(load_entry_points=False)
    alone.register(BackendSpec(name="plain", factory=Summing, devices=("cpu",), priority=10))
    assert alone.describe_defaults() == "cpu: plain"


def default_group(ctx: RankContext, port: int, hosts: list[str] | None) -> dict[str, Any]:
    """A ``backends=None`` group from pgrun's variables on the test's store, its ranks on the
    fake hosts ``hosts`` (pg-shm's ``PG_SHM_HOST_ID``) where given: the backends it got, exact
    sums, and those of a subgroup of ranks 0 and 1."""
    from pg_shm.segment import HOST_ID_ENV

    if hosts is not None:
        os.environ[HOST_ID_ENV] = hosts[ctx.rank]
    env = {"PG_RANK": str(ctx.rank), "PG_WORLD_SIZE": str(ctx.size), "PG_STORE": f"127.0.0.1:{port}"}
    try:
        with ProcessGroup.from_env(env=env, timeout=60) as group:
            t = torch.arange(5, dtype=torch.float32) + 10 * ctx.rank
            group.all_reduce(t)
            n = torch.tensor([ctx.rank + 1], dtype=torch.int64)
            group.all_reduce(n)
            out: dict[str, Any] = {"backends": group.backends, "floats": t.tolist(), "ints": n.tolist()}
            sub = group.new_group([0, 1]) if ctx.rank < 2 else None
            if sub is not None:
                with sub:
                    u = torch.tensor([float(ctx.rank + 1)])
                    sub.all_reduce(u)
                    out["sub"] = (sub.backends, u.item())
            return out
    finally:
        os.environ.pop(HOST_ID_ENV, None)


@pytest.mark.requires_backend("tcp", "shm")
@pytest.mark.timeout(180)
@pytest.mark.parametrize("size", [2, 4])
def test_the_default_on_one_host_is_shm_with_exact_results(rank_pools: Callable[[int], RankPool], size: int) -> None:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    outs = rank_pools(size).run(default_group, store.port, None, timeout=120)
    for out in outs:
        assert out["backends"] == {"cpu": "shm"}, outs
        assert out["floats"] == [10.0 * sum(range(size)) + size * i for i in range(5)], outs
        assert out["ints"] == [size * (size + 1) // 2], outs
    assert [out.get("sub") for out in outs] == [({"cpu": "shm"}, 3.0)] * 2 + [None] * (size - 2), outs


@pytest.mark.requires_backend("tcp", "shm")
@pytest.mark.timeout(180)
def test_members_on_two_hosts_all_fall_back_to_tcp_and_a_subgroup_on_one_host_gets_shm(
    rank_pools: Callable[[int], RankPool],
) -> None:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    outs = rank_pools(3).run(default_group, store.port, ["host-a", "host-a", "host-b"], timeout=120)
    for out in outs:
        assert out["backends"] == {"cpu": "tcp"}, outs
        assert out["floats"] == [30.0 + 3 * i for i in range(5)] and out["ints"] == [6], outs
    assert [out.get("sub") for out in outs] == [({"cpu": "shm"}, 3.0), ({"cpu": "shm"}, 3.0), None], outs


@pytest.mark.requires_backend("tcp", "shm")
def test_with_the_in_repo_backends_the_default_for_cpu_is_shm_then_tcp() -> None:
    from pg_core.registry import default_registry

    choice = resolve_backends(None, default_registry())
    assert choice["cpu"].name == "shm" and fallbacks(choice)["cpu"][0].name == "tcp"
    line = default_registry().describe_defaults().splitlines()[0]
    assert line.startswith("cpu: shm, else tcp for a group whose members shm refuses (shm: "), line
    assert "one host" in line, line


def test_what_passed_the_checks_against_a_refused_default_is_checked_again_against_the_next() -> None:
    from pg_core.errors import NotSupportedError
    from pg_core.validation import Supported

    everything = BackendSpec("first", Backend, devices=("cpu",))
    narrow = BackendSpec(
        "next", Backend, devices=("cpu",), capabilities=Capabilities(dtypes=frozenset({torch.float32}))
    )
    specs = {"cpu": everything}
    supported = Supported(specs, "g")
    cpu = torch.device("cpu")
    supported.check("all_reduce", cpu, torch.float64, ReduceOp.SUM)  # declared by the first
    specs["cpu"] = narrow  # the group's fallback (ProcessGroup._chose) writes the dict the checks read
    supported.check("all_reduce", cpu, torch.float64, ReduceOp.SUM)  # remembered: still passes
    supported.forget()
    with pytest.raises(NotSupportedError, match="float64"):
        supported.check("all_reduce", cpu, torch.float64, ReduceOp.SUM)
