"""Torch's plugin route (``pg_core.torch_plugin``) across real processes: ``init_process_group``
with a backend name of pg-core's, over a FileStore ``init_method`` and over a ``TCPStore`` one
rank hosts; collectives with torch's global ranks; ``new_group`` making pg-core subgroups;
``destroy_process_group`` shutting the pg-core groups down with nothing left running (the
pool fails a call whose ranks leave threads or file descriptors behind). Over pg-tcp (the
Python adapter) and pg-gloo (torch's Gloo objects, natively)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from pg_core.errors import GroupClosedError
from pg_core.store import TCPStore, wait_for
from pg_core.testing.pool import RankContext, RankPool

Pools = Callable[[int], RankPool]

BACKENDS = [
    pytest.param("gloo", marks=pytest.mark.requires_backend("gloo")),
    pytest.param("tcp", marks=pytest.mark.requires_backend("tcp")),
]


def _exercise(ctx: RankContext, expected_backend: str, torch_name: str) -> dict[str, Any]:
    """Collectives, point to point, subgroups and destroy, on a default group the plugin route made."""
    from pg_core.torch_plugin import pg_core_group

    out: dict[str, Any] = {"initialized": dist.is_initialized(), "backend": str(dist.get_backend())}
    assert dist.group.WORLD is not None
    world = pg_core_group(dist.group.WORLD)
    out["pg_core"] = (world.name, world.rank, world.size, dict(world.backends))

    t = torch.full((5,), float(ctx.rank + 1))
    dist.all_reduce(t)
    out["all_reduce"] = t.tolist()
    b = torch.full((3,), float(ctx.rank))
    dist.broadcast(b, src=1)  # a global rank: torch's tables know this group
    out["broadcast"] = b.tolist()
    gathered = [torch.zeros(2) for _ in range(ctx.size)]
    dist.all_gather(gathered, torch.full((2,), float(ctx.rank)))
    out["all_gather"] = [g.tolist() for g in gathered]
    if ctx.rank == 0:
        dist.send(torch.arange(4.0), dst=1)
    else:
        got = torch.zeros(4)
        dist.recv(got, src=0)
        out["recv"] = got.tolist()
    dist.barrier()

    pair = dist.new_group([0, 1])  # every rank a member
    alone = dist.new_group([1])  # rank 0 is not a member: torch gives it no group
    sub = pg_core_group(pair)
    out["sub"] = (sub.name, sub.rank, sub.size, dict(sub.backends))
    x = torch.tensor([10.0 * (ctx.rank + 1)])
    dist.all_reduce(x, op=dist.ReduceOp.MAX, group=pair)
    out["sub_all_reduce"] = x.item()
    out["sub_ranks"] = dist.get_process_group_ranks(pair)
    if ctx.rank == 1:
        y = torch.tensor([7.0])
        dist.all_reduce(y, group=alone)
        out["alone"] = (pg_core_group(alone).size, y.item())
    else:
        out["alone"] = alone == dist.GroupMember.NON_GROUP_MEMBER

    dist.destroy_process_group(pair)  # one subgroup alone: the world goes on
    del pair  # torch let it go, and so does this rank: its pg-core group is shut down
    out["sub_closed"] = _closed(sub)
    dist.all_reduce(t)
    out["after_sub_destroyed"] = t[0].item()

    dist.destroy_process_group()
    out["world_closed"] = _closed(world)
    out["after"] = dist.is_initialized()
    return out


def _closed(group: Any) -> bool:
    try:
        group.all_reduce(torch.zeros(1))
    except GroupClosedError:
        return True
    return False


def _check(results: list[dict[str, Any]], backend: str, torch_name: str) -> None:
    for rank, out in enumerate(results):
        assert out["initialized"] is True
        assert out["backend"] == torch_name
        assert out["pg_core"] == ("torch:0", rank, 2, {"cpu": backend})
        assert out["all_reduce"] == [3.0] * 5
        assert out["broadcast"] == [1.0] * 3
        assert out["all_gather"] == [[0.0, 0.0], [1.0, 1.0]]
        assert out["sub"][1:] == (rank, 2, {"cpu": backend})
        assert out["sub"][0].startswith("torch:")
        assert out["sub_all_reduce"] == 20.0
        assert out["sub_ranks"] == [0, 1]
        assert out["alone"] == ((1, 7.0) if rank == 1 else True)
        assert out["sub_closed"] is True
        assert out["after_sub_destroyed"] == 6.0
        assert out["world_closed"] is True
        assert out["after"] is False
    assert results[1]["recv"] == [0.0, 1.0, 2.0, 3.0]


def over_file_store(ctx: RankContext, backend: str, path: str) -> dict[str, Any]:
    from pg_core.torch_plugin import register

    torch_name = f"pg_core_{backend}"
    assert torch_name in register()
    dist.init_process_group(
        torch_name,
        init_method=f"file://{path}",
        rank=ctx.rank,
        world_size=ctx.size,
        timeout=timedelta(seconds=ctx.timeout),
    )
    return _exercise(ctx, backend, torch_name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_init_process_group_over_a_file_store(rank_pools: Pools, backend: str, tmp_path: Path) -> None:
    results = rank_pools(2).run(over_file_store, backend, str(tmp_path / "init"), timeout=90)
    _check(results, backend, f"pg_core_{backend}")


def over_tcp_store(ctx: RankContext, backend: str, via: str) -> dict[str, Any]:
    """``backend="pg_core"``, the pg-core backend named by the environment or by ``pg_options``;
    rank 0 hosts the TCPStore (so its shutdown waits for rank 1 to leave each group)."""
    from pg_core.torch_plugin import BACKENDS_ENV, TorchOptions, register

    register()
    store = TCPStore("127.0.0.1", 0, is_master=ctx.rank == 0, wait_for_workers=False) if ctx.rank == 0 else None
    if store is not None:
        ctx.store.set("port", str(store.port))
    wait_for(ctx.store, ["port"], ctx.timeout)
    if store is None:
        store = TCPStore("127.0.0.1", int(ctx.store.get("port")), is_master=False)
    before = os.environ.get(BACKENDS_ENV)
    try:
        options = None
        if via == "env":
            os.environ[BACKENDS_ENV] = backend
        else:
            options = TorchOptions(backends={"cpu": backend})
        dist.init_process_group(
            "pg_core",
            store=store,
            rank=ctx.rank,
            world_size=ctx.size,
            timeout=timedelta(seconds=ctx.timeout),
            pg_options=options,
        )
        return _exercise(ctx, backend, "pg_core")
    finally:
        if before is None:
            os.environ.pop(BACKENDS_ENV, None)
        else:
            os.environ[BACKENDS_ENV] = before
        del store


def aborting(ctx: RankContext, backend: str, path: str) -> dict[str, Any]:
    """Torch's ``_abort_process_group`` of a subgroup aborts its pg-core group; the world goes on."""
    from pg_core.torch_plugin import pg_core_group, register

    register()
    dist.init_process_group(
        f"pg_core_{backend}",
        init_method=f"file://{path}",
        rank=ctx.rank,
        world_size=ctx.size,
        timeout=timedelta(seconds=ctx.timeout),
    )
    pair = dist.new_group([0, 1])
    sub = pg_core_group(pair)
    dist.distributed_c10d._abort_process_group(pair)
    del pair
    out = {"sub_closed": _closed(sub)}
    t = torch.ones(2)
    dist.all_reduce(t)
    out["world"] = t.tolist()
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_abort_of_a_subgroup_aborts_its_pg_core_group(rank_pools: Pools, backend: str, tmp_path: Path) -> None:
    results = rank_pools(2).run(aborting, backend, str(tmp_path / "init"), timeout=90)
    assert results == [{"sub_closed": True, "world": [2.0, 2.0]}] * 2


