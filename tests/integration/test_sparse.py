"""all_reduce of a sparse COO tensor, as torch's Gloo sums one, on every CPU backend: the
ranks' entries (duplicates, overlaps, none at all, hybrid values) summed into a coalesced
tensor alike on every rank, in place, blocking and async, through the group and through
torch's API on its torch group; a shape that differs between ranks, or another reduction,
refused on every rank."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from pg_core import ProcessGroup, ReduceOp
from pg_core.errors import NotSupportedError
from pg_core.testing.pool import RankContext, RankPool

PoolFor = Callable[..., RankPool]  # the pool_for fixture (tests/integration/conftest.py)

BACKENDS = [
    pytest.param("tcp", marks=pytest.mark.requires_backend("tcp")),
    pytest.param("gloo", marks=pytest.mark.requires_backend("gloo")),
    pytest.param("mpi", marks=pytest.mark.requires_backend("mpi")),
]


def sparse_sums(ctx: RankContext, backend: str) -> dict[str, Any]:
    group = ProcessGroup(ctx.store, ctx.rank, ctx.size, backends=backend, timeout=ctx.timeout)
    r = group.rank
    got: dict[str, Any] = {}
    try:
        # 1-D: rank 0 has {1: 1, 4: 2}; rank 1 has {4: 10, 7: 3} and a duplicate 7 (uncoalesced)
        if r == 0:
            t = torch.sparse_coo_tensor(torch.tensor([[1, 4]]), torch.tensor([1.0, 2.0]), (10,))
        else:
            t = torch.sparse_coo_tensor(torch.tensor([[4, 7, 7]]), torch.tensor([10.0, 3.0, 1.0]), (10,))
        group.all_reduce(t)
        got["flat"] = (t.is_coalesced(), t.to_dense().tolist())
        # hybrid: 1 sparse dim, values of 3; rank 1 has no entries at all
        rows = torch.tensor([[0, 3]]) if r == 0 else torch.empty((1, 0), dtype=torch.int64)
        vals = torch.arange(6, dtype=torch.int64).reshape(2, 3) if r == 0 else torch.empty((0, 3), dtype=torch.int64)
        h = torch.sparse_coo_tensor(rows, vals, (5, 3))
        work = group.all_reduce(h, async_op=True)
        assert work is not None
        work.wait()
        got["hybrid"] = h.to_dense().tolist()
        empty = torch.sparse_coo_tensor(torch.empty((2, 0), dtype=torch.int64), torch.empty(0), (4, 4))
        group.all_reduce(empty)
        got["empty"] = (empty._nnz(), empty.to_dense().sum().item())
        # torch's API on the torch group: torch's Gloo itself on pg-gloo, the group through the adapter on the others
        viat = torch.sparse_coo_tensor(torch.tensor([[r]]), torch.tensor([float(r + 1)]), (3,))
        dist.all_reduce(viat, group=group.to_torch())
        got["torch"] = viat.to_dense().tolist()
        for name, call in (
            ("max", lambda: group.all_reduce(t, ReduceOp.MAX)),
            ("shape", lambda: group.all_reduce(torch.zeros(4 + r).to_sparse())),
        ):
            try:
                call()
            except (NotSupportedError, ValueError) as exc:
                got[name] = (type(exc).__name__, str(exc))
        group.barrier()  # still in step after the refusals
        return got
    finally:
        group.shutdown()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_sparse_tensor_is_summed_on_every_backend(backend: str, pool_for: PoolFor) -> None:
    for got in pool_for(backend, 2).run(sparse_sums, backend, timeout=120):
        coalesced, flat = got["flat"]
        assert coalesced and flat == [0.0, 1.0, 0.0, 0.0, 12.0, 0.0, 0.0, 4.0, 0.0, 0.0], got
        assert got["hybrid"] == [[0, 1, 2], [0, 0, 0], [0, 0, 0], [3, 4, 5], [0, 0, 0]], got
        assert got["empty"] == (0, 0.0), got
        assert got["torch"] == [1.0, 2.0, 0.0], got
        kind, message = got["max"]
        assert kind == "NotSupportedError" and "ReduceOp.SUM only" in message and "to_dense()" in message, got
        kind, message = got["shape"]
        assert kind == "ValueError" and "every rank must pass the same shape" in message, got
