"""``ProcessGroup.to_torch()`` across real processes: DistributedDataParallel and the
``torch.distributed`` collectives over pg-gloo (its Gloo object registered natively) and
pg-tcp (through the Python adapter), with ``torch.distributed.is_initialized()`` False
throughout; and the futures of asynchronous calls (what DDP waits on) on every in-repo CPU
backend, pg-mpi's ranks started by ``mpiexec``."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch._C._distributed_c10d as c10d
import torch.distributed as dist
from pg_core import ProcessGroup
from pg_core.errors import CollectiveTimeout
from pg_core.interop import _Adapter
from pg_core.store import wait_for
from pg_core.testing.pool import RankContext, RankPool
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

Pools = Callable[[int], RankPool]
PoolFor = Callable[..., RankPool]  # the pool_for fixture (tests/integration/conftest.py)

BACKENDS = [
    pytest.param("gloo", marks=pytest.mark.requires_backend("gloo")),
    pytest.param("tcp", marks=pytest.mark.requires_backend("tcp")),
]

STEPS, BATCH, LR = 5, 12, 0.1


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, 6, generator=gen), torch.randn(BATCH, 1, generator=gen)


def _train(model: torch.nn.Module, shard: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(shard(x)), shard(y)).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def ddp_training(ctx: RankContext, backend: str) -> dict[str, Any]:
    group = ProcessGroup(ctx.store, ctx.rank, ctx.size, backends=backend, timeout=ctx.timeout)
    try:
        torch_group = group.to_torch()
        assert group.to_torch() is torch_group
        out: dict[str, Any] = {"adapter": isinstance(torch_group, _Adapter), "initialized": [dist.is_initialized()]}
        if not out["adapter"]:  # the group's own Gloo object is what torch calls
            out["same_gloo"] = (
                torch_group._get_backend(torch.device("cpu"))
                is group._dispatch.instance(torch.device("cpu")).backend.c10d
            )
        model = _model(seed=ctx.rank)  # different initial weights on every rank
        ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=torch_group)
        rows = BATCH // ctx.size
        mine = _train(ddp, lambda t: t[ctx.rank * rows : (ctx.rank + 1) * rows])
        # single process, whole batch, from rank 0's initial weights (DDP broadcasts them)
        reference = _train(_model(seed=0), lambda t: t)
        out["max_diff"] = max(float((a - b).abs().max()) for a, b in zip(mine, reference, strict=True))
        out["moved"] = max(float((a - b).abs().max()) for a, b in zip(mine, list(_model(0).parameters()), strict=True))
        out["initialized"].append(dist.is_initialized())
        return out
    finally:
        group.shutdown()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", [2, 3])
def test_ddp_over_our_group_matches_single_process_training(rank_pools: Pools, backend: str, n: int) -> None:
    results = rank_pools(n).run(ddp_training, backend, timeout=180)
    for out in results:
        assert out["initialized"] == [False, False]
        assert out["adapter"] is (backend == "tcp")
        if backend == "gloo":
            assert out["same_gloo"] is True
        assert out["moved"] > 1e-3  # training happened
        assert out["max_diff"] < 1e-5, results


def torch_collectives(ctx: RankContext, backend: str) -> dict[str, Any]:
    n, r = ctx.size, ctx.rank
    group = ProcessGroup(ctx.store, r, n, backends=backend, timeout=ctx.timeout)
    try:
        pg = group.to_torch()
        got: dict[str, Any] = {}
        t = torch.full((3,), float(r + 1))
        dist.all_reduce(t, group=pg)
        got["all_reduce"] = t.tolist()
        t = torch.full((2,), float(r + 1))
        work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pg, async_op=True)
        work.wait()
        got["all_reduce_max_async"] = t.tolist()
        t = torch.full((2,), float(r))
        dist.broadcast(t, group=pg, group_src=n - 1)
        got["broadcast"] = t.tolist()
        outs = [torch.empty(1) for _ in range(n)]
        dist.all_gather(outs, torch.tensor([float(r)]), group=pg)
        got["all_gather"] = [o.item() for o in outs]
        out = torch.empty(2 * n)  # flat: torch's Gloo refuses a stacked (n, 2) output (our group takes both)
        dist.all_gather_into_tensor(out, torch.full((2,), float(r)), group=pg)
        got["all_gather_into_tensor"] = out.tolist()
        rs = torch.empty(1)
        dist.reduce_scatter_tensor(rs, torch.arange(n, dtype=torch.float32), group=pg)
        got["reduce_scatter_tensor"] = rs.item()
        a2a = torch.empty(n)
        dist.all_to_all_single(a2a, torch.arange(n, dtype=torch.float32) + 10 * r, group=pg)
        got["all_to_all_single"] = a2a.tolist()
        gathered = [torch.empty(1) for _ in range(n)] if r == 0 else None
        dist.gather(torch.tensor([float(r * r)]), gathered, group=pg, group_dst=0)
        got["gather"] = [g.item() for g in gathered] if gathered else None
        sc = torch.empty(1)
        dist.scatter(sc, [torch.tensor([float(10 + i)]) for i in range(n)] if r == 0 else None, group=pg, group_src=0)
        got["scatter"] = sc.item()
        red = torch.full((1,), float(r + 1))
        dist.reduce(red, group=pg, group_dst=0)
        got["reduce_root"] = red.item() if r == 0 else None
        dist.barrier(group=pg)
        if r == 0:
            dist.send(torch.tensor([42.0]), group=pg, group_dst=1)
        elif r == 1:
            msg = torch.empty(1)
            dist.irecv(msg, group=pg, group_src=0).wait()  # (dist.recv returns a global rank: needs the registry)
            got["recv"] = msg.item()
        got["initialized"] = dist.is_initialized()
        got["world_size"] = dist.get_world_size(pg)
        return got
    finally:
        group.shutdown()


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_distributed_collectives_take_our_group(rank_pools: Pools, backend: str) -> None:
    n = 3
    results = rank_pools(n).run(torch_collectives, backend, timeout=120)
    for r, got in enumerate(results):
        assert got["all_reduce"] == [6.0] * 3
        assert got["all_reduce_max_async"] == [3.0] * 2
        assert got["broadcast"] == [2.0, 2.0]
        assert got["all_gather"] == [0.0, 1.0, 2.0]
        assert got["all_gather_into_tensor"] == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0]
        assert got["reduce_scatter_tensor"] == 3.0 * r
        assert got["all_to_all_single"] == [r + 10.0 * s for s in range(n)]
        assert got["gather"] == ([0.0, 1.0, 4.0] if r == 0 else None)
        assert got["scatter"] == 10.0 + r
        assert got["reduce_root"] == (6.0 if r == 0 else None)
        assert got.get("recv") == (42.0 if r == 1 else None)
        assert got["initialized"] is False
        assert got["world_size"] == n


def torch_irecv_from_any_source(ctx: RankContext) -> list[tuple[int, float]] | None:
    """``torch.distributed.irecv(t, group=...)`` without ``src`` on the Python adapter (pg-tcp):
    the group's receive from any source, and the work's ``_source_rank()`` is the sender."""
    with ProcessGroup(ctx.store, ctx.rank, ctx.size, backends="tcp", timeout=ctx.timeout) as group:
        pg = group.to_torch()
        if ctx.rank != 0:
            dist.send(torch.tensor([float(ctx.rank)]), group=pg, group_dst=0)
            return None
        got = []
        for _ in range(ctx.size - 1):
            msg = torch.empty(1)
            work = dist.irecv(msg, group=pg)
            work.wait()
            got.append((work._source_rank(), msg.item()))
        return got


@pytest.mark.requires_backend("tcp")
def test_torch_irecv_without_src_receives_from_any_source(rank_pools: Pools) -> None:
    got = rank_pools(3).run(torch_irecv_from_any_source, timeout=120)[0]
    assert got is not None and sorted(got) == [(1, 1.0), (2, 2.0)]


# -- futures: complete without anyone waiting on the work, on every backend ------------------------


def future_path(ctx: RankContext, backend: str) -> dict[str, Any]:
    """What torch does with an asynchronous call's work: waits on its future (never on the
    work), chains ``then`` callbacks on it that must run by themselves, and (DDP's comm hook)
    returns such a chained future to DDP; then a call rank 1 never joins, whose future must
    fail with the call's timeout on rank 0. Every wait is bounded (by the pool's timeout)."""
    n, r = ctx.size, ctx.rank
    group = ProcessGroup(ctx.store, r, n, backends=backend, timeout=ctx.timeout)
    try:
        pg = group.to_torch()
        got: dict[str, Any] = {"adapter": isinstance(pg, _Adapter)}
        t = torch.full((3,), float(r + 1))
        got["future"] = [x.tolist() for x in dist.all_reduce(t, group=pg, async_op=True).get_future().wait()]
        ran = threading.Event()
        t = torch.full((2,), float(r))

        def callback(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            ran.set()
            return fut.value()[0] / n

        chained = dist.all_reduce(t, group=pg, async_op=True).get_future().then(callback)
        got["callback_ran_unwaited"] = ran.wait(60)  # nobody waits on the work nor on either future
        got["then"] = chained.wait().tolist()
        model = _model(seed=r)
        ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=pg)
        ddp.register_comm_hook(pg, allreduce_hook)  # all_reduce(async_op=True).get_future().then(...)
        rows = BATCH // n
        mine = _train(ddp, lambda x: x[r * rows : (r + 1) * rows])
        reference = _train(_model(seed=0), lambda x: x)
        got["hook_max_diff"] = max(float((a - b).abs().max()) for a, b in zip(mine, reference, strict=True))
        group.barrier()
        if r == 0:  # rank 1 never joins this one: its future fails with the call's timeout
            opts = dist.AllreduceOptions()
            opts.timeout = timedelta(seconds=1)
            start = time.monotonic()
            future = pg.allreduce([torch.ones(2)], opts).get_future()
            try:
                future.wait()
            except Exception as exc:  # what the future raised is what is checked
                got["timeout"] = (type(exc).__name__, str(exc), time.monotonic() - start)
            else:
                got["timeout"] = ("completed", "", time.monotonic() - start)
            finally:
                ctx.store.set("future_path/timed_out", "1")
        else:
            wait_for(ctx.store, ["future_path/timed_out"], 60)
        return got
    finally:
        group.shutdown()


@pytest.mark.parametrize(
    "backend",
    [*BACKENDS, pytest.param("mpi", marks=pytest.mark.requires_backend("mpi"))],
)
def test_futures_complete_without_a_wait_on_the_work_and_fail_at_the_timeout(pool_for: PoolFor, backend: str) -> None:
    pool = pool_for(backend)
    results = pool.run(future_path, backend, timeout=120)
    for r, got in enumerate(results):
        assert got["adapter"] is (backend != "gloo")
        assert got["future"] == [[3.0] * 3]
        assert got["callback_ran_unwaited"] is True
        assert got["then"] == [0.5, 0.5]
        assert got["hook_max_diff"] < 1e-5, got
        if r == 0:
            kind, message, seconds = got["timeout"]
            assert 0.9 < seconds < 30, got
            if backend == "gloo":  # torch's own ProcessGroupGloo: its error
                assert "timed out" in message.lower() or "timeout" in message.lower(), got
            else:
                assert kind == CollectiveTimeout.__name__ and "all_reduce" in message, got
        else:
            assert "timeout" not in got


# -- a full torch citizen: names, every collective torch may call, autograd, timeouts, destroy --------


def torch_names(ctx: RankContext, backend: str) -> dict[str, Any]:
    """The ``group_name`` of every torch group: the world, a subgroup, the same ranks and name
    formed again, a split, ``shrink()``'s result and a second job's world of the same name in this
    process (another store prefix); each read from torch (``tg.group_name`` is C++'s
    ``getGroupName``, which the adapter answers) and resolved by torch's registry."""
    groups: list[ProcessGroup] = []
    try:
        world = ProcessGroup(ctx.store, ctx.rank, ctx.size, backends=backend, timeout=ctx.timeout)
        groups.append(world)
        first = world.new_group([0, 1], name="pair")
        groups.append(first)
        names = {"world": world.to_torch().group_name, "pair": first.to_torch().group_name}
        first.shutdown()
        again = world.new_group([0, 1], name="pair")
        groups.append(again)
        names["pair again"] = again.to_torch().group_name
        split = world.split(color=0)
        assert split is not None
        groups.append(split)
        names["split"] = split.to_torch().group_name
        shrunk = world.shrink()
        groups.append(shrunk)
        names["shrunk"] = shrunk.to_torch().group_name
        other_job = ProcessGroup(dist.PrefixStore("job2", ctx.store), ctx.rank, ctx.size, backends=backend)
        groups.append(other_job)
        names["other job"] = other_job.to_torch().group_name
        resolved = {}
        for what, group in [("world", world), ("other job", other_job)]:
            tg = group.to_torch()
            c10d._register_process_group(tg.group_name, tg)
            try:
                resolved[what] = c10d._resolve_process_group(tg.group_name).group_name == tg.group_name
            finally:
                c10d._unregister_process_group(tg.group_name)
        tg = world.to_torch()
        return {
            "names": names,
            "uids": {what: f"pg_core:{g.uid}" for what, g in zip(names, groups, strict=True)},
            "resolved": resolved,
            "backend_name": tg._get_backend_name(),
            "adapter": isinstance(tg, _Adapter),
        }
    finally:
        for group in reversed(groups):
            group.shutdown()


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_torch_group_has_a_unique_group_name_that_torch_reads(rank_pools: Pools, backend: str) -> None:
    results = rank_pools(2).run(torch_names, backend, timeout=180)
    assert results[0]["names"] == results[1]["names"]  # one name per group, on every member
    for got in results:
        names = got["names"]
        assert names == got["uids"], got
        assert len(set(names.values())) == len(names), names  # no two alike
        assert got["resolved"] == {"world": True, "other job": True}
        assert got["backend_name"] == ("pg_core" if got["adapter"] else "gloo")