def host_a_store_once(ctx: RankContext) -> None:
    """Torch keeps a pipe (two descriptors) for the life of a process once it has hosted a
    ``TCPStore`` server, whichever library asked: made here, before the call that checks leaks."""
    del ctx
    TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False).set("warm", "1")


@pytest.mark.parametrize("via", ["env", "pg_options"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_init_process_group_over_a_tcp_store(rank_pools: Pools, backend: str, via: str) -> None:
    """Subgroups take the default group's pg-core backend (``new_group`` gives no ``pg_options``)."""
    rank_pools(2).run(host_a_store_once, timeout=60, check_leaks=False)
    results = rank_pools(2).run(over_tcp_store, backend, via, timeout=90)
    _check(results, backend, "pg_core")


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_registration_is_explicit_idempotent_and_checked() -> None:
    """Importing pg-core registers nothing; register() does, once; bad options and an unsupported
    torch are errors that say what to do."""
    done = _python(
        """
        import torch, torch.distributed as dist
        import pg_core, pg_core.torch_plugin as tp
        from pg_core import ProcessGroup
        assert not any(k.startswith("PG_CORE") for k in dist.Backend._plugins), dist.Backend._plugins
        names = tp.register()
        creators = {k: v.creator_fn for k, v in dist.Backend._plugins.items()}
        assert tp.register() == names, names
        assert {k: v.creator_fn for k, v in dist.Backend._plugins.items()} == creators
        assert "pg_core" in names and "pg_core_tcp" in names and "pg_core_gloo" in names, names
        assert dist.Backend("pg_core_tcp") == "pg_core_tcp"
        assert dist.Backend.default_device_backend_map["cpu"] == "gloo"  # torch's default is not taken
        assert tp.registered()["pg_core_tcp"] == "tcp" and tp.registered()["pg_core"] is None
        try:  # installed, but this machine has no GPU: pg-core says so
            dist.init_process_group("pg_core_nccl", store=dist.HashStore(), rank=0, world_size=1)
        except pg_core.BackendUnavailableError as exc:
            print("UNAVAILABLE", exc)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            tp.pg_core_group(dist.group.WORLD)
        except TypeError as exc:
            print("NOT_OURS", exc)
        dist.destroy_process_group()
        try:
            dist.init_process_group("pg_core", store=dist.HashStore(), rank=0, world_size=1, pg_options="tcp")
        except TypeError as exc:
            print("OPTIONS", exc)
        torch.__version__ = "2.99.0"
        try:
            tp._check_torch()
        except RuntimeError as exc:
            print("VERSION", exc)
        """,
        PG_CORE_TORCH_AUTOLOAD="0",
    )
    assert done.returncode == 0, done.stderr
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert (
        "pg_options for torch backend 'pg_core' must be a pg_core.torch_plugin.TorchOptions, got str"
        in lines["OPTIONS"]
    )
    assert "Backend 'nccl' is installed but unavailable" in lines["UNAVAILABLE"]
    assert "was not made by pg-core's torch plugin route" in lines["NOT_OURS"]
    assert "supports torch 2.13, found torch 2.99.0" in lines["VERSION"]
    assert "group.to_torch()" in lines["VERSION"]


def test_torch_entry_point_registers_only_when_asked() -> None:
    """pg-core's ``torch.backends`` entry point runs inside every ``import torch``; it registers
    the route only under ``PG_CORE_TORCH_AUTOLOAD=1``."""
    code = (
        "import torch.distributed as dist; print(sorted(k for k in dist.Backend._plugins if k.startswith('PG_CORE')))"
    )
    asked = _python(code, PG_CORE_TORCH_AUTOLOAD="1")
    assert asked.returncode == 0, asked.stderr
    assert "'PG_CORE'" in asked.stdout and "'PG_CORE_TCP'" in asked.stdout
    unasked = _python(code, PG_CORE_TORCH_AUTOLOAD="0")
    assert unasked.returncode == 0, unasked.stderr
    assert unasked.stdout.strip() == "[]"
