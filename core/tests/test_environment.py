"""``pg_core.environment``: what each launcher's environment says, parsed without connecting.

(Forming groups from a real launcher's environment: tests/integration/test_from_env.py.)"""

from __future__ import annotations

import pytest
from pg_core import ProcessGroup
from pg_core.environment import SLURM_PORT_RANGE, LaunchEnv, expand_hostlist, rank_and_size, read_launch, slurm_port


@pytest.mark.parametrize(
    ("hostlist", "hosts"),
    [
        ("node01", ["node01"]),
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("a[1-2]-ib,b3", ["a1-ib", "a2-ib", "b3"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[08-11]", ["n08", "n09", "n10", "n11"]),
        ("gpu[001-002]", ["gpu001", "gpu002"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("x,y[3],z", ["x", "y3", "z"]),
        ("c[1,3-4],d[09-10]-eth", ["c1", "c3", "c4", "d09-eth", "d10-eth"]),
    ],
)
def test_a_slurm_hostlist_expands_as_scontrol_show_hostnames_does(hostlist: str, hosts: list[str]) -> None:
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize(
    ("hostlist", "says"),
    [
        ("node[1-", "'\\[' without '\\]'"),
        ("node1]", "'\\]' without '\\['"),
        ("n[[1]]", "nested"),
        ("n[4-2]", "runs backwards"),
        ("n[a-b]", "not a number or a range"),
        ("", "names no host"),
    ],
)
def test_a_malformed_hostlist_is_an_error_that_shows_it(hostlist: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        expand_hostlist(hostlist)


def test_pgrun_variables_come_first_and_the_store_is_a_client_of_pgruns() -> None:
    env = {
        "PG_RANK": "2",
        "PG_WORLD_SIZE": "3",
        "PG_LOCAL_RANK": "2",
        "PG_STORE": "10.0.0.5:4242",
        "RANK": "0",  # pgrun sets torchrun's too; PG_* win
        "WORLD_SIZE": "3",
        "SLURM_PROCID": "7",
        "SLURM_NTASKS": "8",
        "PMI_RANK": "1",
        "PMI_SIZE": "2",
    }
    assert read_launch(env) == LaunchEnv(2, 3, 2, "10.0.0.5", 4242, "", False, "pgrun")


def test_torchrun_under_its_agent_uses_the_agents_store_with_a_prefix_per_attempt() -> None:
    env = {
        "RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "host-a",
        "MASTER_PORT": "29400",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": "2",
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "1",
    }
    assert read_launch(env) == LaunchEnv(1, 4, 1, "host-a", 29400, "/worker/attempt_2", False, "torchrun")


def test_torchs_env_variables_without_the_agent_make_rank_0_host_the_store() -> None:
    base = {
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1234",
        "TORCHELASTIC_USE_AGENT_STORE": "False",
    }
    zero, one = read_launch({**base, "RANK": "0"}), read_launch({**base, "RANK": "1"})
    assert (zero.host_store, one.host_store, zero.prefix, zero.local_rank) == (True, False, "", None)


def test_slurm_finds_the_first_node_of_the_step_and_derives_the_port_from_the_job() -> None:
    env = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_STEP_NODELIST": "gpu[07-08,10]",
        "SLURM_JOB_NODELIST": "gpu[01-10]",
        "SLURM_JOB_ID": "123456",
        "SLURM_STEP_ID": "3",
        "PMI_RANK": "5",
        "PMI_SIZE": "8",
    }
    launch = read_launch(env)
    assert launch == LaunchEnv(5, 8, 1, "gpu07", 20000 + 456 * 10 + 3, "", False, "slurm")
    assert launch.port in SLURM_PORT_RANGE
    assert read_launch({**env, "SLURM_PROCID": "0"}).host_store
    del env["SLURM_STEP_NODELIST"]
    assert read_launch(env).host == "gpu01"
    overridden = read_launch({**env, "MASTER_ADDR": "login", "MASTER_PORT": "3000"})
    assert (overridden.host, overridden.port) == ("login", 3000)


def test_under_slurm_the_first_task_on_the_first_node_hosts_the_store_whichever_rank_it_is() -> None:
    """With tasks not laid out in blocks, task 0 need not run on the step's first node, where
    every rank looks for the store: the first task there hosts it (srun sets SLURMD_NODENAME)."""
    env = {
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "4",
        "SLURM_STEP_NODELIST": "n[1-2]",
        "SLURM_JOB_ID": "7",
        "SLURMD_NODENAME": "n2",
        "SLURM_LOCALID": "0",
    }
    assert read_launch(env).host == "n1" and not read_launch(env).host_store  # task 0, on n2
    on_first = {**env, "SLURM_PROCID": "3", "SLURMD_NODENAME": "n1"}
    assert read_launch(on_first).host_store  # task 3, the first on n1
    assert not read_launch({**on_first, "SLURM_LOCALID": "1"}).host_store  # n1's second task
    assert read_launch({**env, "MASTER_ADDR": "n2"}).host_store  # an address given: rank 0 hosts, as env://
    assert not read_launch({**on_first, "MASTER_ADDR": "n1"}).host_store


def test_the_slurm_port_stays_in_its_range_for_any_job() -> None:
    ports = {
        slurm_port({"SLURM_JOB_ID": str(job), "SLURM_STEP_ID": str(step)})
        for job in range(0, 5000, 7)
        for step in range(12)
    }
    assert min(ports) >= SLURM_PORT_RANGE.start
    assert max(ports) < SLURM_PORT_RANGE.stop
    assert slurm_port({"SLURM_JOB_ID": "42"}) != slurm_port({"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "1"})


@pytest.mark.parametrize(
    ("env", "source", "rank", "size", "local"),
    [
        (
            {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1"},
            "openmpi",
            3,
            4,
            1,
        ),
        ({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1"}, "mpich", 1, 2, 1),
        ({"PMI_RANK": "0", "PMI_SIZE": "2"}, "mpich", 0, 2, None),
    ],
)
def test_mpi_ranks_with_the_store_from_master_addr_or_pg_store(
    env: dict[str, str], source: str, rank: int, size: int, local: int | None
) -> None:
    master = read_launch({**env, "MASTER_ADDR": "h", "MASTER_PORT": "5000"})
    assert master == LaunchEnv(rank, size, local, "h", 5000, "", rank == 0, source)
    pgrun = read_launch({**env, "PG_STORE": "127.0.0.1:6000", "PG_WORLD_SIZE": str(size), "MASTER_ADDR": "h"})
    assert (pgrun.source, pgrun.host, pgrun.port, pgrun.host_store) == (source, "127.0.0.1", 6000, False)


def test_nothing_found_names_every_variable_looked_for() -> None:
    with pytest.raises(ValueError) as info:
        read_launch({"PATH": "/bin", "MASTER_ADDR": "h"})
    message = str(info.value)
    for var in ("PG_RANK", "PG_WORLD_SIZE", "RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        assert var in message
    for var in ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "pgrun -n N"):
        assert var in message
    assert rank_and_size({}) is None


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, "MASTER_PORT not set"),
        ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR and MASTER_PORT not set"),
        ({"PG_RANK": "0", "PG_WORLD_SIZE": "2"}, "set PG_STORE"),
        ({"PG_RANK": "0"}, "PG_RANK is set .* but PG_WORLD_SIZE is not"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not a non-negative integer"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 is out of range for WORLD_SIZE=2"),
        ({"RANK": "0", "WORLD_SIZE": "1", "PG_STORE": "nohost"}, "PG_STORE='nohost' is not host:port"),
        ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "h", "MASTER_PORT": "70000"}, "not a port"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_ID": "1"}, "SLURM_STEP_NODELIST"),
        (
            {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_NODELIST": "n1"},
            "neither MASTER_PORT nor SLURM_JOB_ID",
        ),
        ({"PMI_RANK": "0", "PMI_SIZE": "1"}, "MPICH/PMI's PMI_RANK and PMI_SIZE are set, but not where the store is"),
    ],
)
def test_an_incomplete_environment_names_what_is_missing(env: dict[str, str], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        read_launch(env)


def test_pg_store_accepts_a_bracketed_ipv6_host() -> None:
    launch = read_launch({"PG_RANK": "0", "PG_WORLD_SIZE": "1", "PG_STORE": "[::1]:29500"})
    assert (launch.host, launch.port) == ("::1", 29500)


def test_from_env_fails_before_connecting_when_no_launcher_is_found() -> None:
    with pytest.raises(ValueError, match="no launcher found in the environment"):
        ProcessGroup.from_env(env={})
