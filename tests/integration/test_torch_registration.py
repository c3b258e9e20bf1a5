"""Registration with torch's global tables across real processes (pg_core.torch_world):
``to_torch(register=True)``, ``torch_registered()``, ``as_torch_default()``, ``device_mesh()``
and ``pg_core.device_mesh()`` over pg-tcp (torch sees the Python adapter) and pg-gloo (torch
sees the group's own Gloo object): what torch can do with a registered group, that
registration is undone exactly (torch's tables compared before and after), that two jobs'
groups live side by side in one process, FSDP2 against single-process training, a 2-D mesh,
and the default-group opt-in with its refusals."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from pg_core import ProcessGroup, device_mesh
from pg_core.store import PrefixStore
from pg_core.testing.pool import RankContext, RankPool
from torch.distributed import distributed_c10d as c10d
from torch.distributed.distributed_c10d import GroupName
from torch.distributed.tensor import DTensor

PoolFor = Callable[..., RankPool]  # the pool_for fixture (tests/integration/conftest.py)

BACKENDS = [
    pytest.param("gloo", marks=pytest.mark.requires_backend("gloo")),
    pytest.param("tcp", marks=pytest.mark.requires_backend("tcp")),
]

STEPS, BATCH, LR = 5, 12, 0.1


def tables() -> dict[str, Any]:
    """What torch's global tables hold, comparable before and after (groups by identity)."""
    world = c10d._world
    return {
        "pg_map": {id(g): v[0] for g, v in world.pg_map.items()},
        "pg_names": {id(g): v for g, v in world.pg_names.items()},
        "pg_group_ranks": {id(g): dict(v) for g, v in world.pg_group_ranks.items()},
        "pg_backend_config": {id(g): v for g, v in world.pg_backend_config.items()},
        "pg_to_tag": {id(g): v for g, v in world.pg_to_tag.items()},
        "tags_to_pg": {t: [id(g) for g in gs] for t, gs in world.tags_to_pg.items()},
        "default_pg": id(world.default_pg) if world.default_pg is not None else None,
        "initialized": dist.is_initialized(),
    }


def resolves(name: str) -> bool:
    """Whether torch's C++ registry has a group under ``name``."""
    try:
        torch._C._distributed_c10d._resolve_process_group(cast(GroupName, name))
    except (RuntimeError, ValueError):
        return False
    return True


def error(fn: Callable[[], Any]) -> str:
    """The message ``fn`` raises (the test fails if it does not raise)."""
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    raise AssertionError(f"{fn} did not raise")


def dtensor_primed(ctx: RankContext) -> None:
    """Make this process's first DTensor over a throwaway one-rank pg-tcp group. Torch keeps
    hold of the torch group behind the first DTensor a process makes, for the life of the
    process (seen on torch 2.13, from a hold no Python object shows), and a pg-gloo group held
    so keeps its sockets after shutdown, which the pool's leak check reports: the group under
    test must not be that first one. pg-tcp's torch group holds no sockets."""
    from torch.distributed.tensor import Replicate

    if getattr(dtensor_primed, "done", False):
        return
    group = ProcessGroup(PrefixStore(f"prime-{ctx.rank}", ctx.store), 0, 1, backends="tcp", timeout=ctx.timeout)
    try:
        DTensor.from_local(torch.ones(1), group.device_mesh("cpu"), [Replicate()], run_check=False)
    finally:
        group.shutdown()
    dtensor_primed.done = True  # type: ignore[attr-defined]


