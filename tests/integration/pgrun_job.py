"""A rank of the jobs tests/integration/test_pgrun.py and test_from_env.py start: it writes
its pid into ``--pids DIR`` first thing, then does what MODE says.

- ``example``: run examples/from_env_demo.py (its ``from_env_demo:`` line);
- ``print``: write ``out R`` to stdout and ``err R`` to stderr (no group, no torch);
- ``env``: print ``env R`` and the launcher variables it was given, ``NAME=value`` (no torch);
- ``hang``: print ``ready R`` and wait (at most 120 s) until pgrun stops it (no group, no torch);
- ``raise R``: form the group, pass a barrier (so every rank has written its pid), print
  ``ready R``, then rank R raises while the others wait (at most 120 s) until pgrun stops them;
- ``exit R CODE``: like ``raise``, but rank R exits with status CODE;
- ``kill-parent R``: print ``ready R``; rank R, once every rank wrote its pid, kills its parent (under ``pgrun --mpi``,
  pgrun's wrapper, which mpiexec started) with SIGKILL and waits to die with it; the others
  wait (at most 120 s) until they are stopped (no group, no torch).

The tests load it as a module for :func:`expected_demo` and :func:`demo_lines`, and for the
checks that a job's processes are gone, :func:`job_pids` and :func:`assert_gone`.
"""

from __future__ import annotations

import argparse
import os
import runpy
import signal
import sys
import threading
from pathlib import Path

from pg_core.procs import wait_exited

LAUNCHER_VARS = (
    *("PG_RANK", "PG_WORLD_SIZE", "PG_LOCAL_RANK", "PG_STORE", "PG_BACKENDS", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
    *("LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS"),
)
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "from_env_demo.py"
#: this script: what the launcher tests start as each rank
JOB = Path(__file__)


GONE_S = 20.0  # a stopped job's processes are gone within this


def job_pids(pid_dir: Path, count: int) -> list[int]:
    pids = [int(p.name) for p in pid_dir.iterdir()]
    assert len(pids) == count, f"expected {count} ranks to have written their pids, found {pids}"
    return pids


def assert_gone(pids: list[int], timeout: float = GONE_S) -> None:
    """Every process in ``pids`` has exited (a zombie has) within ``timeout`` seconds."""
    alive = wait_exited(pids, timeout)
    assert not alive, f"processes of the job still running: {alive}"


def expected_demo(size: int) -> list[str]:
    """The lines examples/from_env_demo.py prints at world size ``size``."""
    return sorted(
        f"from_env_demo: rank {r}/{size} all_reduce={[float(size * i + size * (size - 1) // 2) for i in range(4)]} "
        f"max={[float(10 * (size - 1) + 1)]} broadcast={[float(size - 1)] * 2} "
        f"all_gather={[q * q for q in range(size)]} objects={[f'r{q}' for q in range(size)]}"
        for r in range(size)
    )


def demo_lines(stdout: str, *, prefixed: bool) -> list[str]:
    """The demo's lines in ``stdout``, sorted; with ``prefixed``, each must carry its own rank's prefix."""
    lines = []
    for line in stdout.splitlines():
        if "from_env_demo:" not in line:
            continue
        if prefixed:
            rank = line.split("from_env_demo: rank ", 1)[1].split("/", 1)[0]
            assert line.startswith(f"[rank {rank}] from_env_demo:"), line
        lines.append(line.split("] ", 1)[1] if prefixed else line)
    return sorted(lines)


def env_rank() -> int:
    for var in ("PG_RANK", "RANK", "PMI_RANK"):
        if os.environ.get(var):
            return int(os.environ[var])
    raise SystemExit("pgrun_job.py: no rank in the environment")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pids", required=True)
    parser.add_argument("mode", choices=("example", "print", "env", "hang", "raise", "exit", "kill-parent"))
    parser.add_argument("values", nargs="*", type=int)
    args = parser.parse_args()
    Path(args.pids, str(os.getpid())).touch()
    if args.mode == "example":
        sys.argv = [str(EXAMPLE)]
        runpy.run_path(str(EXAMPLE), run_name="__main__")
        return
    if args.mode == "print":
        rank = env_rank()
        print(f"out {rank}", flush=True)
        print(f"err {rank}", file=sys.stderr, flush=True)
        return
    if args.mode == "env":
        given = sorted(f"{k}={v}" for k, v in os.environ.items() if k in LAUNCHER_VARS or k.startswith("TORCHELASTIC_"))
        print(f"env {env_rank()} " + " ".join(given), flush=True)
        return
    if args.mode == "hang":
        print(f"ready {env_rank()}", flush=True)
        threading.Event().wait(120)
        raise SystemExit("pgrun_job.py hang: nobody stopped this rank within 120 s")
    if args.mode == "kill-parent":
        rank = env_rank()
        print(f"ready {rank}", flush=True)
        if rank == args.values[0]:
            size, waited = int(os.environ.get("PMI_SIZE") or os.environ["PG_WORLD_SIZE"]), threading.Event()
            for _ in range(1200):  # until every rank has written its pid (at most 60 s)
                if len(os.listdir(args.pids)) >= size:
                    break
                waited.wait(0.05)
            os.kill(os.getppid(), signal.SIGKILL)  # this rank dies with it (PR_SET_PDEATHSIG)
        threading.Event().wait(120)
        raise SystemExit("pgrun_job.py kill-parent: nobody stopped this rank within 120 s")
    from pg_core import ProcessGroup

    group = ProcessGroup.from_env(timeout=120)
    # Forming the group need not wait for every rank (a backend may connect lazily): this barrier
    # does, so every rank has written its pid before any of them fails.
    group.barrier()
    print(f"ready {group.rank}", flush=True)
    if group.rank == args.values[0]:
        if args.mode == "exit":
            sys.exit(args.values[1])
        raise ValueError(f"rank {group.rank} fails on purpose")
    # Wait for pgrun to stop this rank without talking to the failing one: a rank that saw its
    # peer's sockets close would fail too, and race it to be the first failure pgrun reports.
    threading.Event().wait(120)
    raise SystemExit("pgrun_job.py: nobody stopped this rank within 120 s of another's failure")


if __name__ == "__main__":
    main()
