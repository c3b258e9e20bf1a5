"""pgrun, the launcher (``pg_core.launch``), across real processes: what the ranks print and
how, what a failing rank does to the job, signals to pgrun, ``--timeout``, ``--mpi``,
several nodes, and that no process of a job outlives it (each rank writes its pid under
``tmp_path``; every test checks those processes are gone, pgrun killed with SIGKILL included).

The ranks run tests/integration/pgrun_job.py. Every wait is bounded; ranks are started by
the process under test, and stopping them is what is tested.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pgrun_job import JOB, assert_gone, demo_lines, expected_demo, job_pids  # (tests/integration/conftest.py)

PGRUN = Path(sys.executable).with_name("pgrun")
PG_CORE = Path(sys.executable).with_name("pg-core")


class Job:
    """A pgrun (or any launcher) process with its stdout and stderr read as they come.
    Every job a test started is killed when the test ends (:func:`no_job_left`)."""

    started_by_test: list[Job] = []

    def __init__(self, argv: list[str], *, env: dict[str, str] | None = None, cwd: Path | None = None) -> None:
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
            cwd=cwd,
        )
        Job.started_by_test.append(self)
        self.out: list[str] = []
        self.err: list[str] = []
        self.lines: queue.Queue[str] = queue.Queue()
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.readers = [
            threading.Thread(target=self._read, args=(self.proc.stdout, self.out, self.lines), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, self.err, None), daemon=True),
        ]
        for reader in self.readers:
            reader.start()

    @staticmethod
    def _read(pipe: object, into: list[str], lines: queue.Queue[str] | None) -> None:
        for line in pipe:  # type: ignore[attr-defined]
            into.append(line)
            if lines is not None:
                lines.put(line)

    def wait_for_lines(self, count: int, containing: str, timeout: float = 120.0) -> None:
        """Wait until ``count`` stdout lines contain ``containing``."""
        deadline = time.monotonic() + timeout
        seen = 0
        while seen < count:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.kill()
                pytest.fail(f"saw {seen} of {count} lines with {containing!r} within {timeout:g} s:\n{self.output}")
            seen += containing in line

    def finish(self, timeout: float = 120.0) -> int:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"{self.proc.args} did not exit within {timeout:g} s:\n{self.output}")
        for reader in self.readers:
            reader.join(10.0)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # its ranks die with it
        self.proc.wait(10.0)

    @property
    def stdout(self) -> str:
        return "".join(self.out)

    @property
    def stderr(self) -> str:
        return "".join(self.err)

    @property
    def output(self) -> str:
        return f"--- stdout\n{self.stdout}--- stderr\n{self.stderr}"


@pytest.fixture(autouse=True)
def no_job_left() -> Iterator[None]:
    """Kill whatever job a test started and left running (a test that failed half-way)."""
    yield
    for job in Job.started_by_test:
        job.kill()
    Job.started_by_test.clear()


def pgrun(*args: str | Path) -> list[str]:
    assert PGRUN.exists(), f"the pgrun console script is not installed next to {sys.executable}"
    return [str(PGRUN), *map(str, args)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(240)
def test_every_rank_gets_its_prefix_on_stdout_and_stderr_and_no_prefix_turns_it_off(tmp_path: Path) -> None:
    job = Job(pgrun("-n", "3", JOB, "--pids", tmp_path, "print"))
    assert job.finish() == 0, job.output
    assert sorted(job.stdout.splitlines()) == [f"[rank {r}] out {r}" for r in range(3)], job.output
    assert sorted(job.stderr.splitlines()) == [f"[rank {r}] err {r}" for r in range(3)], job.output
    assert_gone(job_pids(tmp_path, 3))

    bare = tmp_path / "bare"
    bare.mkdir()
    job = Job([str(PG_CORE), "run", "-n", "2", "--no-prefix", str(JOB), "--pids", str(bare), "print"])
    assert job.finish() == 0, job.output
    assert sorted(job.stdout.splitlines()) == ["out 0", "out 1"], job.output
    assert sorted(job.stderr.splitlines()) == ["err 0", "err 1"], job.output
    assert_gone(job_pids(bare, 2))


@pytest.mark.timeout(240)
def test_every_rank_gets_pgruns_and_torchruns_variables_and_none_of_an_outer_launchers(tmp_path: Path) -> None:
    outer = {"PG_RANK": "9", "RANK": "9", "TORCHELASTIC_RUN_ID": "outer", "OMP_NUM_THREADS": "3"}
    job = Job(pgrun("-n", "2", "--backends", "tcp", JOB, "--pids", tmp_path, "env"), env=outer)
    assert job.finish() == 0, job.output
    given = {}
    for line in job.stdout.splitlines():
        prefix, _, rest = line.partition("] env ")
        rank, *pairs = rest.split()
        assert prefix == f"[rank {rank}", line
        given[int(rank)] = dict(pair.split("=", 1) for pair in pairs)
    assert sorted(given) == [0, 1], job.output
    port = given[0]["MASTER_PORT"]
    for rank, env in given.items():
        assert env == {
            **{"PG_RANK": str(rank), "PG_WORLD_SIZE": "2", "PG_LOCAL_RANK": str(rank), "PG_BACKENDS": "tcp"},
            **{"PG_STORE": f"127.0.0.1:{port}", "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank)},
            **{"LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port},
            "OMP_NUM_THREADS": "3",  # the user's, kept
        }, job.output
    assert_gone(job_pids(tmp_path, 2))


@pytest.mark.timeout(240)
def test_a_module_runs_with_m_as_under_python_m(tmp_path: Path) -> None:
    job = Job(pgrun("-n", "2", "-m", JOB.stem, "--pids", tmp_path, "print"), cwd=JOB.parent)
    assert job.finish() == 0, job.output
    assert sorted(job.stdout.splitlines()) == ["[rank 0] out 0", "[rank 1] out 1"], job.output
    assert_gone(job_pids(tmp_path, 2))


@pytest.mark.requires_backend("tcp")
@pytest.mark.timeout(240)
def test_a_rank_that_raises_stops_the_job_within_seconds_with_its_traceback_last(tmp_path: Path) -> None:
    job = Job(pgrun("-n", "3", "--backends", "tcp", JOB, "--pids", tmp_path, "raise", "1"))
    job.wait_for_lines(3, "ready")
    ready = time.monotonic()
    code = job.finish()
    took = time.monotonic() - ready
    assert code == 1, job.output
    assert took < 30, f"pgrun took {took:.1f} s after the ranks were ready (the others wait 120 s)\n{job.output}"
    lines = job.stderr.rstrip().splitlines()
    header = max(i for i, line in enumerate(lines) if line.startswith("pgrun: rank 1 failed with exit code 1"))
    last = lines[header + 1 :]
    assert last[0] == "[rank 1] Traceback (most recent call last):", job.output
    assert last[-1] == "[rank 1] ValueError: rank 1 fails on purpose", job.output
    assert all(line.startswith("[rank 1] ") for line in last), job.output
    assert_gone(job_pids(tmp_path, 3))


@pytest.mark.requires_backend("tcp")
@pytest.mark.timeout(240)
def test_pgrun_exits_with_the_failing_ranks_exit_code(tmp_path: Path) -> None:
    job = Job(pgrun("-n", "2", "--backends", "tcp", "--no-prefix", JOB, "--pids", tmp_path, "exit", "0", "7"))
    assert job.finish() == 7, job.output
    assert job.stderr.rstrip().splitlines()[-1] == "pgrun: rank 0 failed with exit code 7; it wrote nothing to stderr"
    assert_gone(job_pids(tmp_path, 2))


@pytest.mark.timeout(240)
def test_ranks_die_when_pgrun_is_killed_with_sigkill(tmp_path: Path) -> None:
    job = Job(pgrun("-n", "2", JOB, "--pids", tmp_path, "hang"))
    job.wait_for_lines(2, "ready")
    pids = job_pids(tmp_path, 2)
    job.proc.send_signal(signal.SIGKILL)
    job.finish()
    assert_gone(pids)


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
@pytest.mark.timeout(240)
def test_sigint_or_sigterm_to_pgrun_stops_every_rank(tmp_path: Path, sig: signal.Signals, code: int) -> None:
    job = Job(pgrun("-n", "2", JOB, "--pids", tmp_path, "hang"))
    job.wait_for_lines(2, "ready")
    job.proc.send_signal(sig)
    assert job.finish(timeout=60) == code, job.output
    assert f"pgrun: got {sig.name}: stopping every rank" in job.stderr, job.output
    assert_gone(job_pids(tmp_path, 2))


@pytest.mark.timeout(240)
def test_the_job_is_stopped_at_its_timeout(tmp_path: Path) -> None:
    job = Job(pgrun("-n", "2", "--timeout", "10", "--grace", "1", JOB, "--pids", tmp_path, "hang"))
    assert job.finish() == 124, job.output
    assert "pgrun: the job ran past --timeout 10 s: stopping every rank" in job.stderr, job.output
    assert sorted(job.stdout.splitlines()) == ["[rank 0] ready 0", "[rank 1] ready 1"], job.output
    assert_gone(job_pids(tmp_path, 2))


#: pgrun (or ``pg-core run``) in a process that then says which torch modules it imported
TORCH_IN_LAUNCHER = (
    "import sys\n"
    "from pg_core.{module} import main\n"
    "code = main(sys.argv[1:])\n"
    "print('the launcher imported torch:', 'torch' in sys.modules, file=sys.stderr)\n"
    "sys.exit(code)\n"
)


@pytest.mark.requires_backend("tcp")
@pytest.mark.parametrize(("module", "command"), [("launch", []), ("cli", ["run"])])
@pytest.mark.timeout(240)
def test_pgrun_starts_the_ranks_without_importing_torch(tmp_path: Path, module: str, command: list[str]) -> None:
    argv = [sys.executable, "-c", TORCH_IN_LAUNCHER.format(module=module), *command, "-n", "2", "--backends", "tcp"]
    job = Job([*argv, str(JOB), "--pids", str(tmp_path), "example"])
    assert job.finish() == 0, job.output
    assert demo_lines(job.stdout, prefixed=True) == expected_demo(2), job.output  # the store served the group
    assert "the launcher imported torch: False" in job.stderr.splitlines(), job.output
    assert_gone(job_pids(tmp_path, 2))


def _store_process(pgrun_pid: int) -> int:
    """The pid of the process that hosts pgrun ``pgrun_pid``'s store."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().split(b"\0")
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if parent == pgrun_pid and b"--_store-host" in cmdline:
                return int(entry.name)
    raise AssertionError(f"pgrun {pgrun_pid} has no store process")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the store's process through /proc (Linux)")
