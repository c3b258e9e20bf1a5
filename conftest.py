"""Fixtures shared by every test directory of the workspace."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from pg_core.testing.pool import RankPool


@pytest.fixture(scope="session")
def rank_pools() -> Iterator[Callable[[int], RankPool]]:
    """``rank_pools(n)``: a persistent pool of ``n`` rank processes, shared by the session."""
    pools: dict[int, RankPool] = {}

    def get(world_size: int) -> RankPool:
        if world_size not in pools:
            pools[world_size] = RankPool(world_size)
        return pools[world_size]

    yield get
    for pool in pools.values():
        pool.close()
