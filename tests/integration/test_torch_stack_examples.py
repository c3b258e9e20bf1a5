"""The examples of torch's modern stack over pg-core groups run as their docstrings say, with no
``init_process_group``, over pg-tcp and pg-gloo: FSDP2 (examples/fsdp2_train.py) at 2 and 3
ranks, tensor parallelism (examples/dtensor_tp.py) on a 1-D mesh at 2 ranks, and
``torch.compile`` of functional collectives (examples/compile_collective.py) at 2 ranks; and
FSDP2 x tensor parallelism on a 2-D mesh at 4 ranks over pg-tcp. Every example checks its own
result on every rank (against one process computing the same thing) and that torch's default
group is not left initialised, and exits non-zero otherwise; this test asserts exit status 0,
each rank's line and the summary line rank 0 prints once every rank has checked.

The test starts the ranks under ``pgrun`` itself (one process fewer than the example starting
its own launcher), except for the FSDP2 run at 3 ranks over pg-tcp, which goes the way its
docstring's user starts it, so both routes stay tested; one thread per rank (OMP_NUM_THREADS=1)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
RUN_TIMEOUT_S = 150
BACKENDS = [
    pytest.param("tcp", marks=pytest.mark.requires_backend("tcp")),
    pytest.param("gloo", marks=pytest.mark.requires_backend("gloo")),
]


def _run(command: list[str]) -> str:
    try:
        proc = subprocess.run(
            command,
            check=False,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{command} did not finish within {RUN_TIMEOUT_S} s; its output:\n{exc.stdout!r}\n{exc.stderr!r}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def _pgrun(ranks: int, example: str, *args: str) -> str:
    pgrun = [sys.executable, "-m", "pg_core.launch", "-n", str(ranks), "--timeout", str(RUN_TIMEOUT_S - 30)]
    return _run([*pgrun, str(EXAMPLES / example), *args])


def _every_rank_checked(out: str, ranks: int, line: str) -> None:
    for rank in range(ranks):
        assert f"[rank {rank}] rank {rank}: {line}" in out, out


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("backend", BACKENDS)
def test_fsdp2_example_matches_single_process_training(backend: str, ranks: int) -> None:
    args = ["--backend", backend, "--steps", "5"]
    if (backend, ranks) == ("tcp", 3):  # as its docstring's user starts it: the example starts pgrun itself
        out = _run([sys.executable, str(EXAMPLES / "fsdp2_train.py"), *args, "--world-size", str(ranks)])
    else:
        out = _pgrun(ranks, "fsdp2_train.py", *args)
    _every_rank_checked(out, ranks, "loss on my shard")
    assert "gathered parameters equal single-process training" in out, out
    summary = f"fsdp2_train: {ranks} ranks trained 5 steps with FSDP2 over pg-core backend '{backend}'"
    assert summary in out, out


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
@pytest.mark.parametrize("backend", BACKENDS)
def test_tensor_parallel_example_matches_single_process_training(backend: str) -> None:
    out = _pgrun(2, "dtensor_tp.py", "--backend", backend, "--steps", "4")
    _every_rank_checked(out, 2, "loss")
    assert "gathered parameters equal single-process training" in out, out
    summary = (
        f"dtensor_tp: 2 ranks trained 4 steps on a 1-D mesh of 2 tensor-parallel ranks over pg-core backend '{backend}'"
    )
    assert summary in out, out


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
@pytest.mark.requires_backend("tcp")
def test_two_dimensional_mesh_example_matches_single_process_training() -> None:
    """FSDP2 on the data-parallel dimension and tensor parallelism on the other, at 4 ranks, over
    pg-tcp only (4 rank processes cost a 2-core machine as much as two 2-rank runs): what the
    2-D mesh adds over the 1-D runs above (two subgroups in one mesh, torch's default group for
    the block) is pg-core's and the same on every backend."""
    out = _pgrun(4, "dtensor_tp.py", "--backend", "tcp", "--steps", "4", "--dp", "2")
    _every_rank_checked(out, 4, "loss")
    summary = (
        "dtensor_tp: 4 ranks trained 4 steps on a 2-D mesh of 2 data-parallel x 2 tensor-parallel ranks "
        "(FSDP2 on dp, TP on tp) over pg-core backend 'tcp'"
    )
    assert summary in out, out


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_functional_collectives_example_matches_the_reference(backend: str) -> None:
    out = _pgrun(2, "compile_collective.py", "--backend", backend)
    _every_rank_checked(out, 2, "compiled all_reduce and all_gather, and the gradient through the all_gather, equal")
    summary = (
        "compile_collective: 2 ranks ran torch.compile(backend='aot_eager') functional collectives over pg-core "
        f"backend '{backend}'"
    )
    assert summary in out, out
