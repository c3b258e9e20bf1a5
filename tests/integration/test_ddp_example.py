"""examples/ddp_train.py runs as its docstring says, on pg-gloo and on pg-tcp: exit status 0,
every rank's parameters equal to single-process training."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ddp_train.py"


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "backend",
    [
        pytest.param("gloo", marks=pytest.mark.requires_backend("gloo")),
        pytest.param("tcp", marks=pytest.mark.requires_backend("tcp")),
    ],
)
def test_ddp_example_runs(backend: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--world-size", "3", "--backend", backend],
        check=False,
        capture_output=True,
        text=True,
        timeout=150,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert f"3 ranks trained with DDP over pg-core backend '{backend}'" in proc.stdout, output
    for rank in range(3):
        assert f"rank {rank}: loss on my shard" in proc.stdout, output
