"""``ProcessGroup.from_env()`` under real launchers: examples/from_env_demo.py prints the same
lines under pgrun and under torchrun (and both are what the collectives must give); and in
this process, groups formed from a launcher's variables on a store the test hosts."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pg_core import PrefixStore, ProcessGroup, TCPStore
from pgrun_job import EXAMPLE, JOB, assert_gone, demo_lines, expected_demo, job_pids  # (tests/integration/conftest.py)


def launch(argv: list[str], timeout: float = 180.0) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, check=False
        )
    except subprocess.TimeoutExpired as exc:  # run() has killed the launcher; its ranks die with it
        pytest.fail(f"{argv} did not finish within {timeout:g} s: {exc.stdout!r} {exc.stderr!r}")


@pytest.mark.timeout(420)
def test_the_demo_prints_the_same_under_pgrun_and_torchrun(tmp_path: Path) -> None:
    (tmp_path / "pgrun").mkdir()
    (tmp_path / "torchrun").mkdir()
    pgrun = launch(
        [
            str(Path(sys.executable).with_name("pgrun")),
            "-n",
            "3",
            str(JOB),
            "--pids",
            str(tmp_path / "pgrun"),
            "example",
        ]
    )
    assert pgrun.returncode == 0, pgrun.stdout + pgrun.stderr
    assert_gone(job_pids(tmp_path / "pgrun", 3))
    torchrun = launch(
        [
            *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3"),
            *(str(JOB), "--pids", str(tmp_path / "torchrun"), "example"),
        ]
    )
    assert torchrun.returncode == 0, torchrun.stdout + torchrun.stderr
    assert_gone(job_pids(tmp_path / "torchrun", 3))
    assert demo_lines(pgrun.stdout, prefixed=True) == expected_demo(3), pgrun.stdout + pgrun.stderr
    assert demo_lines(torchrun.stdout, prefixed=False) == expected_demo(3), torchrun.stdout + torchrun.stderr


@pytest.mark.requires_backend("tcp")
@pytest.mark.timeout(120)
def test_pgruns_variables_form_a_group_on_its_store_with_its_backends() -> None:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {"PG_RANK": "0", "PG_WORLD_SIZE": "1", "PG_STORE": f"127.0.0.1:{store.port}", "PG_BACKENDS": "tcp"}
    with ProcessGroup.from_env(env=env, timeout=60) as group:
        assert (group.rank, group.size, group.backends) == (0, 1, {"cpu": "tcp"})
        t = torch.ones(3)
        group.all_reduce(t)
        assert t.tolist() == [1.0, 1.0, 1.0]
    assert store.check(["pg-core/world/generation"])


@pytest.mark.requires_backend("gloo")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["argument", "PG_BACKENDS"])
def test_the_cards_backends_from_a_launcher_form_a_group_on_a_machine_without_a_gpu(where: str) -> None:
    from pg_nccl.plugin import is_available

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {"PG_RANK": "0", "PG_WORLD_SIZE": "1", "PG_STORE": f"127.0.0.1:{store.port}"}
    backends = {"cuda": "nccl", "cpu": "gloo"}
    if where == "PG_BACKENDS":
        env["PG_BACKENDS"] = "cpu:gloo,cuda:nccl"
    with ProcessGroup.from_env(backends if where == "argument" else None, env=env, timeout=60) as group:
        assert group.backends == backends
        assert group.supports("all_reduce", "cuda") == (is_available() is None)
        group.all_reduce(t := torch.ones(3))
        assert t.tolist() == [1.0, 1.0, 1.0]


@pytest.mark.requires_backend("tcp")
@pytest.mark.timeout(120)
def test_under_torchruns_agent_the_group_keeps_to_the_attempts_prefix_of_the_agents_store() -> None:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the agent's
    env = {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": "3",
    }
    with ProcessGroup.from_env("tcp", name="trainers", env=env, timeout=60) as group:
        assert (group.rank, group.size, group.name) == (0, 1, "trainers")
    assert PrefixStore("/worker/attempt_3", store).check(["pg-core/trainers/generation"])
    assert not store.check(["pg-core/trainers/generation"])


def demo_env(**launcher: str) -> dict[str, str]:
    """This process's environment without any launcher's variables, plus ``launcher``. Open
    MPI's permission to run as root is the user's setting, not a launcher's variable: without
    it Open MPI's ``mpiexec`` refuses to start as root."""
    inherited = ("PG_", "SLURM_", "OMPI_", "PMI_", "PMIX_", "TORCHELASTIC_")
    settings = ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM")
    keep = {k: v for k, v in os.environ.items() if k in settings or not k.startswith(inherited)}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "MPI_LOCALRANKID"):
        keep.pop(var, None)
    return {**keep, "OMP_NUM_THREADS": "1", **launcher}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.requires_backend("tcp")
@pytest.mark.timeout(300)
def test_under_slurms_variables_rank_0_hosts_the_store_on_the_first_node_of_the_step() -> None:
    port = str(free_port())
    ranks = [
        subprocess.Popen(
            [sys.executable, str(EXAMPLE), "--backends", "tcp"],
            env=demo_env(
                SLURM_PROCID=str(r),
                SLURM_NTASKS="2",
                SLURM_LOCALID=str(r),
                SLURM_STEP_NODELIST="localhost,nowhere[1-4]",
                SLURM_JOB_ID="4242",
                MASTER_PORT=port,
            ),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (1, 0)  # rank 1 first: it waits for rank 0's store
    ]
    outputs = []
    try:
        for proc in ranks:
            outputs.append(proc.communicate(timeout=180)[0])
    finally:
        for proc in ranks:
            proc.kill()
            proc.wait(10)
    assert [proc.returncode for proc in ranks] == [0, 0], outputs
    assert demo_lines("".join(outputs), prefixed=False) == expected_demo(2), outputs


@pytest.mark.requires_backend("tcp", "mpi")  # (pg-mpi brings mpiexec: the mpich wheel)
@pytest.mark.timeout(300)
def test_under_mpiexec_the_ranks_come_from_the_mpi_launcher_and_the_store_from_master_addr() -> None:
    from pg_core.launchers import launch_command

    command = launch_command("mpiexec", 2, [sys.executable, str(EXAMPLE), "--backends", "tcp"])
    result = subprocess.run(
        command,
        env=demo_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())),
        capture_output=True,
        text=True,
        timeout=240,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert demo_lines(result.stdout, prefixed=False) == expected_demo(2), result.stdout + result.stderr
