"""One group, two torch C++ backends, on a GPU: cpu tensors on pg-gloo, cuda tensors on
pg-nccl, in real rank processes (one GPU per rank: world size 1 .. the visible GPUs, at most 4).

What is checked: each backend is created on the first use of its device type, cuda values
are right (blocking, and ``async_op=True`` with a Work that the current stream waits on),
objects and ``barrier`` stay on cpu, a cuda tensor of unknown shape travels as metadata over
cpu and payload over NCCL, ``to_torch()`` registers both C++ objects on one torch group, and
DDP on cuda over it matches single-process training. Skipped, naming what is missing, where
pg-nccl cannot run (``pg_nccl.plugin.is_available()``: a CPU-only torch, no GPU visible).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from pg_core import ProcessGroup, ReduceOp
from pg_core.testing.pool import RankContext, RankPool
from pg_core.testing.rank import run_warm_up
from pg_nccl.plugin import is_available

Pools = Callable[[int], RankPool]

REASON = is_available()
pytestmark = [
    pytest.mark.requires_backend("gloo"),
    pytest.mark.skipif(REASON is not None, reason=f"pg-nccl cannot run here: {REASON}"),
]


@pytest.fixture(scope="module")
def rank_pools() -> Iterator[Pools]:
    """Pools whose ranks bind GPU ``rank`` and start what CUDA and NCCL start once per process
    (the context, NCCL's RAS service) before any call: the leak check counts what a group leaves."""
    pools: dict[int, RankPool] = {}

    def get(n: int) -> RankPool:
        if n not in pools:
            pools[n] = RankPool(n, devices=("cuda",), prelude=(run_warm_up, ("nccl", ["cuda"], 60.0)))
        return pools[n]

    yield get
    for pool in pools.values():
        pool.close()


def _world_sizes() -> list[int]:
    return list(range(1, min(torch.cuda.device_count(), 4) + 1)) if REASON is None else [1]


def gloo_and_nccl(ctx: RankContext, as_string: bool) -> dict[str, Any]:
    cuda = torch.device("cuda", ctx.rank)
    backends: Any = " cpu : gloo , cuda:nccl " if as_string else {"cpu": "gloo", "cuda": "nccl"}
    group = ProcessGroup(ctx.store, ctx.rank, ctx.size, backends=backends, timeout=ctx.timeout)
    try:
        out: dict[str, Any] = {"backends": group.backends, "created": []}

        def created() -> list[str]:
            return sorted(group._dispatch._instances)

        t = torch.full((5,), float(ctx.rank + 1))
        group.all_reduce(t)
        out["cpu_sum"], out["created"] = t.tolist(), [created()]

        c = torch.full((1 << 20,), float(ctx.rank + 1), device=cuda)
        group.all_reduce(c)
        out["cuda_sum"] = c[:3].tolist()
        out["created"].append(created())
        out["cuda_type"] = type(group._dispatch._instances["cuda"].backend).__name__
        out["cpu_type"] = type(group._dispatch._instances["cpu"].backend).__name__

        m = torch.full((4, 3), float(ctx.rank), device=cuda)
        work = group.all_reduce(m, ReduceOp.MAX, async_op=True)
        assert work is not None
        work.wait()  # the current stream waits; the values read below are in stream order
        out["cuda_async_max"] = float(m.max())

        b = torch.arange(6, device=cuda, dtype=torch.float64) * (ctx.rank + 1)
        group.broadcast(b, src=ctx.size - 1)
        out["cuda_broadcast"] = b.tolist()

        g = torch.empty(ctx.size * 2, device=cuda, dtype=torch.int64)
        group.all_gather_into_tensor(g, torch.full((2,), ctx.rank, device=cuda, dtype=torch.int64))
        out["cuda_gather"] = g.tolist()

        # objects and barrier: the cpu backend; NCCL never sees them
        out["object"] = group.broadcast_object({"from": ctx.rank} if ctx.rank == 0 else None, src=0)
        group.barrier()
        if ctx.size >= 2:  # unknown shape: metadata over gloo, payload over NCCL
            if ctx.rank == 0:
                group.send_tensor(torch.arange(12, device=cuda, dtype=torch.float32).reshape(3, 4), dst=1)
            elif ctx.rank == 1:
                got = group.recv_tensor(src=0, device=cuda)
                out["received"] = (str(got.device), tuple(got.shape), got.sum().item())

        torch_group = group.to_torch()
        out["native_cuda"] = torch_group._get_backend(cuda) is group._dispatch._instances["cuda"].backend.c10d
        out["native_cpu"] = (
            torch_group._get_backend(torch.device("cpu")) is group._dispatch._instances["cpu"].backend.c10d
        )
        x = torch.ones(8, device=cuda)
        dist.all_reduce(x, group=torch_group)
        out["torch_side_sum"] = float(x[0])
        torch.cuda.synchronize()
        out["initialized"] = dist.is_initialized()
        return out
    finally:
        group.shutdown()


@pytest.mark.parametrize("as_string", [False, True], ids=["dict", "string"])
@pytest.mark.parametrize("n", _world_sizes())
def test_cpu_on_gloo_and_cuda_on_nccl(rank_pools: Pools, n: int, as_string: bool) -> None:
    results = rank_pools(n).run(gloo_and_nccl, as_string, timeout=240)
    total = float(sum(range(1, n + 1)))
    for rank, out in enumerate(results):
        assert out["backends"] == {"cpu": "gloo", "cuda": "nccl"}
        assert out["created"] == [["cpu"], ["cpu", "cuda"]]  # each on the first use of its device type
        assert (out["cpu_type"], out["cuda_type"]) == ("GlooBackend", "NCCLBackend")
        assert out["cpu_sum"] == [total] * 5
        assert out["cuda_sum"] == [total] * 3
        assert out["cuda_async_max"] == float(n - 1)
        assert out["cuda_broadcast"] == [float(i * n) for i in range(6)]
        assert out["cuda_gather"] == [r for r in range(n) for _ in range(2)]
        assert out["object"] == {"from": 0}
        if n >= 2 and rank == 1:
            assert out["received"] == ("cuda:1", (3, 4), float(sum(range(12))))
        assert out["native_cuda"] and out["native_cpu"]
        assert out["torch_side_sum"] == float(n)
        assert out["initialized"] is False


def ddp_on_cuda(ctx: RankContext) -> float:
    cuda = torch.device("cuda", ctx.rank)
    group = ProcessGroup(ctx.store, ctx.rank, ctx.size, backends="cpu:gloo,cuda:nccl", timeout=ctx.timeout)
    try:
        steps, batch = 4, 8 * ctx.size

        def model(seed: int) -> torch.nn.Module:
            torch.manual_seed(seed)
            return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1)).to(
                cuda, torch.float64
            )

        def train(m: torch.nn.Module, lo: int, hi: int) -> list[torch.Tensor]:
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            for step in range(steps):
                gen = torch.Generator().manual_seed(step)
                x = torch.randn(batch, 6, generator=gen, dtype=torch.float64).to(cuda)
                y = torch.randn(batch, 1, generator=gen, dtype=torch.float64).to(cuda)
                opt.zero_grad()
                torch.nn.functional.mse_loss(m(x[lo:hi]), y[lo:hi]).backward()
                opt.step()
            return [p.detach() for p in m.parameters()]

        rows = batch // ctx.size
        ddp = torch.nn.parallel.DistributedDataParallel(model(ctx.rank), process_group=group.to_torch())
        mine = train(ddp, ctx.rank * rows, (ctx.rank + 1) * rows)
        reference = train(model(0), 0, batch)
        return max(float((a - b).abs().max()) for a, b in zip(mine, reference, strict=True))
    finally:
        group.shutdown()


@pytest.mark.parametrize("n", _world_sizes())
def test_ddp_on_cuda_over_our_group_matches_single_process_training(rank_pools: Pools, n: int) -> None:
    for diff in rank_pools(n).run(ddp_on_cuda, timeout=240):
        assert diff < 1e-9
