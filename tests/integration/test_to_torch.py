"""``ProcessGroup.to_torch()`` across real processes: DistributedDataParallel and the
``torch.distributed`` collectives over pg-gloo (its Gloo object registered natively) and
pg-tcp (through the Python adapter), with ``torch.distributed.is_initialized()`` False
throughout."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from pg_core import ProcessGroup
from pg_core.interop import _Adapter
from pg_core.testing.pool import RankContext, RankPool

Pools = Callable[[int], RankPool]

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