def _sum_weighted(y: torch.Tensor) -> torch.Tensor:
    """A loss whose gradient differs per element, so that a wrong backward shows."""
    return (y * torch.arange(1, y.numel() + 1, dtype=y.dtype).view_as(y)).sum()


def functional_autograd(ctx: RankContext, backend: str) -> dict[str, Any]:
    """Forward and backward through torch's functional collectives (and ``torch.distributed.nn``'s
    autograd all_reduce) over the group's torch group, registered under its ``group_name`` in
    torch's C++ registry for the test (what they resolve the group by)."""
    import torch.distributed._functional_collectives as fc
    import torch.distributed.nn.functional as nn_functional

    n, r = ctx.size, ctx.rank
    group = ProcessGroup(ctx.store, r, n, backends=backend, timeout=ctx.timeout)
    tg = group.to_torch()
    c10d._register_process_group(tg.group_name, tg)
    try:
        calls: dict[str, Callable[[torch.Tensor], Any]] = {
            "all_reduce": lambda x: fc.all_reduce(x, "sum", tg),
            "all_gather_tensor": lambda x: fc.all_gather_tensor(x, 0, tg),
            "reduce_scatter_tensor": lambda x: fc.reduce_scatter_tensor(x, "sum", 0, tg),
            "all_to_all_single": lambda x: fc.all_to_all_single(x, None, None, tg),
            "all_reduce_coalesced": lambda x: fc.all_reduce_coalesced([x, 2 * x], "sum", tg),
            "all_gather_tensor_autograd": lambda x: fc.all_gather_tensor_autograd(x, 0, tg),
            "reduce_scatter_tensor_autograd": lambda x: fc.reduce_scatter_tensor_autograd(x, "sum", 0, tg),
            "nn.all_reduce": lambda x: nn_functional.all_reduce(x, group=tg),
        }
        got: dict[str, Any] = {}
        for name, call in calls.items():
            x = (torch.arange(2 * n, dtype=torch.float32) + 10 * r).requires_grad_()
            y = call(x)
            y = torch.cat([fc.wait_tensor(t) for t in y]) if isinstance(y, list) else fc.wait_tensor(y)
            _sum_weighted(y).backward()
            assert x.grad is not None
            got[name] = (y.detach().tolist(), x.grad.tolist())
        return got
    finally:
        c10d._unregister_process_group(tg.group_name)
        group.shutdown()