@pytest.mark.timeout(240)
def test_a_store_process_that_dies_fails_the_job_and_one_of_a_killed_pgrun_dies_with_it(tmp_path: Path) -> None:
    job = Job(pgrun("-n", "2", JOB, "--pids", tmp_path, "hang"))
    job.wait_for_lines(2, "ready")
    os.kill(_store_process(job.proc.pid), signal.SIGKILL)
    assert job.finish(timeout=60) == 137, job.output
    assert "pgrun: the store's process was killed by signal 9 (SIGKILL) while ranks were running" in job.stderr
    assert_gone(job_pids(tmp_path, 2))

    killed = tmp_path / "killed"
    killed.mkdir()
    job = Job(pgrun("-n", "2", JOB, "--pids", killed, "hang"))
    job.wait_for_lines(2, "ready")
    store = _store_process(job.proc.pid)
    job.proc.send_signal(signal.SIGKILL)
    job.finish()
    assert_gone([store, *job_pids(killed, 2)])


def test_a_command_line_pgrun_cannot_run_is_refused_before_starting_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from pg_core.launch import main

    cases = [
        (
            ["-n", "2", str(tmp_path / "missing.py")],
            f"{tmp_path / 'missing.py'}: no such file (to run a module, use -m)",
        ),
        (["-n", "0", "-m", "x"], "-n must be at least 1"),
        (["-n", "1", "--nnodes", "2", "-m", "x"], "needs --master HOST:PORT"),
        (
            ["-n", "1", "--nnodes", "2", "--node-rank", "2", "--master", "h:1", "-m", "x"],
            "--node-rank 2 is not in 0 .. 1",
        ),
        (["-n", "1", "--master", "nohost", "-m", "x"], "'nohost' is not HOST:PORT"),
        (["-n", "1", "--mpi", "--nnodes", "2", "--master", "h:1", "-m", "x"], "--mpi starts one node's ranks"),
        (["-n", "1", "--timeout", "0", "-m", "x"], "--timeout must be positive"),
        (["-n", "1", "--node-timeout", "0.5", "-m", "x"], "--node-timeout must be at least 1 (seconds), got 0.5"),
        (["-n", "1", "--node-timeout", "nan", "-m", "x"], "--node-timeout must be at least 1 (seconds), got nan"),
    ]
    for argv, says in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("pgrun: error: "), (argv, err)
        assert says in err, (argv, err)


