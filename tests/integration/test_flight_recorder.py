"""The flight recorder across real processes, on every in-repo cpu backend (pg-mpi's ranks
started by ``mpiexec``): rank 1 of 3 skips a collective and waits in a ``recv`` instead; the
ranks waiting in the collective time out with a message that says who is where, each rank
writes its dump to ``PG_CORE_TRACE_DIR``, ``pg-core trace`` finds the divergence in them, and
``debug_state()`` shows the recorded operations."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from pg_core import ProcessGroup
from pg_core.errors import CollectiveTimeout
from pg_core.testing.pool import RankContext, RankPool

Pools = Callable[[int], RankPool]
PoolFor = Callable[..., RankPool]  # the pool_for fixture (tests/integration/conftest.py)

BACKENDS = [
    pytest.param("tcp", marks=pytest.mark.requires_backend("tcp")),
    pytest.param("gloo", marks=pytest.mark.requires_backend("gloo")),
    pytest.param("mpi", marks=pytest.mark.requires_backend("mpi")),
]

#: each operation's timeout: short, the suite's wall time matters
TIMEOUT = 2.0


def skipping(ctx: RankContext, backend: str, folder: str) -> dict[str, Any]:
    """Every rank runs all_reduce #1 and #2; then ranks 0 and 2 call all_reduce #3 while rank 1
    skips it and waits in a recv from rank 0 that never comes. What each raised, its debug state."""
    r = ctx.rank
    os.environ["PG_CORE_TRACE_DIR"] = folder  # read as the group forms
    try:
        g = ProcessGroup(ctx.store, r, ctx.size, backends=backend, name="fr", timeout=TIMEOUT)
    finally:
        del os.environ["PG_CORE_TRACE_DIR"]
    out: dict[str, Any] = {}
    try:
        g.all_reduce(torch.ones(1))
        g.all_reduce(torch.ones(2))
        try:
            if r == 1:
                g.recv(torch.empty(1), src=0)
            else:
                g.all_reduce(torch.ones(3))
        except CollectiveTimeout as exc:
            out["error"] = str(exc)
        out["state"] = json.loads(json.dumps(g.debug_state()))  # JSON-serialisable as it is
        # nobody leaves before every rank has failed and dumped (a rank gone early is a peer failure)
        ctx.store.set(f"done/{r}", "1")
        ctx.store.wait([f"done/{i}" for i in range(ctx.size)], timedelta(seconds=60))
        return out
    finally:
        g.abort()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_skipped_collective_is_reported_by_who_is_where_dumped_and_merged(
    pool_for: PoolFor, backend: str, tmp_path: Path
) -> None:
    pool = pool_for(backend, 3)
    results = pool.run(skipping, backend, str(tmp_path), timeout=120)
    where = (
        "ranks 0, 2 are in all_reduce #3; rank 1 never started #3 (last completed all_reduce #2; in recv from rank 0)"
    )
    for rank in (0, 2):
        message = results[rank]["error"]
        assert "all_reduce" in message and f"Who is where in group 'fr' at collective #3: {where}" in message, message
    assert "recv" in results[1]["error"]

    state = results[0]["state"]
    assert (state["group"], state["rank"], state["size"], state["state"]) == ("fr", 0, 3, "failed")
    assert state["backends"] == {"cpu": backend}
    assert [(e["seq"], e["op"], e["state"]) for e in state["entries"]] == [
        (1, "all_reduce", "completed"),
        (2, "all_reduce", "completed"),
        (3, "all_reduce", "failed"),
    ]
    assert state["entries"][2]["error"] == "CollectiveTimeout" and state["entries"][2]["input_sizes"] == [[3]]
    assert state["report"]["text"] == where
    recv = results[1]["state"]["entries"][-1]
    assert (recv["op"], recv["peer"], recv["p2p_seq"], recv["state"]) == ("recv", 0, 1, "failed")

    dumps = sorted(p.name for p in tmp_path.iterdir())
    uid = state["uid"].rsplit("-", 1)[-1][:8]
    assert dumps == [f"fr-{uid}-rank{r}" for r in range(3)]
    run = subprocess.run(
        [sys.executable, "-m", "pg_core", "trace", str(tmp_path), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    (group,) = json.loads(run.stdout)["groups"]
    assert group["dumped"] == [0, 1, 2] and group["not_heard"] == []
    assert group["divergence"]["seq"] == 3
    assert group["divergence"]["ranks"] == {
        "0": "all_reduce #3 float32[3] (failed: CollectiveTimeout)",
        "1": None,
        "2": "all_reduce #3 float32[3] (failed: CollectiveTimeout)",
    }
    assert group["where"] == where
