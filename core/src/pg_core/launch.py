"""``pgrun`` (also ``pg-core run``, ``python -m pg_core.launch``): start the ranks of a job.

``pgrun -n N [options] script.py ARGS`` or ``pgrun -n N [options] -m module ARGS`` runs
``N`` Python processes on this host, in the spirit of torchrun:

- it hosts the job's store (a ``TCPStore`` server, listening on every interface, which the
  ranks reach at ``--host``, 127.0.0.1 by default, on a free port unless ``--master
  HOST:PORT``), outside the ranks and alive until every rank
  is gone, in a process of its own that imports torch while the ranks start (pgrun itself
  imports no torch, so a rank starts in a fraction of a second), and gives each rank ``PG_RANK``, ``PG_WORLD_SIZE``, ``PG_LOCAL_RANK``,
  ``PG_STORE`` (``host:port``), ``PG_BACKENDS`` (with ``--backends``) and torchrun's
  ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
  ``MASTER_ADDR``, ``MASTER_PORT``: what :meth:`ProcessGroup.from_env` reads; and
  ``PG_CORE_AUTH_KEY``, a fresh secret for the job (the user's, where the environment has
  one), so the ranks' groups are authenticated (``docs/security.md``);
- every line a rank writes, to stdout or stderr, comes out on pgrun's stdout or stderr
  prefixed with ``[rank R] `` (``--no-prefix``: as written);
- when a rank fails (a non-zero exit, or killed), the others get ``SIGTERM`` and, after
  ``--grace`` seconds, ``SIGKILL``; the failing rank's stderr tail (its traceback) is
  printed last and pgrun exits with its exit code (``128 + N`` for signal ``N``);
- ``SIGINT`` (Ctrl-C) or ``SIGTERM`` to pgrun is passed on to every rank, then the same
  grace period; exit ``130`` / ``143``. ``--timeout`` bounds the whole job: exit ``124``;
- nothing outlives it: each rank is the leader of a session of its own, and its whole
  process group is killed at the end; a rank dies with pgrun even if pgrun is killed with
  ``SIGKILL`` (``PR_SET_PDEATHSIG`` on Linux, set before the rank's Python starts).

Multi-node, as torchrun spells it: ``--nnodes K --node-rank I --master HOST:PORT`` on each
node; node 0's pgrun hosts the store on ``HOST:PORT``, the global rank is
``I * N + local rank``, and a failure on one node stops the others (through the store).
The nodes cannot agree on a fresh secret by themselves: set ``PG_CORE_AUTH_KEY`` alike on
every node for an authenticated multi-node job (without it the job runs unauthenticated).

``--mpi`` starts the ranks through ``mpiexec -n N`` (for pg-mpi, whose ranks must be MPI
processes); each rank runs under a small wrapper that gives it the same variables, prefixes
its lines and reports its exit to pgrun. What MPICH's mpiexec prints when a rank fails (its
"BAD TERMINATION" banner) is held back: pgrun's own report says which rank failed, how, and
its traceback; the banner is shown, after pgrun's word, only when no rank's report explains
the failure.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, Final, TextIO

from .auth import environment_with_key
from .procs import EXEC_WITH_PARENT, alive, kill_on_parent_death, watch_parent

__all__ = ["add_arguments", "add_parser", "main", "run"]

_DEFAULT_GRACE: Final = 5.0
#: How long a node's pgrun waits for the store on ``--master`` (node 0's) to answer.
_CONNECT_S: Final = 300.0
#: How often pgrun asks the store whether another node failed, in a multi-node job.
_NODES_POLL_S: Final = 0.25
#: How often ``--mpi`` looks for a rank's exit report.
_MPI_POLL_S: Final = 0.2
_TAIL_LINES: Final = 200
#: Node 0, its own ranks done, gives up on a node whose pgrun has been silent this long
#: (``--node-timeout``'s default).
_NODE_LOST_S: Final = 30.0
_FAILED_KEY: Final = "pgrun/failed"
#: Variables of other launchers that the ranks must not inherit (pgrun sets its own).
_INHERITED: Final = (
    "PG_RANK",
    "PG_LOCAL_RANK",
    "PG_WORLD_SIZE",
    "PG_STORE",
    "PG_BACKENDS",
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
)


class _UsageError(Exception):
    """A command line pgrun cannot run: exit status 2, with this message."""


# -- the command line --------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """pgrun's arguments (shared by ``pgrun`` and ``pg-core run``)."""
    parser.add_argument(
        "-n",
        "--nproc-per-node",
        dest="nproc",
        type=int,
        required=True,
        metavar="N",
        help="ranks to start on this node",
    )
    parser.add_argument(
        "--backends",
        default=None,
        metavar="SPEC",
        help="PG_BACKENDS for the ranks: what ProcessGroup.from_env() uses when it is given none "
        "(e.g. 'tcp' or 'cpu:gloo,cuda:nccl')",
    )
    parser.add_argument(
        "--host",
        default=None,
        metavar="HOST",
        help="address the ranks reach the store at (default 127.0.0.1); the store listens on every interface, as torch's TCPStore does",
    )
    parser.add_argument(
        "--master",
        default=None,
        metavar="HOST:PORT",
        help="the store's address: node 0 hosts it there, the other nodes connect to it (default: --host, a free port)",
    )
    parser.add_argument("--nnodes", type=int, default=1, metavar="K", help="nodes in the job (default 1)")
    parser.add_argument("--node-rank", type=int, default=0, metavar="I", help="this node's rank, 0 .. K-1 (default 0)")
    parser.add_argument("--mpi", action="store_true", help="start the ranks through mpiexec (for pg-mpi)")
    parser.add_argument("--no-prefix", action="store_true", help="do not prefix the ranks' lines with '[rank R] '")
    parser.add_argument(
        "--grace",
        type=float,
        default=_DEFAULT_GRACE,
        metavar="S",
        help=f"seconds between SIGTERM and SIGKILL when stopping ranks (default {_DEFAULT_GRACE:g})",
    )
    parser.add_argument(
        "--timeout", type=float, default=None, metavar="S", help="stop every rank after S seconds (exit status 124)"
    )
    parser.add_argument(
        "--node-timeout",
        type=float,
        default=_NODE_LOST_S,
        metavar="S",
        help="node 0, its ranks done, gives up on a node whose pgrun has not been heard from for S seconds "
        f"(exit status 1; default {_NODE_LOST_S:g}; at least 1: a node is heard from every {_NODES_POLL_S:g} s)",
    )
    parser.add_argument(
        "-m", "--module", action="store_true", help="run the target as a module (python -m TARGET), not a script"
    )
    parser.add_argument("target", metavar="script.py | module", help="the script (or, with -m, the module) to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")