@pytest.mark.requires_backend("tcp")
@pytest.mark.timeout(300)
def test_two_nodes_form_one_world_and_a_failure_on_one_stops_the_other(tmp_path: Path) -> None:
    master = f"127.0.0.1:{free_port()}"
    dirs = [tmp_path / "ok0", tmp_path / "ok1", tmp_path / "bad0", tmp_path / "bad1"]
    for d in dirs:
        d.mkdir()
    nodes = [
        Job(
            pgrun(
                "-n", "1", "--nnodes", "2", "--node-rank", str(i), "--master", master, JOB, "--pids", dirs[i], "example"
            )
        )
        for i in (0, 1)
    ]
    codes = [node.finish() for node in nodes]
    assert codes == [0, 0], "\n".join(node.output for node in nodes)
    assert demo_lines(nodes[0].stdout + nodes[1].stdout, prefixed=True) == expected_demo(2)
    assert "[rank 1] " in nodes[1].stdout
    assert_gone(job_pids(dirs[0], 1) + job_pids(dirs[1], 1))

    master = f"127.0.0.1:{free_port()}"
    nodes = [
        Job(
            pgrun(
                *("-n", "1", "--nnodes", "2", "--node-rank", str(i), "--master", master, "--backends", "tcp"),
                *(JOB, "--pids", dirs[2 + i], "raise", "1"),
            )
        )
        for i in (0, 1)
    ]
    codes = [node.finish() for node in nodes]
    assert codes == [1, 1], "\n".join(node.output for node in nodes)
    assert "pgrun: node 1: rank 1 failed with exit code 1: stopping this node's ranks" in nodes[0].stderr
    assert nodes[1].stderr.rstrip().splitlines()[-1] == "[rank 1] ValueError: rank 1 fails on purpose"
    assert_gone(job_pids(dirs[2], 1) + job_pids(dirs[3], 1))


