"""Launchers: how a backend's rank processes must be started (``BackendSpec.launcher``).

Most backends run in processes started any way at all: each rank is told its rank and the
store. A backend whose library has a process manager of its own declares it on its spec;
the one pg-core knows is ``"mpiexec"``: the ``N`` rank processes of a job are started by
*one* ``mpiexec -n N COMMAND`` (MPICH's Hydra, Open MPI's), and each learns its rank from
the environment the launcher gives it (:func:`launched_rank`). Whatever starts ranks for a
backend (the conformance suite's :class:`~pg_core.testing.pool.RankPool`, through
:class:`~pg_core.procs.LaunchedRanks`) reads the spec and starts them through
:func:`launch_command`, and asks whether the backend can run *there*, not in the process
that starts them (:func:`why_unavailable_launched`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Final

__all__ = ["LAUNCHERS", "find_launcher", "launch_command", "launched_rank", "why_unavailable_launched"]

#: The launchers a spec may declare.
LAUNCHERS: Final[tuple[str, ...]] = ("mpiexec",)

#: (rank, size) variables that MPI launchers set in every rank's environment: MPICH's Hydra
#: (PMI), Open MPI, and PMIx-based launchers (PMIx gives no size; Slurm's ``srun`` does).
_RANK_ENV: Final[tuple[tuple[str, str], ...]] = (
    ("PMI_RANK", "PMI_SIZE"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("PMIX_RANK", "SLURM_NTASKS"),
)

#: What the probe prints before its verdict, so launcher chatter around it is ignored.
_VERDICT: Final = "pg-core-launched-probe:"

_PROBE: Final = f"""
import sys
try:
    from pg_core.backend_refs import resolve_backend_ref
    resolve_backend_ref(sys.argv[1], factories=False)
except Exception as exc:
    print({_VERDICT!r} + type(exc).__name__ + ": " + " ".join(str(exc).split()), flush=True)
else:
    print({_VERDICT!r} + "available", flush=True)
"""


#: Open MPI's ``mpiexec`` refuses to run as root and says to add ``--allow-run-as-root`` to the
#: command line, which pg-core writes, not the user: the environment says the same, and stays
#: the user's choice (Open MPI's refusal is deliberate).
_AS_ROOT: Final = (
    "; pg-core writes mpiexec's command line: to let Open MPI run as root, set OMPI_ALLOW_RUN_AS_ROOT=1 "
    "and OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 in the environment"
)


def launched_rank(env: Mapping[str, str] | None = None) -> tuple[int, int | None] | None:
    """``(rank, size)`` of this process in the job an MPI launcher started (``size`` is
    ``None`` where the launcher does not say), or ``None`` when no MPI launcher started it.
    Reads only the environment: nothing is initialised."""
    env = os.environ if env is None else env
    for rank_var, size_var in _RANK_ENV:
        rank = env.get(rank_var)
        if rank is not None and rank.strip().isdigit():
            size = env.get(size_var, "").strip()
            return int(rank), int(size) if size.isdigit() else None
    return None


def find_launcher(launcher: str) -> str | None:
    """The executable of ``launcher``: the one installed next to this Python first (a
    virtual environment's ``bin``, where the ``mpich`` wheel puts ``mpiexec``), else the
    first on ``PATH``; ``None`` if there is none."""
    _known(launcher)
    beside = os.path.join(os.path.dirname(sys.executable), launcher)
    if os.access(beside, os.X_OK):
        return beside
    return shutil.which(launcher)


def _known(launcher: str) -> None:
    if launcher not in LAUNCHERS:
        raise ValueError(f"unknown launcher {launcher!r}: pg-core knows {', '.join(LAUNCHERS)}")


def _is_hydra(executable: str) -> bool:
    """Whether ``executable`` is MPICH's Hydra (``-disable-auto-cleanup``, ``-n``) rather than
    Open MPI's ``mpiexec`` (``--oversubscribe``)."""
    try:
        out = subprocess.run([executable, "--version"], capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return True
    return "Open MPI" not in out and "OpenRTE" not in out and "PRRTE" not in out


def launch_command(launcher: str, n: int, argv: Sequence[str], *, keep_going: bool = False) -> list[str]:
    """The command line that starts ``n`` ranks running ``argv`` through ``launcher``.

    ``keep_going``: a rank that dies does not take the others down. By default both
    launchers kill the whole job when one rank exits without ``MPI_Finalize``; Hydra keeps
    the others with ``-disable-auto-cleanup``, Open MPI's ``mpiexec`` with
    ``--enable-recovery`` (PRRTE's ``--runtime-options recoverable``; without it, Open MPI
    5.0.11 killed the survivors of the conformance suite's ``dead_peer`` test, which then
    reported them dead instead of timed out). A test pool wants that, to report which rank
    died; a job wants the default. Open MPI's ``mpiexec`` also gets ``--oversubscribe``
    (more ranks than cores is what a test machine does). Raises ``FileNotFoundError`` if
    the launcher is not installed."""
    executable = find_launcher(launcher)
    if executable is None:
        raise FileNotFoundError(
            f"launcher {launcher!r} not found next to {sys.executable} or on PATH "
            "(pip install mpich puts one in the environment)"
        )
    if _is_hydra(executable):
        return [executable, *(["-disable-auto-cleanup"] if keep_going else []), "-n", str(n), *argv]
    return [executable, "--oversubscribe", *(["--enable-recovery"] if keep_going else []), "-n", str(n), *argv]


def why_unavailable_launched(ref: str, launcher: str, *, timeout: float = 120.0) -> str | None:
    """Whether the backend ``ref`` (as :func:`~pg_core.backend_refs.resolve_backend_ref` reads it)
    can run in a process started by ``launcher``: ``None``, or why not. One process is started
    that way and asked (``is_available()`` there), because a backend that needs a launcher is
    unavailable in the process that starts its ranks, by design."""
    try:
        command = launch_command(launcher, 1, [sys.executable, "-c", _PROBE, ref])
    except FileNotFoundError as exc:
        return str(exc)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    try:
        proc = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, check=False, stdin=subprocess.DEVNULL, env=env
        )
    except subprocess.TimeoutExpired:
        return f"a process started with {launcher} did not answer within {timeout:g} s"
    except OSError as exc:
        return f"{launcher} could not be started: {exc}"
    verdicts = [line.split(_VERDICT, 1)[1] for line in proc.stdout.splitlines() if _VERDICT in line]
    if not verdicts:
        said = " ".join((proc.stdout + proc.stderr).split())
        why = f"a process started with {launcher} exited {proc.returncode} without an answer: {said[-800:] or 'no output'}"
        return why + (_AS_ROOT if "--allow-run-as-root" in said else "")
    return None if verdicts[-1] == "available" else f"in a process started with {launcher}: {verdicts[-1]}"
