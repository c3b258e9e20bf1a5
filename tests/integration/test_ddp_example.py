"""examples/ddp_train.py runs as its docstring says, on every in-repo CPU backend under its
launcher: pg-gloo under ``pgrun``, pg-tcp as started without a launcher (the example starts
its ranks under ``pgrun`` itself), pg-mpi under ``pgrun --mpi`` (its ranks started through
``mpiexec``, one Python process each). Exit status 0, every rank's parameters equal to
single-process training, and the summary line rank 0 prints once every rank has checked."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ddp_train.py"
RANKS, STEPS = 2, 5


def _run(command: list[str], env: dict[str, str]) -> str:
    try:
        proc = subprocess.run(
            command,
            check=False,
            capture_output=True,
            text=True,
            timeout=150,
            env={**os.environ, "OMP_NUM_THREADS": "1", **env},
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{command} did not finish within 150 s; its output:\n{exc.stdout!r}\n{exc.stderr!r}")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    return proc.stdout


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "backend",
    [
        pytest.param("gloo", marks=pytest.mark.requires_backend("gloo")),
        pytest.param("tcp", marks=pytest.mark.requires_backend("tcp")),
        pytest.param("mpi", marks=pytest.mark.requires_backend("mpi")),
    ],
)
def test_ddp_example_runs_under_its_launcher(backend: str) -> None:
    example = [sys.executable, str(EXAMPLE), "--backend", backend, "--steps", str(STEPS)]
    pgrun = [sys.executable, "-m", "pg_core.launch", "-n", str(RANKS), "--timeout", "120"]
    if backend == "gloo":
        out = _run([*pgrun, *example[1:]], {})
    elif backend == "tcp":
        out = _run([*example, "--world-size", str(RANKS)], {})
    else:  # as the user ran it: pgrun --mpi starts the ranks through mpiexec
        out = _run([*pgrun, "--mpi", *example[1:]], {})
    assert f"ddp_train: {RANKS} ranks trained with DDP over pg-core backend '{backend}'" in out, out
    for rank in range(RANKS):
        assert f"rank {rank}: loss on my shard" in out, out
