"""Rank processes: start them, watch them, dump their stacks, stop them. Written once,
for everything in pg-core that runs ranks of its own: the test pool
(:class:`pg_core.testing.pool.RankPool`) and ``pg-core bench``.

The parent side is :class:`RankProcesses`: ``n`` processes started together, each with
its stdout and stderr in a log file of its own (a pipe that nobody drains blocks the
rank that fills it; a file never does, and survives the rank for the post-mortem)::

    ranks = RankProcesses([[sys.executable, "-m", "my.worker", str(r)] for r in range(n)], env=env, log_dir=tmp)
    try:
        ...                                  # talk to them; ranks.poll() says who exited and how
        if hung:
            stacks = ranks.dump_stacks()     # rank -> its Python stacks, all threads
    finally:
        ranks.stop()                         # SIGTERM, a grace period, SIGKILL; reaped either way

The rank side calls :func:`prepare_rank` first thing, so the parent's
:meth:`RankProcesses.dump_stacks` works (faulthandler on ``SIGUSR1``, and on a crash),
intra-op parallelism does not oversubscribe the CPUs, and, if asked, the rank ends when
its parent dies.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Final

__all__ = [
    "EXEC_WITH_PARENT",
    "EXIT_UNKNOWN",
    "ForkedRanks",
    "LaunchedRanks",
    "RankProcesses",
    "adopt_launched_rank",
    "alive",
    "die_with_parent",
    "kill_on_parent_death",
    "prepare_rank",
    "tail",
    "wait_exited",
    "watch_parent",
]

#: How long :meth:`RankProcesses.dump_stacks` waits at most for the dumps to be written.
STACK_DUMP_S = 3.0
_STACK_SIGNAL = getattr(signal, "SIGUSR1", None)  # None on Windows: no stack dumps there


class RankProcesses:
    """One process per command in ``commands`` (rank ``r`` runs ``commands[r]``), started
    now, stdin from ``/dev/null``, stdout and stderr appended to ``log_dir/rank{r}.log``.

    If a start fails, the ranks already started are killed and the error propagates.
    The object is also a context manager that :meth:`stop`\\ s the ranks on exit.
    """

    def __init__(
        self,
        commands: Sequence[Sequence[str]],
        *,
        env: Mapping[str, str] | None = None,
        log_dir: str | os.PathLike[str],
        cwd: str | os.PathLike[str] | None = None,
    ) -> None:
        self.logs: list[Path] = [Path(log_dir) / f"rank{r}.log" for r in range(len(commands))]
        self.procs: list[subprocess.Popen[bytes]] = []
        try:
            for rank, argv in enumerate(commands):
                with self.logs[rank].open("ab") as log:  # append: truncating it between jobs stays safe
                    self.procs.append(
                        subprocess.Popen(
                            list(argv),
                            env=None if env is None else dict(env),
                            cwd=cwd,
                            stdin=subprocess.DEVNULL,
                            stdout=log,
                            stderr=subprocess.STDOUT,
                        )
                    )
        except BaseException:
            self.kill()
            raise

    def __len__(self) -> int:
        return len(self.procs)

    def __enter__(self) -> RankProcesses:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- watching -----------------------------------------------------------------------------
    def poll(self) -> list[int | None]:
        """Each rank's exit status, ``None`` while it runs (negative: killed by that signal)."""
        return [p.poll() for p in self.procs]

    def running(self) -> list[int]:
        """The ranks still running."""
        return [r for r, code in enumerate(self.poll()) if code is None]

    def failed(self) -> list[int]:
        """The ranks that exited with a non-zero status."""
        return [r for r, code in enumerate(self.poll()) if code not in (None, 0)]

    def wait(self, rank: int, timeout: float) -> int | None:
        """Rank ``rank``'s exit status once it exits, or ``None`` if it still runs after ``timeout`` s."""
        try:
            return self.procs[rank].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    # -- logs ---------------------------------------------------------------------------------
    def truncate_logs(self) -> None:
        """Empty every log (the ranks append, so they keep writing at the new end)."""
        for log in self.logs:
            with contextlib.suppress(OSError):
                os.truncate(log, 0)

    def tail(self, rank: int, *, lines: int | None = None, chars: int | None = None) -> str:
        """The end of rank ``rank``'s output; see :func:`tail`."""
        return tail(self.logs[rank], lines=lines, chars=chars)

    def dump_stacks(self, ranks: Iterable[int] | None = None, *, wait_s: float = STACK_DUMP_S) -> dict[int, str]:
        """Have the running ranks among ``ranks`` (default: all) write the Python stacks of all
        their threads into their logs (``SIGUSR1``, which :func:`prepare_rank` hands to
        faulthandler), wait until each log stops growing (at most ``wait_s``), and return
        what each rank wrote meanwhile (``""`` for a rank that wrote nothing, or had exited)."""
        ranks = list(range(len(self)) if ranks is None else ranks)
        start = {r: self._size(r) for r in ranks}
        signalled = [r for r in ranks if _STACK_SIGNAL is not None and self._signal(r, _STACK_SIGNAL)]
        # faulthandler writes from its signal handler: wait (bounded) until each log stops growing
        deadline = time.monotonic() + wait_s
        last = dict(start)
        settled: set[int] = set()
        while signalled and time.monotonic() < deadline and len(settled) < len(signalled):
            time.sleep(0.1)
            for rank in signalled:
                now = self._size(rank)
                if now > start[rank] and now == last[rank]:
                    settled.add(rank)
                last[rank] = now
        dumps: dict[int, str] = {}
        for rank in ranks:
            try:
                with self.logs[rank].open("rb") as f:
                    f.seek(start[rank])
                    dumps[rank] = f.read().decode(errors="replace")
            except OSError:
                dumps[rank] = ""
        return dumps

    def _signal(self, rank: int, sig: int) -> bool:
        """Send ``sig`` to rank ``rank`` if it runs; whether it was sent."""
        proc = self.procs[rank]
        if proc.poll() is not None:
            return False
        try:
            proc.send_signal(sig)
        except OSError:
            return False
        return True

    def _size(self, rank: int) -> int:
        try:
            return os.path.getsize(self.logs[rank])
        except OSError:
            return 0

    # -- stopping -----------------------------------------------------------------------------
    def stop(self, grace_s: float = 3.0, *, terminate: bool = True) -> None:
        """Stop every rank: ``SIGTERM`` (unless ``terminate=False``, for ranks already told to
        exit some other way), up to ``grace_s`` seconds in all for them to exit, then
        ``SIGKILL``. Every rank is reaped before this returns."""
        alive = [p for p in self.procs if p.poll() is None]
        if terminate:
            for p in alive:
                with contextlib.suppress(OSError):
                    p.terminate()
        deadline = time.monotonic() + grace_s
        for p in alive:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """``SIGKILL`` every rank still running, now, and reap them all."""
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(OSError):
                    p.kill()
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10.0)  # SIGKILL cannot be ignored; a process in uninterruptible sleep is not waited out