@pytest.mark.timeout(240)
def test_node_0_gives_up_on_a_node_whose_pgrun_was_killed(tmp_path: Path) -> None:
    master = f"127.0.0.1:{free_port()}"
    (tmp_path / "n0").mkdir()
    (tmp_path / "n1").mkdir()
    both = ["-n", "1", "--nnodes", "2", "--master", master]
    node0 = Job(pgrun(*both, "--node-rank", "0", "--node-timeout", "4", JOB, "--pids", tmp_path / "n0", "print"))
    node1 = Job(pgrun(*both, "--node-rank", "1", JOB, "--pids", tmp_path / "n1", "hang"))
    node1.wait_for_lines(1, "ready 1")
    node0.wait_for_lines(1, "out 0")  # node 0's rank is done; its pgrun waits for node 1's
    node1.proc.send_signal(signal.SIGKILL)
    node1.finish()
    assert node0.finish(timeout=120) == 1, node0.output
    assert "pgrun: node 1's pgrun has not been heard from for 4 s and is not done: giving up on it" in node0.stderr
    assert_gone(job_pids(tmp_path / "n0", 1) + job_pids(tmp_path / "n1", 1))


@pytest.mark.requires_backend("mpi")  # (pg-mpi brings mpiexec: the mpich wheel)
@pytest.mark.timeout(300)
def test_mpi_starts_the_ranks_through_mpiexec_for_pg_mpi(tmp_path: Path) -> None:
    job = Job(pgrun("-n", "2", "--mpi", "--backends", "mpi", JOB, "--pids", tmp_path, "example"))
    assert job.finish(timeout=240) == 0, job.output
    assert demo_lines(job.stdout, prefixed=True) == expected_demo(2), job.output
    assert_gone(job_pids(tmp_path, 2))

    failing = tmp_path / "failing"
    failing.mkdir()
    job = Job(pgrun("-n", "2", "--mpi", "--backends", "mpi", JOB, "--pids", failing, "raise", "0"))
    assert job.finish(timeout=240) == 1, job.output
    assert job.stderr.rstrip().splitlines()[-1] == "[rank 0] ValueError: rank 0 fails on purpose", job.output
    assert "pgrun: rank 0 failed with exit code 1; the end of its stderr:" in job.stderr, job.output
    assert "BAD TERMINATION" not in job.output, job.output  # pgrun says it; not MPICH's banner in front of it
    assert_gone(job_pids(failing, 2))


@pytest.mark.requires_backend("mpi")
@pytest.mark.timeout(300)
def test_mpiexecs_own_word_on_a_failure_no_rank_reported_comes_after_pgruns(tmp_path: Path) -> None:
    # rank 1's wrapper is killed: no rank reports, mpiexec (MPICH's) prints its banner and stops the job
    job = Job(pgrun("-n", "2", "--mpi", JOB, "--pids", tmp_path, "kill-parent", "1"))
    assert job.finish(timeout=240) != 0, job.output
    lines = job.stderr.splitlines()
    said = next((i for i, line in enumerate(lines) if line.startswith("pgrun: mpiexec ")), None)
    assert said is not None, job.output
    if "BAD TERMINATION" in job.output:  # (Open MPI words it otherwise)
        assert "BAD TERMINATION" not in job.stdout and "BAD TERMINATION" in "\n".join(lines[said + 1 :]), job.output
    assert_gone(job_pids(tmp_path, 2))


@pytest.mark.requires_backend("mpi")
@pytest.mark.timeout(300)
def test_mpi_ranks_die_when_pgrun_is_killed_with_sigkill(tmp_path: Path) -> None:
    job = Job(pgrun("-n", "2", "--mpi", JOB, "--pids", tmp_path, "hang"))
    job.wait_for_lines(2, "ready", timeout=180)
    pids = job_pids(tmp_path, 2)
    job.proc.send_signal(signal.SIGKILL)
    job.finish()
    assert_gone(pids)
