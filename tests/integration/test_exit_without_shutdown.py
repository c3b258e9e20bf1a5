"""A rank that ends without ``shutdown()`` (torch users rarely call ``destroy_process_group``)
still exits, promptly and with status 0, on every CPU backend: its groups are let go while the
interpreter finalizes, when no new thread can start. Seen on pg-gloo: a world group and a
subgroup left open made the process hang at exit forever."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent(
    """
    import sys
    from pg_core import ProcessGroup

    world = ProcessGroup.from_env(backends=sys.argv[1], timeout=30)
    pair = world.new_group([0, 1])
    world.barrier()
    pair.barrier()
    print(f"rank {world.rank}: leaving without shutdown", flush=True)
    """
)


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    "backend",
    [
        pytest.param("gloo", marks=pytest.mark.requires_backend("gloo")),
        pytest.param("tcp", marks=pytest.mark.requires_backend("tcp")),
        pytest.param("mpi", marks=pytest.mark.requires_backend("mpi")),
    ],
)
def test_a_rank_that_never_shuts_its_groups_down_still_exits(backend: str, tmp_path: Path) -> None:
    script = tmp_path / "leave.py"
    script.write_text(SCRIPT)
    pgrun = [sys.executable, "-m", "pg_core.launch", "-n", "2", "--timeout", "100"]
    if backend == "mpi":
        pgrun.append("--mpi")
    try:
        proc = subprocess.run(
            [*pgrun, str(script), backend],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the ranks did not exit within 120 s; their output:\n{exc.stdout!r}\n{exc.stderr!r}")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    for rank in (0, 1):
        assert f"rank {rank}: leaving without shutdown" in output, output