#: The exit status :class:`LaunchedRanks` reports for a rank that is gone while its launcher
#: still runs: the launcher reaped it, so its own status is not known here.
EXIT_UNKNOWN = 255


class LaunchedRanks(RankProcesses):
    """``size`` ranks started together by one launcher command (``mpiexec -n N ...``, see
    :func:`pg_core.launchers.launch_command`), with :class:`RankProcesses`' interface.

    The launcher runs in a session of its own with its output in ``log_dir/launcher.log``;
    each rank writes its own ``log_dir/rank{r}.log`` (the rank opens it, knowing its rank
    from the launcher) and reports its pid (:meth:`bind`), which is what stack dumps signal
    and :meth:`poll` watches. A rank that is gone while the launcher runs reports
    :data:`EXIT_UNKNOWN`; once the launcher exits, every rank reports its status. A rank that
    does not report its pid itself writes it next to its log (:func:`adopt_launched_rank`). Stopping
    ends the launcher's whole session (the launcher, its helpers, the ranks) and the bound
    pids, so no rank outlives it.
    """

    def __init__(
        self,
        command: Sequence[str],
        size: int,
        *,
        env: Mapping[str, str] | None = None,
        log_dir: str | os.PathLike[str],
        cwd: str | os.PathLike[str] | None = None,
    ) -> None:
        self.logs = [Path(log_dir) / f"rank{r}.log" for r in range(size)]
        for log in self.logs:
            log.touch()
            log.with_suffix(".pid").unlink(missing_ok=True)  # an earlier launch's ranks
        self.launcher_log = Path(log_dir) / "launcher.log"
        self.pids: list[int | None] = [None] * size
        self.procs = []
        with self.launcher_log.open("ab") as out:
            self.launcher = subprocess.Popen(
                list(command),
                env=None if env is None else dict(env),
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def __len__(self) -> int:
        return len(self.pids)

    def bind(self, rank: int, pid: int) -> None:
        """Rank ``rank`` runs as process ``pid`` (what the rank reported when it connected)."""
        self.pids[rank] = pid

    def _bound(self) -> list[int | None]:
        """The ranks' pids: as bound, else as the rank wrote it (:func:`adopt_launched_rank`)."""
        for rank, pid in enumerate(self.pids):
            if pid is None:
                with contextlib.suppress(OSError, ValueError):
                    self.pids[rank] = int(self.logs[rank].with_suffix(".pid").read_text())
        return self.pids

    def poll(self) -> list[int | None]:
        code = self.launcher.poll()
        if code is not None:
            return [code] * len(self)
        return [None if pid is None or alive(pid) else EXIT_UNKNOWN for pid in self._bound()]

    def wait(self, rank: int, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while (code := self.poll()[rank]) is None and time.monotonic() < deadline:
            time.sleep(0.05)  # not our child: no exit to wait on
        return code

    def truncate_logs(self) -> None:
        super().truncate_logs()
        with contextlib.suppress(OSError):
            os.truncate(self.launcher_log, 0)

    def _signal(self, rank: int, sig: int) -> bool:
        pid = self._bound()[rank]
        if pid is None or not alive(pid):
            return False
        try:
            os.kill(pid, sig)
        except OSError:
            return False
        return True

    def stop(self, grace_s: float = 3.0, *, terminate: bool = True) -> None:
        """``SIGTERM`` to the launcher (which passes it on to its ranks) unless ``terminate=False``,
        up to ``grace_s`` seconds for it to exit, then :meth:`kill`."""
        if self.launcher.poll() is None:
            if terminate:
                with contextlib.suppress(OSError):
                    self.launcher.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.launcher.wait(grace_s)
        self.kill()

    def kill(self) -> None:
        """``SIGKILL`` the launcher's session and every bound rank, now; reap the launcher and
        wait (bounded) until the ranks are gone."""
        with contextlib.suppress(OSError):
            os.killpg(self.launcher.pid, signal.SIGKILL)
        for pid in self._bound():
            if pid is not None:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.launcher.wait(10.0)
        deadline = time.monotonic() + 10.0
        while any(pid is not None and alive(pid) for pid in self.pids) and time.monotonic() < deadline:
            time.sleep(0.05)


class ForkedRanks(LaunchedRanks):
    """One process per command, as :class:`RankProcesses` starts them, but forked from
    processes that imported what they run first: each command is ``[python, "-m", module,
    *args]``; a launcher imports each ``module``'s package and torch once, then forks a child
    per rank that runs ``module`` as ``__main__`` with ``args``, as ``python -m`` would, its
    output in ``log_dir/rank{r}.log``. Importing torch costs a process about 2.5 s of CPU on a
    2-core test machine, the larger part of what a short test's ranks do; forked ranks pay it
    twice per start instead of once per rank.

    Twice, because there are two launchers: the one started here forks the even ranks and
    starts a second, a fresh interpreter, for the odd ones. A forked child keeps its parent's
    string-hash seed, so a set of strings iterates in the same order in every child of one
    launcher; neighbouring ranks come from different launchers, so a backend whose ranks
    must agree on an order they take from such a set fails here as between fresh processes.

    Every rank is a process of its own, with its own pid, memory and sockets; torch supports
    forking after it is imported (its ``DataLoader`` workers are forked so). A launcher only
    imports: no accelerator context, no work in torch's thread pools. It writes each child's
    pid beside its log once forked, reaps the children and writes each exit status beside
    them (``rank{r}.exit``), so :meth:`poll` reports what :class:`RankProcesses` does
    (negative: killed by that signal). ``SIGTERM`` to the launcher is passed on to every rank;
    stopping ends the launchers' session, ranks included."""

    def __init__(
        self,
        commands: Sequence[Sequence[str]],
        *,
        env: Mapping[str, str] | None = None,
        log_dir: str | os.PathLike[str],
        cwd: str | os.PathLike[str] | None = None,
    ) -> None:
        if not commands:
            raise ValueError("ForkedRanks needs at least one command")
        for argv in commands:
            if len(argv) < 3 or argv[1] != "-m" or argv[0] != commands[0][0]:
                raise ValueError(f"ForkedRanks runs commands of the form [python, '-m', module, *args]; got {argv!r}")
        for rank in range(len(commands)):
            Path(log_dir, f"rank{rank}.exit").unlink(missing_ok=True)  # an earlier start's statuses
        ranks = json.dumps([list(argv[2:]) for argv in commands])
        launcher = [commands[0][0], "-m", "pg_core.procs", "fork", os.fspath(log_dir), ranks]
        super().__init__(launcher, len(commands), env=env, log_dir=log_dir, cwd=cwd)

    def poll(self) -> list[int | None]:
        launcher = self.launcher.poll()
        codes: list[int | None] = []
        for rank in range(len(self)):
            try:
                codes.append(int(self.logs[rank].with_suffix(".exit").read_text()))
            except (OSError, ValueError):
                # not reaped yet (running, or a moment after its exit); or never forked, or its
                # launcher killed before it could say
                codes.append(None if launcher is None else launcher)
        return codes

    def kill(self) -> None:
        """``SIGKILL`` the launchers and the ranks, one process group, now, unless the launcher
        exited after reaping every rank (their pids may be reused by now); reap the launcher
        and wait (bounded) until any rank it did not reap is gone."""
        unreaped = [
            pid
            for rank, pid in enumerate(self._bound())
            if pid is not None and not self.logs[rank].with_suffix(".exit").exists()
        ]
        if self.launcher.poll() is None or unreaped:
            with contextlib.suppress(OSError):
                os.killpg(self.launcher.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.launcher.wait(10.0)
        wait_exited(unreaped, 10.0)


#: Which ranks each of :class:`ForkedRanks`' two launchers forks.
_PARITIES: Final = {"even": 0, "odd": 1}


def _fork_ranks(log_dir: str, ranks: list[list[str]], parity: str = "even") -> int:
    """A launcher of :class:`ForkedRanks`: import, fork a child per rank of its ``parity``,
    reap them; the even launcher first starts the odd one (a fresh interpreter: another
    string-hash seed), reaps it too, and exits last. In a child, returns the rank's exit
    status instead, for the interpreter to exit with."""
    helper = None
    if parity == "even" and len(ranks) > 1:
        odd = [sys.executable, "-m", "pg_core.procs", "fork", log_dir, json.dumps(ranks), "odd"]
        helper = os.posix_spawn(sys.executable, odd, os.environ)
    for module in dict.fromkeys(argv[0] for argv in ranks):
        package = module.rpartition(".")[0]  # not the module itself: the child runs it as __main__
        if package:
            importlib.import_module(package)
    import torch  # noqa: F401 - what every pg-core rank imports, whatever its module

    sys.stdout.flush()
    sys.stderr.flush()
    # what was imported stays for the ranks' lifetime: out of the collector's sight, so a
    # rank's collections neither walk it nor copy its pages (copy-on-write) by touching them
    gc.freeze()
    children: dict[int, int] = {}

    def forward(signum: int, _frame: object) -> None:
        for child in [*children, *([] if helper is None else [helper])]:
            with contextlib.suppress(OSError):
                os.kill(child, signum)

    signal.signal(signal.SIGTERM, forward)
    for rank in range(_PARITIES[parity], len(ranks), 2):
        module, *args = ranks[rank]
        pid = os.fork()
        if pid == 0:
            return _run_forked(log_dir, rank, module, args)
        children[pid] = rank
        _write_atomically(Path(log_dir, f"rank{rank}.pid"), str(pid))
    while children or helper is not None:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        code = os.waitstatus_to_exitcode(status)
        if pid in children:
            _write_atomically(Path(log_dir, f"rank{children.pop(pid)}.exit"), str(code))
        elif pid == helper:  # the odd launcher: its ranks that it never forked end with it
            helper = None
            for rank in range(1, len(ranks), 2):
                if not Path(log_dir, f"rank{rank}.pid").exists():
                    _write_atomically(Path(log_dir, f"rank{rank}.exit"), str(code))
    return 0


def _run_forked(log_dir: str, rank: int, module: str, args: list[str]) -> int:
    """A forked rank: output to its log, then ``module`` as ``__main__``, as ``python -m``
    runs it; returns 0 when it returns (an exception or ``SystemExit`` propagates), and the
    interpreter exits as after ``python -m``: atexit handlers, non-daemon threads, buffers."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    fd = os.open(os.path.join(log_dir, f"rank{rank}.log"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


def _write_atomically(path: Path, text: str) -> None:
    partial = path.with_suffix(path.suffix + ".partial")
    partial.write_text(text)
    partial.replace(path)  # the parent never reads half of it


def adopt_launched_rank(log_dir: str | os.PathLike[str]) -> int:
    """For a rank process a launcher started (:class:`LaunchedRanks`): its rank, read from the
    launcher's environment; its stdout and stderr moved to ``log_dir/rank{r}.log``; its pid
    written to ``log_dir/rank{r}.pid``. Raises ``RuntimeError`` if no launcher started it."""
    from .launchers import launched_rank

    found = launched_rank()
    if found is None:
        raise RuntimeError(
            "this process was not started by an MPI launcher (no PMI_RANK, OMPI_COMM_WORLD_RANK or PMIX_RANK)"
        )
    rank = found[0]
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(os.path.join(log_dir, f"rank{rank}.log"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    _write_atomically(Path(log_dir, f"rank{rank}.pid"), str(os.getpid()))
    return rank


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (read from ``/proc`` where there is
    one, else asked with signal 0: a process this one may not signal exists). The one test of
    every supervisor here: :class:`RankProcesses` and its kin, ``pgrun`` and its rank wrappers."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def wait_exited(pids: Iterable[int], timeout: float) -> list[int]:
    """Wait, at most ``timeout`` seconds in all, until every process in ``pids`` has exited
    (a zombie has), children of this process or not; the ones still running then. Waits on
    each process's pidfd where the system has them (Linux 5.3+: woken by the exit itself),
    else re-reads ``/proc`` every 50 ms."""
    deadline = time.monotonic() + timeout
    running = []
    for pid in pids:
        if not hasattr(os, "pidfd_open"):
            while alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)  # no pidfd: nothing tells another session's process's exit
            if alive(pid):
                running.append(pid)
            continue
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        finally:
            os.close(fd)
        if not ready:
            running.append(pid)
    return running


def tail(path: str | os.PathLike[str], *, lines: int | None = None, chars: int | None = None) -> str:
    """The end of a log: its last ``chars`` characters and/or ``lines`` lines (everything if
    neither is given); ``""`` if it cannot be read."""
    try:
        with open(path, "rb") as f:
            if chars is not None:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - chars))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    if lines is not None:
        text = "\n".join(text.rstrip().splitlines()[-lines:])
    return text


# -- the rank side ------------------------------------------------------------------------------


def prepare_rank(*, parent_pid: int | None = None, threads: int | None = 1) -> None:
    """What a rank process does first: Python stacks of every thread into its output on
    ``SIGUSR1`` (for :meth:`RankProcesses.dump_stacks`) and on a fatal signal; ``threads``
    intra-op threads for torch (``None``: torch's default); and, given ``parent_pid``,
    :func:`die_with_parent`."""
    import faulthandler

    faulthandler.enable()
    if _STACK_SIGNAL is not None:
        faulthandler.register(_STACK_SIGNAL, all_threads=True)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    if parent_pid is not None:
        die_with_parent(parent_pid)


#: ``prctl``'s option that has the kernel signal this process when its parent dies (Linux).
PR_SET_PDEATHSIG: Final = 1

#: A ``python -c`` program, ``python -c EXEC_WITH_PARENT PARENT_PID COMMAND...``, for a process
#: that must start fast and import nothing (a rank that ``pgrun`` starts): the rules of
#: :func:`kill_on_parent_death` and :func:`die_with_parent`'s first check (gone already: exit
#: 137, as SIGKILL would), then it becomes ``COMMAND`` (the signal is kept across ``exec``).
EXEC_WITH_PARENT: Final = (
    "import os, signal, sys\n"
    "if sys.platform.startswith('linux'):\n"
    "    import ctypes\n"
    f"    ctypes.CDLL(None, use_errno=True).prctl({PR_SET_PDEATHSIG}, int(signal.SIGKILL))\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(137)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def kill_on_parent_death() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux's
    ``PR_SET_PDEATHSIG``; nothing elsewhere, or where ``prctl`` cannot be reached). It also
    ends a process blocked inside C++ with the GIL held (a store connecting, a socket
    waiting); note that Linux sends it when the parent's *thread* that started the process
    ends, so start such processes from a thread that outlives them. Check the parent right
    after (it may have died before this call): ``os.getppid() != parent``."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))


def watch_parent(
    parent: int, gone: Callable[[], None], *, every_s: float = 1.0, also: Callable[[], bool] | None = None
) -> threading.Thread:
    """Call ``gone()`` (which ends the process) from a daemon thread once this process's parent
    is no longer ``parent`` (it died: the process was re-parented), or ``also()`` says true;
    checked every ``every_s`` seconds. The backstop to :func:`kill_on_parent_death`, and what
    there is where the kernel has no such signal."""

    def loop() -> None:
        while True:
            time.sleep(every_s)
            if os.getppid() != parent or (also is not None and also()):
                gone()
                return

    thread = threading.Thread(target=loop, name="pg-core-parent-watch", daemon=True)
    thread.start()
    return thread


def die_with_parent(parent: int) -> None:
    """End this process when ``parent`` (its parent's pid) dies: a killed parent must not
    leave ranks behind. :func:`kill_on_parent_death`, exit 3 at once if the parent is gone
    already, and :func:`watch_parent` as the backstop (every second)."""
    kill_on_parent_death()
    if os.getppid() != parent:  # died before we could ask
        os._exit(3)
    watch_parent(parent, lambda: os._exit(3))


if __name__ == "__main__":
    # the launchers of ForkedRanks: python -m pg_core.procs fork LOG_DIR RANKS_JSON [even|odd]
    if len(sys.argv) not in (4, 5) or sys.argv[1] != "fork" or sys.argv[4:] not in ([], ["even"], ["odd"]):
        sys.exit(
            "usage: python -m pg_core.procs fork LOG_DIR RANKS_JSON [even|odd] (started by pg_core.procs.ForkedRanks)"
        )
    sys.exit(_fork_ranks(sys.argv[2], json.loads(sys.argv[3]), *sys.argv[4:]))