@pytest.mark.parametrize(
    "backend",
    [*BACKENDS, pytest.param("mpi", marks=pytest.mark.requires_backend("mpi"))],
)
def test_autograd_through_functional_collectives(pool_for: PoolFor, backend: str) -> None:
    n = 2
    results = pool_for(backend).run(functional_autograd, backend, timeout=120)
    xs = [[float(i + 10 * r) for i in range(2 * n)] for r in range(n)]
    total = [sum(col) for col in zip(*xs, strict=True)]
    weights = [float(i + 1) for i in range(2 * n)]
    for r, got in enumerate(results):
        # all_reduce: y = sum of every rank's x; dL/dx = sum over ranks of the weights
        assert got["all_reduce"] == (total, [n * w for w in weights]), got
        assert got["nn.all_reduce"] == got["all_reduce"]
        # all_gather: y = x0 ++ x1; dL/dx_r = sum over ranks of the weights of block r
        gathered = [v for x in xs for v in x]
        grad = [n * float(2 * n * r + i + 1) for i in range(2 * n)]
        assert got["all_gather_tensor"] == (gathered, grad), got
        assert got["all_gather_tensor_autograd"] == got["all_gather_tensor"]
        # reduce_scatter: y = block r of the sum; dL/dx = every rank's weights, gathered
        assert got["reduce_scatter_tensor"] == (total[2 * r : 2 * r + 2], [1.0, 2.0] * n), got
        assert got["reduce_scatter_tensor_autograd"] == got["reduce_scatter_tensor"]
        # all_to_all: y = block r of every rank; dL/dx block s = rank s's weights of block r
        swapped = [v for x in xs for v in x[2 * r : 2 * r + 2]]
        grad = [float(2 * r + i + 1) for _ in range(n) for i in range(2)]
        assert got["all_to_all_single"] == (swapped, grad), got
        # coalesced: y = (sum, 2 * sum); dL/dx = the weights of both halves, summed over ranks
        coalesced = [*total, *(2 * v for v in total)]
        grad = [n * (w + 2 * (w + 2 * n)) for w in weights]
        assert got["all_reduce_coalesced"] == (coalesced, grad), got


