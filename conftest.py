"""Fixtures and markers shared by every test directory of the workspace.

``@pytest.mark.requires_backend("tcp")`` (or ``pytestmark = ...`` on a module) marks a
test that needs an in-repo backend. The in-repo backends are part of what ``make test``
tests, so a missing, disabled or broken one *fails* the test, naming the backend and the
reason; it never skips. (``pg_core.testing.unavailable`` is the skip reason for the suite
third parties run against their own plugin; the workspace's own tests do not use it.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import pytest
from pg_core.testing.pool import RankPool

#: backend name -> the in-repo distribution that provides it (and the folder it lives in)
IN_REPO_BACKENDS = {
    "tcp": ("pg-tcp", "backends/tcp_reference"),
    "gloo": ("pg-gloo", "backends/gloo"),
    "mpi": ("pg-mpi", "backends/mpi"),
    "shm": ("pg-shm", "backends/shm"),
    "storecomm": ("pg-storecomm", "examples/third_party_plugin"),
}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "requires_backend(name): the test needs the in-repo backend NAME; a missing or broken one fails it",
    )


def in_repo_backend_problem(name: str) -> str | None:
    """``None`` if the in-repo backend ``name`` is installed and can run here (a backend whose
    spec declares a launcher: in a process started through it, as its ranks are), else the
    failure message: ``in-repo backend 'tcp' is required by make test but is <why>``."""
    from pg_core.registry import default_registry

    if name not in IN_REPO_BACKENDS:
        return f"{name!r} is not an in-repo backend (the in-repo ones are {sorted(IN_REPO_BACKENDS)})"
    distribution, folder = IN_REPO_BACKENDS[name]
    prefix = f"in-repo backend {name!r} is required by make test but is"
    found = [entry for entry in default_registry().entries() if entry.name == name]
    if any(e.status == "available" and e.distribution == distribution for e in found):
        return None
    for e in found:  # a backend started through a launcher runs where that launcher starts it, not here
        if e.status == "unavailable" and e.distribution == distribution and e.spec is not None and e.spec.launcher:
            why = _launched_problem(f"{name}@{distribution}", e.spec.launcher)
            if why is None:
                return None
            return f"{prefix} unavailable (from {distribution}) {why}"
    if not found:
        return f"{prefix} not installed: no distribution provides it (pip install -e {folder}, which is {distribution})"
    why = [
        f"{'in conflict' if e.status == 'conflict' else e.status} (from {e.distribution or 'an unknown distribution'}): "
        f"{e.reason}"
        if e.status != "available"
        else f"provided by {e.distribution or 'an unknown distribution'} instead of {distribution}"
        for e in found
    ]
    return f"{prefix} {'; and '.join(why)}"


@functools.cache
def _launched_problem(ref: str, launcher: str) -> str | None:
    """``why_unavailable_launched``, asked once per session (it starts a process through the launcher)."""
    from pg_core.launchers import why_unavailable_launched

    return why_unavailable_launched(ref, launcher)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Fail, before any fixture is set up, a test whose in-repo backend cannot run."""
    for marker in item.iter_markers("requires_backend"):
        for name in marker.args:
            problem = in_repo_backend_problem(name)
            if problem is not None:
                pytest.fail(problem, pytrace=False)


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
