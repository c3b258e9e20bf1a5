"""Torch's in-place gathers, as FSDP2 makes them: the input of ``all_gather_into_tensor`` is
this rank's own slot of the output, and ``all_gather``'s output list holds the input tensor
itself at this rank's index. Torch's backends take both; so must every CPU backend (pg-mpi
passed both buffers to MPI, which refuses aliased buffers: "Buffers must not be aliased")."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from pg_core import ProcessGroup
from pg_core.testing.pool import RankContext, RankPool

PoolFor = Callable[..., RankPool]  # the pool_for fixture (tests/integration/conftest.py)

BACKENDS = [
    pytest.param("tcp", marks=pytest.mark.requires_backend("tcp")),
    pytest.param("gloo", marks=pytest.mark.requires_backend("gloo")),
    pytest.param("mpi", marks=pytest.mark.requires_backend("mpi")),
]


def in_place_gathers(ctx: RankContext, backend: str) -> dict[str, Any]:
    group = ProcessGroup(ctx.store, ctx.rank, ctx.size, backends=backend, timeout=ctx.timeout)
    try:
        r, n, k = group.rank, group.size, 3
        out = torch.full((n * k,), -1.0)
        out[r * k : (r + 1) * k] = torch.arange(k, dtype=torch.float32) + 10 * r
        group.all_gather_into_tensor(out, out[r * k : (r + 1) * k])
        rows = torch.full((n, k), -1.0)
        rows[r] = 100.0 + r
        group.all_gather_into_tensor(rows, rows[r])  # a row of a 2-D output
        pieces = [torch.full((k,), -1.0) for _ in range(n)]
        pieces[r].fill_(1000.0 + r)
        group.all_gather(pieces, pieces[r])
        later = torch.full((n * k,), -1.0)
        later[r * k : (r + 1) * k] = 7.0 + r
        group.all_gather_into_tensor(later, later[r * k : (r + 1) * k], async_op=True).wait()
        return {
            "flat": out.tolist(),
            "rows": rows.tolist(),
            "list": [p.tolist() for p in pieces],
            "async": later.tolist(),
        }
    finally:
        group.shutdown()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_gather_whose_input_is_its_own_slot_of_the_output(backend: str, pool_for: PoolFor) -> None:
    n, k = 2, 3
    for got in pool_for(backend, n).run(in_place_gathers, backend, timeout=120):
        assert got["flat"] == [float(j + 10 * r) for r in range(n) for j in range(k)]
        assert got["rows"] == [[100.0 + r] * k for r in range(n)]
        assert got["list"] == [[1000.0 + r] * k for r in range(n)]
        assert got["async"] == [7.0 + r for r in range(n) for _ in range(k)]