_DESCRIPTION: Final = (
    "Start N ranks of a Python script or module on this host, with a store hosted here (pgrun's own, outside the "
    "ranks) and the environment ProcessGroup.from_env() reads; prefix their output lines with their rank; when one "
    "fails, stop the others and exit with its status, its traceback printed last."
)


def add_parser(subparsers: Any) -> None:
    """Add ``run`` to ``pg-core``'s subcommands."""
    parser = subparsers.add_parser("run", help="start the ranks of a job (pgrun)", description=_DESCRIPTION)
    add_arguments(parser)
    parser.set_defaults(handler=run)


def main(argv: Sequence[str] | None = None, *, prog: str = "pgrun") -> int:
    """The ``pgrun`` command (``prog``: its name in usage messages)."""
    parser = argparse.ArgumentParser(prog=prog, description=_DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Run the job ``args`` describe (see :func:`add_arguments`); its exit status."""
    try:
        config = _Config.of(args)
    except _UsageError as exc:
        sys.stderr.write(f"pgrun: error: {exc}\n")
        return 2
    return _Job(config).run()


@dataclass(frozen=True)
class _Config:
    nproc: int
    nnodes: int
    node_rank: int
    host: str
    port: int  # 0: a free one (node 0 only)
    backends: str | None
    mpi: bool
    prefix: bool
    grace: float
    timeout: float | None
    node_timeout: float  # node 0 gives up on a node silent this long
    command: tuple[str, ...]  # what each rank runs

    @classmethod
    def of(cls, args: argparse.Namespace) -> _Config:
        if args.nproc < 1:
            raise _UsageError(f"-n must be at least 1, got {args.nproc}")
        if args.nnodes < 1:
            raise _UsageError(f"--nnodes must be at least 1, got {args.nnodes}")
        if not 0 <= args.node_rank < args.nnodes:
            raise _UsageError(f"--node-rank {args.node_rank} is not in 0 .. {args.nnodes - 1} (--nnodes {args.nnodes})")
        if args.grace < 0:
            raise _UsageError(f"--grace must be at least 0, got {args.grace:g}")
        if args.timeout is not None and args.timeout <= 0:
            raise _UsageError(f"--timeout must be positive, got {args.timeout:g}")
        if not args.node_timeout >= 1:  # (NaN too)
            raise _UsageError(f"--node-timeout must be at least 1 (seconds), got {args.node_timeout:g}")
        if args.master is not None:
            host, sep, port_text = args.master.rpartition(":")
            if not sep or not host or not port_text.isdigit() or not 0 <= int(port_text) < 2**16:
                raise _UsageError(f"--master {args.master!r} is not HOST:PORT")
            host, port = host.strip("[]"), int(port_text)
            if args.host is not None and args.host != host:
                raise _UsageError(f"--host {args.host} and --master {args.master} name different hosts: give one")
            if port == 0 and args.nnodes > 1:
                raise _UsageError("--master needs a port other than 0 in a multi-node job: every node must know it")
        elif args.nnodes > 1:
            raise _UsageError("a multi-node job (--nnodes > 1) needs --master HOST:PORT, the same on every node")
        else:
            host, port = args.host or "127.0.0.1", 0
        if args.mpi and args.nnodes > 1:
            raise _UsageError(
                "--mpi starts one node's ranks; for several nodes give mpiexec its hosts and run it yourself"
            )
        if args.module:
            command = (sys.executable, "-u", "-m", args.target, *args.args)
        else:
            if not os.path.isfile(args.target):
                raise _UsageError(f"{args.target}: no such file (to run a module, use -m)")
            command = (sys.executable, "-u", args.target, *args.args)
        return cls(
            nproc=args.nproc,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            host=host,
            port=port,
            backends=args.backends,
            mpi=args.mpi,
            prefix=not args.no_prefix,
            grace=args.grace,
            timeout=args.timeout,
            node_timeout=args.node_timeout,
            command=command,
        )

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes


# -- the job -------------------------------------------------------------------------------------


@dataclass
class _Proc:
    """A process pgrun started (a rank, or with ``--mpi`` the ``mpiexec``), with its output pumps."""

    label: str
    popen: subprocess.Popen[bytes]
    prefix: bytes
    tail: collections.deque[bytes] = field(default_factory=lambda: collections.deque(maxlen=_TAIL_LINES))
    status: int | None = None  # set once it exited (not reaped): exit code, or -signal
    exit_order: int = 0  # among this job's processes, when it exited: 1 for the first
    pumps: list[threading.Thread] = field(default_factory=list)
    #: with ``--mpi``, mpiexec's: what it says of a failure (MPICH's banner), held back per stream
    banners: list[_MpiexecBanner] = field(default_factory=list)


@dataclass(frozen=True)
class _Failure:
    """Why the job failed: what to say, the tail to print last, the exit status."""

    what: str
    tail: list[bytes] | None  # None: not a process's failure (a signal, the timeout, another node)
    code: int
    prefix: bytes = b""  # the failed rank's, for its tail
    tail_is: str = "the end of its stderr"


class _Job:
    def __init__(self, config: _Config) -> None:
        self.config = config
        self.procs: list[_Proc] = []
        self.changed = threading.Event()  # a process exited, or a signal came
        self.signals: list[int] = []
        self.write_lock = threading.Lock()
        self.status_dir: str | None = None
        self.store: Any = None  # a multi-node job's client of the store
        self.store_proc: _Proc | None = None  # node 0: the process hosting the store
        self.exits = itertools.count(1)

    # -- the whole run -------------------------------------------------------------------------
    def run(self) -> int:
        handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        previous = {sig: signal.signal(sig, self._on_signal) for sig in handled}
        try:
            try:
                host, port = self._open_store()
                self._start(host, port)
            except (_StartError, OSError, RuntimeError) as exc:
                self._say(f"error: {exc}")
                return 1
            failure = self._supervise()
            self._stop(self.signals[0] if self.signals else signal.SIGTERM)
            self._report(failure)
            return 0 if failure is None else failure.code
        finally:
            self._stop(signal.SIGTERM)  # a no-op once stopped; here for an exception in the middle
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if self.status_dir is not None:
                shutil.rmtree(self.status_dir, ignore_errors=True)
            self._close_store()  # node 0: the server goes once every rank is gone

    def _on_signal(self, signum: int, frame: object) -> None:
        self.signals.append(signum)
        self.changed.set()

    # -- the store -----------------------------------------------------------------------------
    def _open_store(self) -> tuple[str, int]:
        """Node 0: bind the store's port here and host torch's ``TCPStore`` server on it in a
        process of its own (:func:`_host_store`), which imports torch while the ranks start, so
        pgrun itself never does; the ranks' connections wait in the socket's backlog until it
        serves. A multi-node job's pgrun is also a client of the store (its own calls, to follow
        the other nodes): that one imports torch."""
        c = self.config
        timeout = min(_CONNECT_S, c.timeout or _CONNECT_S)
        port = c.port
        if c.node_rank == 0:
            port = self._host_store(timeout)
            if c.nnodes == 1:
                return c.host, port
        from datetime import timedelta

        from .store import TCPStore

        try:
            self.store = TCPStore(c.host, port, is_master=False, timeout=timedelta(seconds=timeout))
        except Exception as exc:  # torch's DistNetworkError, a RuntimeError
            raise RuntimeError(
                f"node {c.node_rank}: could not reach the store on node 0 at {c.host}:{port} within {timeout:g} s "
                f"(is pgrun --node-rank 0 --master {c.host}:{port} running?): {exc}"
            ) from exc
        return c.host, port

    def _host_store(self, timeout: float) -> int:
        """Start the store's process on a socket bound here (every interface, as
        :class:`~pg_core.StoreServer` listens); its port."""
        c = self.config
        backlog = max(128, 2 * c.world_size)  # every rank may connect before the server accepts
        if socket.has_dualstack_ipv6():
            listening = socket.create_server(
                ("", c.port), family=socket.AF_INET6, backlog=backlog, reuse_port=False, dualstack_ipv6=True
            )
        else:
            listening = socket.create_server(("", c.port), backlog=backlog)
        with listening:
            fd, port = listening.fileno(), int(listening.getsockname()[1])
            command = [sys.executable, "-m", "pg_core.launch", _STORE_HOST_FLAG, str(fd), c.host, str(port)]
            popen = subprocess.Popen(
                [*command, f"{timeout:g}", str(os.getpid())],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                pass_fds=(fd,),
                start_new_session=True,  # Ctrl-C to pgrun's terminal leaves it: it serves until the ranks are gone
            )
        # (pgrun's copy of the socket is closed: once the store's process is gone, connecting is refused)
        self.store_proc = _Proc("the store's process", popen, b"")
        assert popen.stderr is not None
        pump = threading.Thread(target=self._pump_tail, args=(popen.stderr, self.store_proc.tail), daemon=True)
        pump.start()
        self.store_proc.pumps.append(pump)
        threading.Thread(target=self._wait_store_proc, args=(self.store_proc,), daemon=True).start()
        return port

    def _pump_tail(self, pipe: IO[bytes], tail: collections.deque[bytes]) -> None:
        with pipe:
            for chunk in iter(lambda: pipe.readline(65536), b""):
                tail.append(chunk)

    def _wait_store_proc(self, proc: _Proc) -> None:
        status = proc.popen.wait()
        proc.exit_order = next(self.exits)
        proc.status = status
        self.changed.set()

    def _close_store(self) -> None:
        """Stop the store's process, the ranks gone: nothing in it outlives them, so it is
        killed (it may still be importing torch, for a job whose ranks never used it)."""
        self.store = None
        proc, self.store_proc = self.store_proc, None
        if proc is None:
            return
        _killpg(proc, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):  # stuck in the kernel: pgrun's own exit code stands
            proc.popen.wait(10.0)
        for pump in proc.pumps:
            pump.join(5.0)
        if proc.popen.stdin is not None:
            proc.popen.stdin.close()

    # -- starting ------------------------------------------------------------------------------
    def _env(self, host: str, port: int) -> dict[str, str]:
        """What every rank of this node gets (the per-rank variables are added per rank, or,
        with ``--mpi``, by the wrapper)."""
        c = self.config
        env = {k: v for k, v in os.environ.items() if k not in _INHERITED and not k.startswith("TORCHELASTIC_")}
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        env.update(
            PG_WORLD_SIZE=str(c.world_size),
            PG_STORE=address,
            WORLD_SIZE=str(c.world_size),
            LOCAL_WORLD_SIZE=str(c.nproc),
            GROUP_RANK=str(c.node_rank),
            MASTER_ADDR=host,
            MASTER_PORT=str(port),
        )
        if c.backends is not None:
            env["PG_BACKENDS"] = c.backends
        if c.nnodes == 1:  # one secret per job; the nodes of a multi-node job share the user's, if set
            env = environment_with_key(env)
        if c.nproc > 1 and "OMP_NUM_THREADS" not in env:
            env["OMP_NUM_THREADS"] = "1"  # as torchrun: N ranks of all-core torch threads fight over the cores
        return env

    def _start(self, host: str, port: int) -> None:
        c = self.config
        env = self._env(host, port)
        if c.mpi:
            from .launchers import launch_command

            self.status_dir = tempfile.mkdtemp(prefix="pgrun-")
            env["PGRUN_PID"] = str(os.getpid())
            wrapper = [sys.executable, "-u", "-m", "pg_core.launch", "--_mpi-rank", self.status_dir]
            wrapper += ["--_prefix" if c.prefix else "--_no-prefix", "--", *c.command]
            try:
                command = launch_command("mpiexec", c.nproc, wrapper)
            except FileNotFoundError as exc:
                raise _StartError(str(exc)) from exc
            mpiexec = self._spawn("mpiexec", command, env, b"")
            mpiexec.banners = [_MpiexecBanner(), _MpiexecBanner()]  # stdout's, stderr's
            self._watch(mpiexec)
        else:
            for local in range(c.nproc):
                rank = c.node_rank * c.nproc + local
                per_rank = {**env, "PG_RANK": str(rank), "PG_LOCAL_RANK": str(local)}
                per_rank.update(RANK=str(rank), LOCAL_RANK=str(local))
                prefix = f"[rank {rank}] ".encode() if c.prefix else b""
                self._watch(self._spawn(f"rank {rank}", c.command, per_rank, prefix))

    def _spawn(self, label: str, command: Sequence[str], env: Mapping[str, str], prefix: bytes) -> _Proc:
        popen = subprocess.Popen(
            [sys.executable, "-c", EXEC_WITH_PARENT, str(os.getpid()), *command],
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own session and process group, killed as one
        )
        proc = _Proc(label, popen, prefix)
        self.procs.append(proc)
        return proc

    def _watch(self, proc: _Proc) -> None:
        assert proc.popen.stdout is not None and proc.popen.stderr is not None
        outs = ((proc.popen.stdout, sys.stdout, None), (proc.popen.stderr, sys.stderr, proc.tail))
        for i, (pipe, out, tail) in enumerate(outs):
            banner = proc.banners[i] if proc.banners else None
            pump = threading.Thread(target=self._pump, args=(pipe, out, proc.prefix, tail, banner), daemon=True)
            pump.start()
            proc.pumps.append(pump)
        threading.Thread(target=self._wait_exit, args=(proc,), daemon=True).start()

    def _pump(
        self,
        pipe: IO[bytes],
        out: TextIO,
        prefix: bytes,
        tail: collections.deque[bytes] | None,
        banner: _MpiexecBanner | None = None,
    ) -> None:
        """Copy ``pipe`` to ``out`` line by line, each line with ``prefix``; through ``banner``
        where given (what mpiexec says of a failure is held back: pgrun says it)."""
        at_start = True
        with pipe:
            for line in _passed(iter(lambda: pipe.readline(65536), b""), banner):
                if tail is not None:
                    tail.append(line)
                self._write(out, prefix + line if at_start else line)
                at_start = line.endswith(b"\n")

    def _write(self, out: TextIO, data: bytes) -> None:
        with self.write_lock, contextlib.suppress(OSError, ValueError):  # a closed pgrun stdout: keep draining
            binary = getattr(out, "buffer", None)
            if binary is None:  # a text-only stream (pgrun called in-process, its output captured)
                out.write(data.decode(errors="replace"))
                out.flush()
            else:
                binary.write(data)
                binary.flush()

    def _wait_exit(self, proc: _Proc) -> None:
        """Note ``proc``'s exit without reaping it: its pid (its process group's id) stays
        taken until :meth:`_stop` has killed the group."""
        try:
            result = os.waitid(os.P_PID, proc.popen.pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:
            status = proc.popen.returncode if proc.popen.returncode is not None else -1
        else:
            assert result is not None
            status = result.si_status if result.si_code == os.CLD_EXITED else -result.si_status
        proc.exit_order = next(self.exits)  # before the status, which is what the supervisor reads first
        proc.status = status
        self.changed.set()

    # -- watching ------------------------------------------------------------------------------
    def _supervise(self) -> _Failure | None:
        """Wait until the job is over: ``None`` if every rank exited 0, else what went wrong."""
        c = self.config
        deadline = None if c.timeout is None else time.monotonic() + c.timeout
        poll = _MPI_POLL_S if c.mpi else _NODES_POLL_S if c.nnodes > 1 else None
        # node 0: the nodes not done yet -> (their heartbeats, when those last changed, once node 0 waits for them)
        waiting: dict[int, tuple[int, float | None]] = {n: (-1, None) for n in range(1, c.nnodes) if c.node_rank == 0}
        while True:
            self.changed.clear()
            if self.signals:
                sig = self.signals[0]
                name = signal.Signals(sig).name
                self._say(f"got {name}: stopping every rank")
                return _Failure(f"stopped by {name}", None, 128 + sig)
            failure = self._failed()
            if failure is not None:
                self._tell_nodes(failure)
                return failure
            if all(p.status is not None for p in self.procs):
                if c.nnodes == 1:
                    return None
                if c.node_rank != 0:
                    self._store_call("set", f"pgrun/done/{c.node_rank}", "1")
                    return None
                failure = self._other_nodes_done(waiting)  # node 0 keeps the store up until every node is done
                if failure is not None:
                    return failure
                if not waiting:
                    return None
            if c.nnodes > 1:
                if c.node_rank != 0:
                    self._store_call("add", f"pgrun/beat/{c.node_rank}", 1)
                failure = self._other_node_failed()
                if failure is not None:
                    return failure
            wait = poll
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._say(f"the job ran past --timeout {c.timeout:g} s: stopping every rank")
                    return _Failure(f"ran past --timeout {c.timeout:g} s", None, 124)
                wait = left if wait is None else min(wait, left)
            self.changed.wait(wait)

    def _failed(self) -> _Failure | None:
        """The first failure of this node's processes, if any."""
        store = self.store_proc
        if store is not None and store.status is not None and any(p.status is None for p in self.procs):
            what = f"{store.label} {_exit_text(store.status) if store.status else 'exited'} while ranks were running"
            return _Failure(what, list(store.tail), _exit_code(store.status) or 1)
        if self.config.mpi:
            return self._mpi_failed()
        failed = [p for p in self.procs if p.status not in (None, 0)]
        if not failed:
            return None
        first = min(failed, key=lambda p: p.exit_order)  # not those that died of its failure meanwhile
        assert first.status is not None
        what = f"{first.label} {_exit_text(first.status)}"
        return _Failure(what, list(first.tail), _exit_code(first.status), first.prefix)

    def _mpi_failed(self) -> _Failure | None:
        assert self.status_dir is not None
        reports = []
        for name in os.listdir(self.status_dir):
            if name.endswith(".json"):
                with contextlib.suppress(OSError, ValueError), open(os.path.join(self.status_dir, name)) as f:
                    reports.append(json.load(f))
        failed = sorted((r for r in reports if r["status"] != 0), key=lambda r: (r["time"], r["rank"]))
        if failed:
            first = failed[0]
            tail = [line.encode(errors="replace") for line in first["tail"]]
            what = f"rank {first['rank']} {_exit_text(first['status'])}"
            prefix = f"[rank {first['rank']}] ".encode() if self.config.prefix else b""
            return _Failure(what, tail, _exit_code(first["status"]), prefix)
        mpiexec = self.procs[0]
        if mpiexec.status not in (None, 0):
            assert mpiexec.status is not None
            said = [line for banner in mpiexec.banners for line in banner.held]  # no rank said why: mpiexec's word
            what = f"mpiexec {_exit_text(mpiexec.status)}"
            tail_is = "what it said" if said else "the end of its stderr"
            return _Failure(what, [*said, *mpiexec.tail], _exit_code(mpiexec.status), tail_is=tail_is)
        return None

    def _tell_nodes(self, failure: _Failure) -> None:
        if self.config.nnodes > 1:
            what = json.dumps({"node": self.config.node_rank, "what": failure.what, "code": failure.code})
            self._store_call("set", _FAILED_KEY, what)

    def _other_node_failed(self) -> _Failure | None:
        try:
            if not self.store.check([_FAILED_KEY]):
                return None
            said = json.loads(self.store.get(_FAILED_KEY))
        except Exception as exc:  # the store is gone: node 0's pgrun is
            self._say(f"lost the job's store ({exc}): stopping this node's ranks")
            return _Failure("lost the job's store", None, 1)
        self._say(f"node {said['node']}: {said['what']}: stopping this node's ranks")
        return _Failure(f"node {said['node']}: {said['what']}", None, int(said["code"]) or 1)

    def _other_nodes_done(self, waiting: dict[int, tuple[int, float | None]]) -> _Failure | None:
        """For node 0, its ranks done: drop from ``waiting`` the nodes that are done too, and
        follow the others' heartbeats; a failure once one has been silent for ``--node-timeout``."""
        now = time.monotonic()
        for node, (beats, since) in list(waiting.items()):
            if self._store_call("check", [f"pgrun/done/{node}"]):
                del waiting[node]
                continue
            now_beats = self._store_call("add", f"pgrun/beat/{node}", 0)
            if since is None or (now_beats is not None and now_beats != beats):
                waiting[node] = (now_beats if now_beats is not None else beats, now)
            elif now - since > self.config.node_timeout:
                what = f"node {node}'s pgrun has not been heard from for {self.config.node_timeout:g} s and is not done"
                self._say(f"{what}: giving up on it")
                return _Failure(what, None, 1)
        return None

    def _store_call(self, op: str, *args: Any) -> Any:
        """``store.op(*args)``, or ``None`` if the store is gone (best effort: nobody to tell)."""
        try:
            return getattr(self.store, op)(*args)
        except Exception:
            return None

    # -- stopping ------------------------------------------------------------------------------
    def _stop(self, sig: int) -> None:
        """Send ``sig`` to every process group still running, wait up to ``--grace`` seconds
        (a further signal to pgrun cuts it short), then ``SIGKILL`` every group (also those
        whose leader exited: what it left behind) and reap every process."""
        if all(p.popen.returncode is not None for p in self.procs):
            return
        signals_seen = len(self.signals)
        for proc in self.procs:
            if proc.status is None:
                _killpg(proc, sig)
        deadline = time.monotonic() + self.config.grace
        while any(p.status is None for p in self.procs) and len(self.signals) <= signals_seen:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self.changed.clear()
            if all(p.status is not None for p in self.procs):
                break
            self.changed.wait(left)
        for proc in self.procs:
            _killpg(proc, signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(10.0)  # SIGKILL cannot be ignored: this reaps it
            for pump in proc.pumps:
                pump.join(5.0)  # the group is dead, so its pipes close

    # -- reporting -----------------------------------------------------------------------------
    def _report(self, failure: _Failure | None) -> None:
        if failure is None or failure.tail is None:
            return
        lines = _traceback(failure.tail)
        if not lines:
            self._say(f"{failure.what}; it wrote nothing to stderr")
            return
        self._say(f"{failure.what}; {failure.tail_is}:")
        for line in lines:
            self._write(sys.stderr, failure.prefix + (line if line.endswith(b"\n") else line + b"\n"))

    def _say(self, text: str) -> None:
        self._write(sys.stderr, f"pgrun: {text}\n".encode())


class _StartError(RuntimeError):
    pass


def _killpg(proc: _Proc, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.popen.pid, sig)


def _exit_text(status: int) -> str:
    if status < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by signal {-status} ({signal.Signals(-status).name})"
        return f"was killed by signal {-status}"
    return f"failed with exit code {status}"


def _exit_code(status: int) -> int:
    return 128 - status if status < 0 else status


_CHAINED: Final = (
    b"During handling of the above exception, another exception occurred:",
    b"The above exception was the direct cause of the following exception:",
)


def _traceback(tail: Sequence[bytes]) -> list[bytes]:
    """What to print last of a failed rank's stderr: its last traceback (with the exceptions
    chained to it), else its last 20 lines."""
    lines = list(tail)
    while lines and not lines[-1].strip():
        lines.pop()
    starts = [i for i, line in enumerate(lines) if line.startswith(b"Traceback (most recent call last):")]
    if not starts:
        return lines[-20:]
    first = starts[-1]
    for start in reversed(starts[:-1]):
        between = [line.strip() for line in lines[start:first] if line.strip()]
        if not any(line in _CHAINED for line in between[-1:]):
            break
        first = start
    return lines[first:]


def _passed(lines: Iterable[bytes], banner: _MpiexecBanner | None) -> Iterator[bytes]:
    """``lines``, less what ``banner`` holds back."""
    if banner is None:
        yield from lines
        return
    for line in lines:
        yield from banner.feed(line)
    yield from banner.close()


class _MpiexecBanner:
    """Holds back, from a stream of mpiexec's lines, what MPICH's mpiexec says when a rank
    fails: a blank line, a rule of ``=``, ``=   BAD TERMINATION OF ONE OF YOUR APPLICATION
    PROCESSES`` and its other ``=   `` lines, a rule, then ``YOUR APPLICATION TERMINATED WITH
    THE EXIT STRING: ...`` and the FAQ's two lines. pgrun says which rank failed and how, with
    its traceback, so the banner in front of that is noise; it is kept in :attr:`held`, for
    the one failure only mpiexec can tell (no rank reported). Every other line passes, in order;
    a blank line or a rule waits for the next line to know whether the banner starts there."""

    START: Final = b"=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES"
    AFTER: Final = (
        b"YOUR APPLICATION TERMINATED WITH THE EXIT STRING",
        b"This typically refers to a problem with your application.",
        b"Please see the FAQ page for debugging suggestions",
    )

    def __init__(self) -> None:
        self.held: list[bytes] = []
        self._pending: list[bytes] = []  # a blank line and/or a rule: the banner's start, maybe
        self._state = "out"  # "out", "in" (between the rules), "after" (the lines after it)

    @staticmethod
    def _rule(line: bytes) -> bool:
        text = line.strip()
        return len(text) >= 20 and text == b"=" * len(text)

    def feed(self, line: bytes) -> list[bytes]:
        """What of ``line`` (and of the lines held for it) passes now."""
        if self._state == "in":
            self.held.append(line)
            if self._rule(line):
                self._state = "after"
            return []
        if self._state == "after":
            if line.startswith(self.AFTER):
                self.held.append(line)
                return []
            self._state = "out"
        if line.startswith(self.START) and self._pending and self._rule(self._pending[-1]):
            self.held += [*self._pending, line]
            self._pending = []
            self._state = "in"
            return []
        if self._rule(line):  # held, with a blank line right before it
            keep = 1 if self._pending and not self._pending[-1].strip() else 0
            passed = self._pending[: len(self._pending) - keep]
            self._pending = [*self._pending[len(passed) :], line]
            return passed
        passed, self._pending = self._pending, []
        if not line.strip():  # held
            self._pending = [line]
            return passed
        return [*passed, line]

    def close(self) -> list[bytes]:
        """The lines still held for a banner that did not come (the stream ended)."""
        passed, self._pending = self._pending, []
        return passed


# -- the rank side of --mpi ------------------------------------------------------------------------


def _mpi_rank(argv: Sequence[str]) -> int:
    """Run one rank under ``mpiexec`` (``python -m pg_core.launch --_mpi-rank DIR --_prefix -- CMD``):
    the rank's variables from the MPI launcher's, its lines prefixed onto this process's
    output (which mpiexec forwards to pgrun), its exit reported in ``DIR/rank{R}.json``, and
    the rank killed if pgrun dies (``PGRUN_PID``)."""
    from .launchers import launched_rank

    status_dir, prefix_flag, sep, *command = argv
    if sep != "--" or not command:
        sys.stderr.write("pg_core.launch --_mpi-rank: usage: DIR --_prefix|--_no-prefix -- COMMAND\n")
        return 2
    found = launched_rank()
    if found is None:
        sys.stderr.write(
            "pg_core.launch --_mpi-rank: not started by an MPI launcher (no PMI_RANK, OMPI_COMM_WORLD_RANK)\n"
        )
        return 2
    rank = found[0]
    local_text = os.environ.get("MPI_LOCALRANKID") or os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK") or str(rank)
    local = int(local_text) if local_text.isdigit() else rank
    env = {**os.environ, "PG_RANK": str(rank), "PG_LOCAL_RANK": str(local), "RANK": str(rank)}
    env["LOCAL_RANK"] = str(local)
    fds = tuple(int(env[v]) for v in ("PMI_FD",) if env.get(v, "").isdigit())  # Hydra's PMI connection
    child = subprocess.Popen(
        [sys.executable, "-c", EXEC_WITH_PARENT, str(os.getpid()), *command],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        pass_fds=fds,
    )
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: child.send_signal(signum))
    prefix = f"[rank {rank}] ".encode() if prefix_flag == "--_prefix" else b""
    tail: collections.deque[bytes] = collections.deque(maxlen=_TAIL_LINES)
    lock = threading.Lock()

    def pump(pipe: IO[bytes], fd: int, keep: collections.deque[bytes] | None) -> None:
        at_start = True
        with pipe:
            for chunk in iter(lambda: pipe.readline(65536), b""):
                if keep is not None:
                    keep.append(chunk)
                with lock, contextlib.suppress(OSError):
                    os.write(fd, prefix + chunk if at_start else chunk)
                at_start = chunk.endswith(b"\n")

    assert child.stdout is not None and child.stderr is not None
    pumps = [
        threading.Thread(target=pump, args=(child.stdout, 1, None), daemon=True),
        threading.Thread(target=pump, args=(child.stderr, 2, tail), daemon=True),
    ]
    for t in pumps:
        t.start()
    launcher, parent = int(os.environ.get("PGRUN_PID", "0")), os.getppid()

    def gone() -> None:  # pgrun or mpiexec's proxy killed: they may not take the rank down, so this does
        with contextlib.suppress(OSError):
            child.kill()
        os._exit(137)

    watch_parent(parent, gone, every_s=0.5, also=lambda: bool(launcher) and not alive(launcher))
    status = child.wait()
    for t in pumps:
        t.join(5.0)
    report = {"rank": rank, "status": status, "time": time.time(), "tail": [b.decode(errors="replace") for b in tail]}
    path = os.path.join(status_dir, f"rank{rank}.json")
    with open(path + ".partial", "w") as f:
        json.dump(report, f)
    os.replace(path + ".partial", path)  # pgrun never reads half a report
    return _exit_code(status)


