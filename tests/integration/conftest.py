"""Shared by the launcher tests: ``pgrun_job.py`` (the script their ranks run, and the helpers
that check its output and its processes) loaded once as the module ``pgrun_job``. The suite
imports test files with ``--import-mode=importlib``, which puts no test folder on ``sys.path``,
and a plain ``import pgrun_job`` would not resolve without this."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from pg_core.testing.pool import RankPool
from pg_core.testing.rank import run_warm_up

if "pgrun_job" not in sys.modules:
    _spec = importlib.util.spec_from_file_location("pgrun_job", Path(__file__).with_name("pgrun_job.py"))
    assert _spec is not None and _spec.loader is not None
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["pgrun_job"] = _module
    _spec.loader.exec_module(_module)


@pytest.fixture(scope="session")
def pool_for(rank_pools: Callable[[int], RankPool]) -> Iterator[Callable[..., RankPool]]:
    """``pool_for(backend, size=2)``: a pool of ``size`` ranks for a cpu backend's test. pg-mpi's
    ranks must be one MPI job, so its pools are started by ``mpiexec`` with MPI initialised
    first (one per size, shared by the session); the others are the session's ``rank_pools``."""
    mpi: dict[int, RankPool] = {}

    def get(backend: str, size: int = 2) -> RankPool:
        if backend != "mpi":
            return rank_pools(size)
        if size not in mpi:
            mpi[size] = RankPool(size, launcher="mpiexec", prelude=(run_warm_up, ("mpi", ["cpu"], 30.0)))
        return mpi[size]

    yield get
    for pool in mpi.values():
        pool.close()