def _collective_names() -> set[str]:
    """The collectives of torch's ``ProcessGroup`` binding that a group must answer for torch."""
    names = {n for n in dir(c10d.ProcessGroup) if not n.startswith("__")}
    not_collectives = {
        *("BackendType", "CUSTOM", "GLOO", "MPI", "NCCL", "UCC", "UNDEFINED", "XCCL"),  # enum values
        *("_backend_id", "_device_types", "_get_backend", "_register_backend", "_set_default_backend"),
        *("_get_backend_name", "name", "rank", "size", "bound_device_id", "group_name", "group_desc"),
        *("_set_group_name", "_set_group_desc", "_id", "_pybind11_conduit_v1_", "boxed", "unbox"),
        *("_has_hooks", "_register_on_completion_hook", "_wait_for_pending_works", "_enable_collectives_timing"),
        *("get_group_store", "set_timeout", "split_group", "merge_remote_group", "use_pg_for_symm_mem_rendezvous"),
        *("_get_sequence_number_for_group", "_set_sequence_number_for_group"),  # torch asks backends, not groups
        *("shutdown", "abort"),  # life, not collectives (the adapter answers them too)
    }
    return names - not_collectives


def test_the_adapter_answers_every_collective_of_torchs_process_group() -> None:
    """If torch adds a collective, this names it: the adapter must answer it (or the list above
    must say why it need not), or torch's C++ default would fail with 'No backend type
    associated with device type cpu'."""
    missing = sorted(n for n in _collective_names() if n not in vars(_Adapter))
    assert missing == [], f"torch's ProcessGroup has collectives the adapter does not answer: {missing}"
    assert {"shutdown", "abort", "getGroupName", "setGroupName"} <= set(vars(_Adapter))


