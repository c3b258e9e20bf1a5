"""Certify every in-repo backend with the shipped conformance suite, exactly as a
third party would: ``pg-core conformance NAME --profile ci`` in a fresh process.

Every in-repo backend is required: one whose distribution is not installed, or that
cannot run here, fails its certification with the reason (the root conftest's
``requires_backend`` marker), never skips. The one exception is hardware: pg-nccl needs a
GPU, so where ``is_available()`` says there is none (or no CUDA/NCCL in torch) its
certification skips with that reason; it is still installed and listed either way. Its known gaps, if any, are listed in
``xfail/<name>.txt`` (strict: a gap that closes fails the run until the line goes).
pg-mpi's spec declares ``launcher="mpiexec"``: the suite starts its ranks through ``mpiexec``
(the ``mpich`` wheel's, installed by ``make test``) and asks its availability there.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent

#: backend name -> the in-repo distribution that provides it
IN_REPO = {
    "tcp": "pg-tcp",
    "gloo": "pg-gloo",
    "mpi": "pg-mpi",  # started through mpiexec (its spec declares launcher="mpiexec")
    "shm": "pg-shm",  # the ranks of one host over shared memory
    "storecomm": "pg-storecomm",  # examples/third_party_plugin: written from the README alone
}


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.requires_backend(n)) for n in sorted(IN_REPO)])
def test_certified(name: str) -> None:
    _certify(name, [])


def test_nccl_certified_on_the_gpus_of_this_machine() -> None:
    """World sizes 1 .. the visible GPUs (one rank per GPU); skipped, saying why, without one."""
    from pg_nccl.plugin import is_available  # installed by make test on every machine

    reason = is_available()
    if reason is not None:
        pytest.skip(f"pg-nccl cannot run here: {reason}")
    import torch

    sizes = ",".join(str(n) for n in range(1, min(torch.cuda.device_count(), 4) + 1))
    _certify("nccl", ["--world-sizes", sizes, "--device", "cuda"])


def _certify(name: str, extra: list[str]) -> None:
    cmd = [sys.executable, "-m", "pg_core", "conformance", name, "--profile", "ci", *extra]
    xfail = HERE / "xfail" / f"{name}.txt"
    if xfail.exists():
        cmd += ["--xfail", str(xfail)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1100, check=False)
    output = proc.stdout + proc.stderr
    print(output[-8000:])  # the summary table: examples per test and per op, and the time taken
    assert proc.returncode == 0, f"`{' '.join(cmd[2:])}` exited {proc.returncode}:\n{output[-20000:]}"