# -- registration --------------------------------------------------------------------------------
def registration(ctx: RankContext, backend: str) -> dict[str, Any]:
    n, r = ctx.size, ctx.rank
    before = tables()
    group = ProcessGroup(ctx.store, r, n, backends=backend, timeout=ctx.timeout)
    got: dict[str, Any] = {}
    try:
        plain = group.to_torch()
        got["plain_not_registered"] = plain not in c10d._world.pg_map
        tg = group.to_torch(register=True)
        got["same_object"] = tg is plain and group.to_torch(register=True) is tg and group.to_torch() is tg
        name = tg.group_name
        after_one = tables()
        got["added"] = {k: len(v) - len(before[k]) for k, v in after_one.items() if isinstance(v, dict)}
        got["resolves"] = torch._C._distributed_c10d._resolve_process_group(name) is tg
        got["initialized"] = dist.is_initialized()
        got["world_size"] = dist.get_world_size(tg)
        got["ranks"] = dist.get_process_group_ranks(tg)
        got["backend"] = dist.get_backend(tg)
        got["get_rank_without_default"] = error(lambda: dist.get_rank(tg))
        got["funcol"] = funcol.all_reduce(torch.full((2,), float(r + 1)), "sum", tg).tolist()
        got["funcol_by_name"] = funcol.all_reduce(torch.full((1,), float(r)), "max", name).tolist()
        t = torch.full((2,), float(r))
        dist.broadcast(t, src=n - 1, group=tg)
        got["broadcast_global_src"] = t.tolist()
        m = torch.full((1,), float(10 + r))
        if r == 0:
            dist.send(m, dst=n - 1, group=tg)
        elif r == n - 1:
            got["recv_from"] = dist.recv(m, src=0, group=tg)
            got["recv"] = m.item()
        right, left = (r + 1) % n, (r - 1) % n
        s, got_left = torch.full((2,), float(r)), torch.empty(2)
        ops = [dist.P2POp(dist.isend, s, right, tg), dist.P2POp(dist.irecv, got_left, left, tg)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        got["ring"] = got_left.tolist()
        got["initialized_after_ops"] = dist.is_initialized()
    finally:
        group.shutdown()
    got["restored"] = tables() == before
    got["resolves_after"] = resolves(name)
    return got


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", [2, 3])
def test_registered_group_is_a_torch_citizen_until_shutdown(pool_for: PoolFor, backend: str, n: int) -> None:
    results = pool_for(backend, n).run(registration, backend, timeout=120)
    for r, got in enumerate(results):
        assert got["plain_not_registered"] and got["same_object"], got
        assert got["added"] == {
            "pg_map": 1,
            "pg_names": 1,
            "pg_group_ranks": 1,
            "pg_backend_config": 1,
            "pg_to_tag": 1,
            "tags_to_pg": 1,
        }, got
        assert got["resolves"] is True and got["initialized"] is False and got["initialized_after_ops"] is False
        assert got["world_size"] == n and got["ranks"] == list(range(n)) and got["backend"] == "pg_core"
        assert "Default process group has not been initialized" in got["get_rank_without_default"]
        assert got["funcol"] == [n * (n + 1) / 2] * 2 and got["funcol_by_name"] == [n - 1.0]
        assert got["broadcast_global_src"] == [n - 1.0] * 2
        if r == n - 1:
            assert got["recv_from"] == 0 and got["recv"] == 10.0
        assert got["ring"] == [float((r - 1) % n)] * 2
        assert got["restored"] is True and got["resolves_after"] is False, got


def subgroups(ctx: RankContext, backend: str) -> dict[str, Any]:
    """3 ranks: new_group([0, 2]) has global ranks [0, 2]; its new_group([1]) (the member that
    is world rank 2) has [2]; split by parity from world rank 1's side: [1]."""
    r = ctx.rank
    before = tables()
    group = ProcessGroup(ctx.store, r, ctx.size, backends=backend, timeout=ctx.timeout)
    got: dict[str, Any] = {}
    try:
        odd = group.split(r % 2)
        assert odd is not None
        tg = odd.to_torch(register=True)
        got["split_ranks"] = dist.get_process_group_ranks(tg)
        got["split_sum"] = funcol.all_reduce(torch.ones(1), "sum", tg).item()
        if r in (0, 2):
            pair = group.new_group([0, 2])
            ptg = pair.to_torch(register=True)
            got["pair_ranks"] = dist.get_process_group_ranks(ptg)
            t = torch.full((1,), float(r))
            dist.broadcast(t, src=2, group=ptg)  # a global rank
            got["pair_broadcast"] = t.item()
            if r == 2:
                inner = pair.new_group([1])
                got["inner_ranks"] = dist.get_process_group_ranks(inner.to_torch(register=True))
                inner.shutdown()
            pair.shutdown()
        odd.shutdown()
    finally:
        group.shutdown()
    got["restored"] = tables() == before
    return got


@pytest.mark.parametrize("backend", BACKENDS)
def test_subgroups_register_with_their_ranks_in_the_job(pool_for: PoolFor, backend: str) -> None:
    results = pool_for(backend, 3).run(subgroups, backend, timeout=120)
    assert [got["split_ranks"] for got in results] == [[0, 2], [1], [0, 2]]
    assert [got["split_sum"] for got in results] == [2.0, 1.0, 2.0]
    assert results[0]["pair_ranks"] == results[2]["pair_ranks"] == [0, 2]
    assert results[0]["pair_broadcast"] == results[2]["pair_broadcast"] == 2.0
    assert results[2]["inner_ranks"] == [2]
    assert all(got["restored"] for got in results), results


def block(ctx: RankContext, backend: str) -> dict[str, Any]:
    before = tables()
    group = ProcessGroup(ctx.store, ctx.rank, ctx.size, backends=backend, timeout=ctx.timeout)
    got: dict[str, Any] = {}
    try:
        with group.torch_registered() as tg:
            got["inside"] = resolves(tg.group_name) and tg in c10d._world.pg_map
            got["sum"] = funcol.all_reduce(torch.ones(1), "sum", tg).item()
        got["after_block"] = tables() == before and not resolves(tg.group_name)
        t = torch.ones(1)
        group.all_reduce(t)  # the group itself goes on
        got["group_goes_on"] = t.item()
        group.to_torch(register=True)
        with group.torch_registered() as again:
            got["same"] = again is tg
        got["kept_when_registered_before"] = resolves(tg.group_name)
        try:
            with group.torch_registered():
                raise KeyError("in the block")
        except KeyError:
            got["kept_after_raise"] = resolves(tg.group_name)
    finally:
        group.shutdown()
    got["restored"] = tables() == before
    return got


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_registered_is_for_the_block(pool_for: PoolFor, backend: str) -> None:
    for got in pool_for(backend, 2).run(block, backend, timeout=120):
        assert got == {
            "inside": True,
            "sum": 2.0,
            "after_block": True,
            "group_goes_on": 2.0,
            "same": True,
            "kept_when_registered_before": True,
            "kept_after_raise": True,
            "restored": True,
        }


def aborted(ctx: RankContext, backend: str) -> dict[str, Any]:
    before = tables()
    group = ProcessGroup(ctx.store, ctx.rank, ctx.size, backends=backend, timeout=ctx.timeout)
    name = group.to_torch(register=True).group_name
    registered = resolves(name)
    group.abort()
    return {"registered": registered, "after_abort": [tables() == before, resolves(name)]}


@pytest.mark.parametrize("backend", BACKENDS)
def test_abort_undoes_registration(pool_for: PoolFor, backend: str) -> None:
    for got in pool_for(backend, 2).run(aborted, backend, timeout=120):
        assert got == {"registered": True, "after_abort": [True, False]}


def compiled(ctx: RankContext, backend: str) -> dict[str, Any]:
    group = ProcessGroup(ctx.store, ctx.rank, ctx.size, backends=backend, timeout=ctx.timeout)
    try:
        with group.torch_registered() as tg:
            name = tg.group_name

            def step(x: torch.Tensor) -> torch.Tensor:
                return funcol.all_reduce(x * 2, "sum", name) + 1

            compiled_step = torch.compile(step, backend="aot_eager", fullgraph=True)
            got: dict[str, Any] = {"inside": compiled_step(torch.full((3,), float(ctx.rank + 1))).tolist()}
        got["after_block"] = error(lambda: compiled_step(torch.ones(3)))
    finally:
        group.shutdown()
    return got


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_compile_resolves_a_registered_group(pool_for: PoolFor, backend: str) -> None:
    n = 2
    for got in pool_for(backend, n).run(compiled, backend, timeout=240):
        assert got["inside"] == [2.0 * n * (n + 1) / 2 + 1] * 3
        assert "Could not resolve the process group registered under the name" in got["after_block"], got


def two_jobs(ctx: RankContext, backend: str) -> dict[str, Any]:
    """Two top-level groups in each process (two jobs, their ranks reversed): both registered,
    both work; one shut down leaves the other; the default-group opt-in refuses to mix them."""
    r, n = ctx.rank, ctx.size
    before = tables()
    a = ProcessGroup(ctx.store, r, n, backends=backend, timeout=ctx.timeout)
    b = ProcessGroup(PrefixStore("job-b", ctx.store), n - 1 - r, n, backends=backend, timeout=ctx.timeout)
    got: dict[str, Any] = {}
    try:
        ta, tb = a.to_torch(register=True), b.to_torch(register=True)
        got["distinct"] = ta is not tb and ta.group_name != tb.group_name
        got["ranks"] = [dist.get_process_group_ranks(ta), dist.get_process_group_ranks(tb)]
        got["sums"] = [
            funcol.all_reduce(torch.full((1,), float(r)), "sum", ta).item(),
            funcol.all_reduce(torch.full((1,), float(10 * r)), "sum", tb.group_name).item(),
        ]
        t = torch.full((1,), float(r))
        dist.broadcast(t, src=0, group=tb)  # b's global rank 0: world rank n - 1
        got["b_broadcast"] = t.item()
        got["default_refused"] = error(lambda: a.as_torch_default().__enter__())
        got["still_not_initialized"] = dist.is_initialized()
        a.shutdown()
        got["b_after_a"] = funcol.all_reduce(torch.ones(1), "sum", tb).item()
        got["a_gone"] = not resolves(ta.group_name) and ta not in c10d._world.pg_map
        with b.as_torch_default():
            got["default_rank"] = dist.get_rank()
            c = ProcessGroup(PrefixStore("job-c", ctx.store), r, n, backends=backend, timeout=ctx.timeout)
            try:
                got["other_job_refused"] = error(lambda: c.to_torch(register=True))
                got["c_not_registered"] = c.to_torch() not in c10d._world.pg_map
            finally:
                c.shutdown()
        b.shutdown()
    finally:
        a.shutdown()
        b.shutdown()
    got["restored"] = tables() == before
    return got


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_jobs_groups_in_one_process(pool_for: PoolFor, backend: str) -> None:
    n = 2
    results = pool_for(backend, n).run(two_jobs, backend, timeout=120)
    for r, got in enumerate(results):
        assert got["distinct"] is True
        assert got["ranks"] == [[0, 1], [0, 1]]
        assert got["sums"] == [1.0, 10.0]
        assert got["b_broadcast"] == float(n - 1)
        assert "groups of another job are registered" in got["default_refused"], got
        assert got["still_not_initialized"] is False
        assert got["b_after_a"] == 2.0 and got["a_gone"] is True
        assert got["default_rank"] == n - 1 - r
        assert "belongs to another job" in got["other_job_refused"] and got["c_not_registered"] is True
        assert got["restored"] is True, got


def destroyed_by_torch(ctx: RankContext, backend: str) -> dict[str, Any]:
    before = tables()
    group = ProcessGroup(ctx.store, ctx.rank, ctx.size, backends=backend, timeout=ctx.timeout)
    got: dict[str, Any] = {}
    try:
        tg = group.to_torch(register=True)
        dist.destroy_process_group(tg)
        now = tables()
        got["torch_removed"] = all(now[k] == before[k] for k in ("pg_map", "pg_names", "pg_group_ranks", "pg_to_tag"))
        got["torch_left_empty_tag"] = now["tags_to_pg"].get(f"ptd:{tg.group_name}")  # torch's way; ours is cleared
        got["error"] = error(lambda: group.to_torch(register=True))
        got["registered_anew"] = group.device_mesh("cpu").get_group() is tg and resolves(tg.group_name)
        t = torch.ones(1)
        group.all_reduce(t)
        got["group_works"] = t.item()
    finally:
        group.shutdown()
    got["restored"] = tables() == before
    return got


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_destroying_a_registered_group(pool_for: PoolFor, backend: str) -> None:
    for got in pool_for(backend, 2).run(destroyed_by_torch, backend, timeout=120):
        assert got["torch_removed"] is True and got["torch_left_empty_tag"] == []
        assert "destroy_process_group() removed it" in got["error"], got
        assert got["registered_anew"] is True  # the error came once: the next call registered anew
        assert got["group_works"] == 2.0
        assert got["restored"] is True


# -- the default group, for the block ---------------------------------------------------------------
def default_group(ctx: RankContext, backend: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    n, r = ctx.size, ctx.rank
    dtensor_primed(ctx)
    before = tables()
    group = ProcessGroup(ctx.store, r, n, backends=backend, timeout=ctx.timeout)
    got: dict[str, Any] = {}
    try:
        with group.as_torch_default() as tg:
            got["initialized"] = dist.is_initialized()
            got["rank"] = [dist.get_rank(), dist.get_rank(tg), dist.get_world_size()]
            with group.as_torch_default() as same:
                got["nested_same"] = [same is tg, dist.get_rank()]
            got["still_default"] = dist.is_initialized()
            other = group.new_group(list(range(n)))  # another group of the same job
            try:
                got["other_refused"] = error(lambda: other.as_torch_default().__enter__())
                got["other_not_left_registered"] = other.to_torch() not in c10d._world.pg_map
            finally:
                other.shutdown()
            mesh = init_device_mesh("cpu", (n,))
            got["init_device_mesh"] = [mesh.get_group() is tg, mesh.get_local_rank()]
            from_group = DeviceMesh.from_group(tg, "cpu")
            got["from_group"] = from_group.mesh.tolist()
            full = torch.arange(4.0 * n).reshape(2 * n, 2)
            d = distribute_tensor(full if r == 0 else torch.zeros_like(full), group.device_mesh("cpu"), [Shard(0)])
            got["distribute"] = d.to_local().tolist() == full[2 * r : 2 * r + 2].tolist()
            got["replicate"] = d.redistribute(d.device_mesh, [Replicate()]).to_local().tolist() == full.tolist()
        got["after"] = [dist.is_initialized(), tables() == before]
        with group.as_torch_default():
            group.shutdown()  # a group that shuts down in the block leaves torch without a default
            got["shut_inside"] = dist.is_initialized()
    finally:
        group.shutdown()
    got["restored"] = tables() == before
    return got


@pytest.mark.parametrize("backend", BACKENDS)
def test_as_torch_default_for_the_block(pool_for: PoolFor, backend: str) -> None:
    n = 2
    for r, got in enumerate(pool_for(backend, n).run(default_group, backend, timeout=120)):
        assert got["initialized"] is True and got["rank"] == [r, r, n]
        assert got["nested_same"] == [True, r] and got["still_default"] is True
        assert "is torch's default group already" in got["other_refused"], got
        assert got["other_not_left_registered"] is True
        assert got["init_device_mesh"] == [True, r]
        assert got["from_group"] == list(range(n))
        assert got["distribute"] is True and got["replicate"] is True
        assert got["after"] == [False, True]
        assert got["shut_inside"] is False
        assert got["restored"] is True, got


def torch_default_first(ctx: RankContext, backend: str) -> dict[str, Any]:
    """torch's own default group (init_process_group, gloo), then ours: refused."""
    n, r = ctx.size, ctx.rank
    before = tables()
    dist.init_process_group("gloo", store=PrefixStore("torch", ctx.store), rank=r, world_size=n)
    got: dict[str, Any] = {}
    group = ProcessGroup(ctx.store, r, n, backends=backend, timeout=ctx.timeout)
    try:
        got["refused"] = error(lambda: group.as_torch_default().__enter__())
        got["not_left_registered"] = group.to_torch() not in c10d._world.pg_map
        got["default_kept"] = dist.get_backend() == "gloo"
        tg = group.to_torch(register=True)  # same ranks and size as torch's world: allowed
        got["get_rank"] = dist.get_rank(tg)
        swapped = ProcessGroup(PrefixStore("swapped", ctx.store), n - 1 - r, n, backends=backend, timeout=ctx.timeout)
        try:
            got["swapped_refused"] = error(lambda: swapped.to_torch(register=True))
        finally:
            swapped.shutdown()
    finally:
        group.shutdown()
        dist.destroy_process_group()
    got["clean"] = tables() == before
    return got


@pytest.mark.parametrize("backend", BACKENDS)
def test_as_torch_default_refused_beside_torchs_own(pool_for: PoolFor, backend: str) -> None:
    for r, got in enumerate(pool_for(backend, 2).run(torch_default_first, backend, timeout=120)):
        assert "torch has a default group of its own" in got["refused"], got
        assert got["not_left_registered"] is True and got["default_kept"] is True
        assert got["get_rank"] == r
        assert "torch has a default group of its own (init_process_group: rank" in got["swapped_refused"], got
        assert got["clean"] is True


# -- meshes: FSDP2, DTensor, tensor parallelism ----------------------------------------------------
def _model(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, 6, generator=gen), torch.randn(BATCH, 1, generator=gen)


def _train(model: torch.nn.Module, shard: Callable[[torch.Tensor], torch.Tensor]) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(shard(x)), shard(y)).backward()
        opt.step()


def fsdp2(ctx: RankContext, backend: str) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    n, r = ctx.size, ctx.rank
    dtensor_primed(ctx)
    before = tables()
    group = ProcessGroup(ctx.store, r, n, backends=backend, timeout=ctx.timeout)
    try:
        mesh = group.device_mesh("cpu", ("dp",))
        model = _model(seed=0)
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        rows = BATCH // n
        _train(model, lambda t: t[r * rows : (r + 1) * rows])
        mine = [cast(DTensor, p).full_tensor().detach() for p in model.parameters()]
        reference = _model(seed=0)
        _train(reference, lambda t: t)
        got = {
            "max_diff": max(float((a - b).abs().max()) for a, b in zip(mine, reference.parameters(), strict=True)),
            "moved": max(float((a - b).abs().max()) for a, b in zip(mine, _model(0).parameters(), strict=True)),
            "initialized": dist.is_initialized(),
        }
    finally:
        group.shutdown()
    got["restored"] = tables() == before
    return got


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", [2, 3])
def test_fsdp2_over_our_group_matches_single_process_training(pool_for: PoolFor, backend: str, n: int) -> None:
    for got in pool_for(backend, n).run(fsdp2, backend, timeout=180):
        assert got["initialized"] is False
        assert got["moved"] > 1e-3  # training happened
        assert got["max_diff"] < 1e-5, got
        assert got["restored"] is True


def mesh_2d(ctx: RankContext, backend: str) -> dict[str, Any]:
    """4 ranks as a 2 x 2 grid: dp = {0, 2} / {1, 3}, tp = {0, 1} / {2, 3} (made by split).
    DTensor over both dimensions with no default group; slicing and HSDP (FSDP2 on the 2-D
    mesh, which slices it) in the default-group block."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard

    r, n = ctx.rank, ctx.size
    dtensor_primed(ctx)
    before = tables()
    group = ProcessGroup(ctx.store, r, ctx.size, backends=backend, timeout=ctx.timeout)
    got: dict[str, Any] = {}
    try:
        dp, tp = group.split(r % 2), group.split(r // 2)
        assert dp is not None and tp is not None
        mesh = device_mesh("cpu", [dp, tp], mesh_dim_names=("dp", "tp"))
        got["mesh"] = mesh.mesh.tolist()
        got["groups"] = [mesh.get_group("dp") is dp.to_torch(), mesh.get_group("tp") is tp.to_torch()]
        got["coordinate"] = mesh.get_coordinate()
        got["initialized"] = dist.is_initialized()
        full = torch.arange(16.0).reshape(4, 4)
        i, j = r // 2, r % 2
        local = full[2 * i : 2 * i + 2, 2 * j : 2 * j + 2].clone()
        d = DTensor.from_local(local, mesh, [Shard(0), Shard(1)])
        got["full"] = d.redistribute(mesh, [Replicate(), Replicate()]).to_local().tolist() == full.tolist()
        got["not_grid"] = error(lambda: device_mesh("cpu", [dp, group], mesh_dim_names=("a", "b")))
        got["slice_without_default"] = error(lambda: mesh["tp"])
        with group.as_torch_default():
            got["row"] = mesh["tp"].mesh.tolist()
            got["local_ranks"] = [mesh.get_local_rank("dp"), mesh.get_local_rank("tp")]
            model = _model(seed=0)
            fully_shard(model, mesh=mesh)  # HSDP: replicated along dp, sharded along tp
            rows = BATCH // n
            _train(model, lambda t: t[r * rows : (r + 1) * rows])
            mine = [cast(DTensor, p).full_tensor().detach() for p in model.parameters()]
        reference = _model(seed=0)
        _train(reference, lambda t: t)
        got["hsdp_diff"] = max(float((a - b).abs().max()) for a, b in zip(mine, reference.parameters(), strict=True))
        for g in (dp, tp):
            g.shutdown()
    finally:
        group.shutdown()
    got["restored"] = tables() == before
    return got


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_dimensional_mesh_of_groups(pool_for: PoolFor, backend: str) -> None:
    results = pool_for(backend, 4).run(mesh_2d, backend, timeout=180)
    for r, got in enumerate(results):
        assert got["mesh"] == [[0, 1], [2, 3]]
        assert got["groups"] == [True, True] and got["coordinate"] == (r // 2, r % 2)
        assert got["initialized"] is False and got["full"] is True
        assert "do not form a grid" in got["not_grid"], got
        assert "Default process group has not been initialized" in got["slice_without_default"]
        assert got["row"] == [[0, 1], [2, 3]][r // 2] and got["local_ranks"] == [r // 2, r % 2]
        assert got["hsdp_diff"] < 1e-5, got
        assert got["restored"] is True, got


def same_ranks_two_meshes(ctx: RankContext, backend: str) -> dict[str, Any]:
    """Two jobs' groups over the same ranks: their meshes are not equal (torch's DTensor caches
    would hand one's operations the other's mesh), each group's DTensors use its own group, and
    one shut down leaves the other's working (nothing of it cached in torch's tables)."""
    from torch.distributed.tensor import Replicate, Shard

    r, n = ctx.rank, ctx.size
    dtensor_primed(ctx)
    before = tables()
    a = ProcessGroup(ctx.store, r, n, backends=backend, timeout=ctx.timeout)
    b = ProcessGroup(PrefixStore("job-b", ctx.store), r, n, backends=backend, timeout=ctx.timeout)
    got: dict[str, Any] = {}
    try:
        ma, mb = a.device_mesh("cpu"), b.device_mesh("cpu")
        got["equal"] = ma == mb or hash(ma) == hash(mb)
        local = torch.full((1, 2), float(r))
        for label, mesh in (("a", ma), ("b", mb)):
            full = DTensor.from_local(local, mesh, [Shard(0)]).redistribute(mesh, [Replicate()]).to_local()
            got[label] = full.tolist()
        a.shutdown()
        got["b_after_a"] = DTensor.from_local(local, mb, [Shard(0)]).redistribute(mb, [Replicate()]).to_local().tolist()
        got["a_mesh_after"] = error(ma.get_group)
    finally:
        a.shutdown()
        b.shutdown()
    got["restored"] = tables() == before
    return got


@pytest.mark.parametrize("backend", BACKENDS)
def test_meshes_of_two_jobs_over_the_same_ranks(pool_for: PoolFor, backend: str) -> None:
    n = 2
    expected = [[float(i)] * 2 for i in range(n)]
    for got in pool_for(backend, n).run(same_ranks_two_meshes, backend, timeout=120):
        assert got["equal"] is False
        assert got["a"] == got["b"] == got["b_after_a"] == expected
        assert "Could not resolve the process group" in got["a_mesh_after"], got
        assert got["restored"] is True


def tensor_parallel(ctx: RankContext, backend: str) -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    r, n = ctx.rank, ctx.size
    dtensor_primed(ctx)
    before = tables()
    group = ProcessGroup(ctx.store, r, n, backends=backend, timeout=ctx.timeout)
    got: dict[str, Any] = {}
    try:
        x = torch.randn(3, 6, generator=torch.Generator().manual_seed(7))
        reference = _model(seed=1)(x)
        with group.as_torch_default():  # parallelize_module distributes its weights from a group rank
            model = _model(seed=1)
            parallelize_module(model, group.device_mesh("cpu"), {"0": ColwiseParallel(), "2": RowwiseParallel()})
            out = model(x)
        got["diff"] = float((out - reference).abs().max())
        got["local_rows"] = cast(DTensor, model[0].weight).to_local().shape[0]
        mesh = group.device_mesh("cpu")
        plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
        got["scatter_without_default"] = error(lambda: parallelize_module(_model(seed=1), mesh, plan))
        own = _model(seed=1)  # every rank has the weights: each keeps its shard, nothing is scattered
        parallelize_module(own, mesh, plan, src_data_rank=None)
        got["own_shards_diff"] = float((own(x) - reference).abs().max())
        got["initialized"] = dist.is_initialized()
    finally:
        group.shutdown()
    got["restored"] = tables() == before
    return got


@pytest.mark.parametrize("backend", BACKENDS)
def test_tensor_parallel(pool_for: PoolFor, backend: str) -> None:
    for got in pool_for(backend, 2).run(tensor_parallel, backend, timeout=120):
        assert got["diff"] < 1e-5 and got["local_rows"] == 4, got
        assert "Default process group has not been initialized" in got["scatter_without_default"]
        assert got["own_shards_diff"] < 1e-5 and got["initialized"] is False, got
        assert got["restored"] is True


def bad_meshes(ctx: RankContext, backend: str) -> dict[str, Any]:
    r, n = ctx.rank, ctx.size
    group = ProcessGroup(ctx.store, r, n, backends=backend, timeout=ctx.timeout)
    other = ProcessGroup(PrefixStore("other", ctx.store), r, n, backends=backend, timeout=ctx.timeout)
    try:
        return {
            "index": error(lambda: group.device_mesh("cpu:0")),
            "no_backend": error(lambda: group.device_mesh("cuda")),
            "names": error(lambda: device_mesh("cpu", [group], mesh_dim_names=("a", "b"))),
            "empty": error(lambda: device_mesh("cpu", [])),
            "twice": error(lambda: device_mesh("cpu", [group, group], mesh_dim_names=("a", "b"))),
            "two_jobs": error(lambda: device_mesh("cpu", [group, other], mesh_dim_names=("a", "b"))),
        }
    finally:
        other.shutdown()
        group.shutdown()


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_meshes_are_refused_clearly(pool_for: PoolFor, backend: str) -> None:
    for got in pool_for(backend, 2).run(bad_meshes, backend, timeout=120):
        assert "ValueError" in got["index"] and "'cpu:0'" in got["index"]
        assert "has no backend for 'cuda'" in got["no_backend"]
        assert "mesh_dim_names must be 1 distinct strings" in got["names"]
        assert "groups is empty" in got["empty"]
        assert "appears twice" in got["twice"]
        assert "belong to 2 jobs" in got["two_jobs"], got


def test_a_missing_torch_internal_names_itself_and_the_torch_version(monkeypatch: pytest.MonkeyPatch) -> None:
    from pg_core import torch_world

    monkeypatch.delattr(torch._C._distributed_c10d, "_register_process_group")
    with pytest.raises(RuntimeError, match=r"_register_process_group, which torch .* does not have") as raised:
        torch_world._c10d()
    assert torch.__version__ in str(raised.value)
    monkeypatch.delattr(c10d._world.__class__, "pg_group_ranks")
    with pytest.raises(RuntimeError, match=r"_world\.pg_group_ranks"):
        torch_world._world()