def torch_side_collectives(ctx: RankContext, backend: str) -> dict[str, Any]:
    """The collectives torch's Python layer calls that DDP and the first tests did not:
    ``all_gather_coalesced`` (torch's ``allgather_coalesced``), the object paths of broadcast,
    gather and scatter, and ``monitored_barrier`` (on the torch group: ``dist.monitored_barrier``
    itself refuses every backend not named gloo)."""
    n, r = ctx.size, ctx.rank
    group = ProcessGroup(ctx.store, r, n, backends=backend, timeout=ctx.timeout)
    try:
        tg: Any = group.to_torch()  # (torch's stubs lack monitored_barrier, which its binding has)
        got: dict[str, Any] = {}
        outs = [[torch.empty(2), torch.empty(1)] for _ in range(n)]
        dist.all_gather_coalesced(outs, [torch.full((2,), float(r)), torch.tensor([10.0 + r])], group=tg)
        got["all_gather_coalesced"] = [[t.tolist() for t in row] for row in outs]
        outs = [[torch.empty(3)] for _ in range(n)]
        work = dist.all_gather_coalesced(outs, [torch.full((3,), r + 0.5)], group=tg, async_op=True)
        assert work is not None
        work.wait()
        got["all_gather_coalesced_async"] = [row[0].tolist() for row in outs]
        # the object paths (pickled tensors through the collectives above), with group ranks
        objects: list[Any] = [r * 10]
        dist.broadcast_object_list(objects, group=tg, group_src=n - 1)
        got["broadcast_object_list"] = objects
        gathered: list[Any] | None = [None] * n if r == 0 else None
        dist.gather_object({"rank": r}, gathered, group=tg, group_dst=0)
        got["gather_object"] = gathered
        scattered: list[Any] = [None]
        dist.scatter_object_list(scattered, [f"to {i}" for i in range(n)] if r == 0 else None, group=tg, group_src=0)
        got["scatter_object_list"] = scattered
        tg.monitored_barrier(timedelta(seconds=30), wait_all_ranks=True)
        if r == 0:  # rank 1 never comes to this one
            start = time.monotonic()
            try:
                tg.monitored_barrier(timedelta(seconds=1), wait_all_ranks=True)
            except Exception as exc:  # what it raised is what is checked
                got["absent"] = (type(exc).__name__, str(exc), time.monotonic() - start)
            start = time.monotonic()
            try:  # torch's zero timeout: no time for anyone (torch's own test of it expects an error at once)
                tg.monitored_barrier(timedelta(0))
            except RuntimeError as exc:  # torch's habit catches pg-core's timeout too
                got["absent_now"] = (str(exc), time.monotonic() - start)
            finally:
                ctx.store.set("torch_side/gave_up", "1")
        else:
            wait_for(ctx.store, ["torch_side/gave_up"], 60)
        return got
    finally:
        group.shutdown()


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_gather_coalesced_and_monitored_barrier_on_the_torch_group(rank_pools: Pools, backend: str) -> None:
    results = rank_pools(2).run(torch_side_collectives, backend, timeout=120)
    for r, got in enumerate(results):
        assert got["all_gather_coalesced"] == [[[0.0, 0.0], [10.0]], [[1.0, 1.0], [11.0]]], got
        assert got["all_gather_coalesced_async"] == [[0.5] * 3, [1.5] * 3], got
        assert got["broadcast_object_list"] == [10]
        assert got["gather_object"] == ([{"rank": 0}, {"rank": 1}] if r == 0 else None)
        assert got["scatter_object_list"] == [f"to {r}"]
        if r == 0:
            kind, message, seconds = got["absent"]
            assert kind == ("CollectiveTimeout" if backend == "tcp" else "RuntimeError"), got  # gloo: torch's
            assert re.search(r"[Rr]anks?(\(s\))? 1\b", message) and 0.9 < seconds < 10, got  # names who did not come
            message, seconds = got["absent_now"]
            if backend == "tcp":  # (on gloo, torch's own Gloo closed its pairs at the first one's timeout)
                assert "Rank 0 timed out in monitoredBarrier" in message and seconds < 5, got  # torch's words, at once
        else:
            assert "absent" not in got


