"""``ProcessGroup.to_torch()`` across real processes: DistributedDataParallel and the
``torch.distributed`` collectives over pg-gloo (its Gloo object registered natively) and
pg-tcp (through the Python adapter), with ``torch.distributed.is_initialized()`` False
throughout; and the futures of asynchronous calls (what DDP waits on) on every in-repo CPU
backend, pg-mpi's ranks started by ``mpiexec``."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
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