# -- the store's process ------------------------------------------------------------------------

_STORE_HOST_FLAG: Final = "--_store-host"


def _host_store_main(argv: Sequence[str]) -> int:
    """Host the job's store (``python -m pg_core.launch --_store-host FD HOST PORT TIMEOUT PGRUN_PID``):
    torch's ``TCPStore`` server on the listening socket ``FD`` that pgrun bound, until pgrun
    kills it (the ranks gone), dies (``PR_SET_PDEATHSIG``) or closes this process's stdin."""
    fd_text, host, port_text, timeout_text, pgrun_text = argv
    kill_on_parent_death()
    if os.getppid() != int(pgrun_text):  # pgrun died before the line above
        return 137
    from datetime import timedelta

    from torch.distributed import TCPStore

    store = TCPStore(  # noqa: F841 - the server lives as long as this object
        host,
        int(port_text),
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=float(timeout_text)),
        master_listen_fd=int(fd_text),
    )
    while sys.stdin.buffer.read(65536):
        pass
    os._exit(0)  # without torch's teardown


def _module_main(argv: Sequence[str]) -> int:
    if argv and argv[0] == "--_mpi-rank":
        return _mpi_rank(argv[1:])
    if argv and argv[0] == _STORE_HOST_FLAG:
        return _host_store_main(argv[1:])
    return main(argv)


if __name__ == "__main__":
    sys.exit(_module_main(sys.argv[1:]))