def destroy_unregistered(ctx: RankContext, backend: str) -> dict[str, Any]:
    """``torch.distributed.destroy_process_group(tg)`` on a torch group that is in none of
    torch's tables, and the adapter's ``shutdown()`` and ``abort()`` (what torch's destroy and
    abort call on a registered one): none of them ends the pg-core group."""
    group = ProcessGroup(ctx.store, ctx.rank, ctx.size, backends=backend, timeout=ctx.timeout)
    try:
        tg = group.to_torch()
        got: dict[str, Any] = {}
        try:
            dist.destroy_process_group(tg)
        except Exception as exc:  # what torch raised is what is checked
            got["destroy"] = (type(exc).__name__, str(exc))
        if isinstance(tg, _Adapter):  # what torch's destroy and abort call on a group in its tables
            tg.shutdown()
            tg.abort()
        t = torch.ones(2)
        dist.all_reduce(t, group=tg)
        group.all_reduce(t)
        got["after"] = t.tolist()
        return got
    finally:
        group.shutdown()


@pytest.mark.parametrize("backend", BACKENDS)
def test_destroy_process_group_of_an_unregistered_group_shuts_nothing_down(rank_pools: Pools, backend: str) -> None:
    for got in rank_pools(2).run(destroy_unregistered, backend, timeout=120):
        # torch's own check, before it touches the group: it is not in torch's tables
        assert got["destroy"] == ("ValueError", "Invalid process group specified"), got
        assert got["after"] == [4.0, 4.0]


