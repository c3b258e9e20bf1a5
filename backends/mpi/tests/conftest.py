"""pg-mpi's tests: their rank pools, started by ``mpiexec`` (a pg-mpi group's ranks must be one
MPI job), one per world size for the module that asks, MPI initialised on every rank first."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from pg_core.testing.pool import RankPool
from pg_core.testing.rank import run_warm_up


@pytest.fixture(scope="module")
def pools() -> Iterator[Callable[[int], RankPool]]:
    """``pools(n)``: the module's launched pool of ``n`` ranks."""
    made: dict[int, RankPool] = {}

    def get(n: int) -> RankPool:
        if n not in made:
            made[n] = RankPool(n, launcher="mpiexec", prelude=(run_warm_up, ("mpi", ["cpu"], 30.0)))
        return made[n]

    yield get
    for pool in made.values():
        pool.close()