def timeout_wording(ctx: RankContext) -> dict[str, str] | None:
    """What a pg-core timeout says, where torch users grep for torch's words ("Timed out")."""
    with ProcessGroup(ctx.store, ctx.rank, ctx.size, backends="tcp", timeout=ctx.timeout) as group:
        group.barrier()
        if ctx.rank == 1:
            wait_for(ctx.store, ["timeout_wording/done"], 60)
            return None
        said = {}
        try:
            for name, call in [
                ("all_reduce", lambda: group.all_reduce(torch.ones(2), timeout=0.5)),
                ("recv", lambda: group.recv(torch.ones(2), 1, timeout=0.5)),
                ("wait", lambda: group.irecv(torch.ones(2), 1, tag=3).wait(0.5)),
            ]:
                try:
                    call()
                except CollectiveTimeout as exc:
                    said[name] = str(exc)
        finally:
            ctx.store.set("timeout_wording/done", "1")
        return said


@pytest.mark.requires_backend("tcp")
def test_a_timeout_says_timed_out_as_torchs_do(rank_pools: Pools) -> None:
    said = rank_pools(2).run(timeout_wording, timeout=60)[0]
    assert said is not None and set(said) == {"all_reduce", "recv", "wait"}, said
    for name, message in said.items():
        # torch's users grep for 'Timed out': the first words of the message, or of its clause after
        # where it happened ("pg-tcp group 'world' rank 0: Timed out after 0.5 s in recv from rank 1")
        assert re.match(r"([^;]*: )?Timed out\b", message), message
        assert name.replace("wait", "recv") in message and "0.5" in message, message
