"""A persistent pool of rank processes that runs test functions on every rank.

Tests of a process-group library must run in real processes talking over real
sockets, and starting a Python process that imports torch costs seconds. A
``RankPool`` starts ``world_size`` worker processes once (forked from two processes
that imported torch, :class:`~pg_core.procs.ForkedRanks`, unless the backend needs
a launcher), hosts a ``TCPStore`` for them, and then runs one function on every
rank per call::

    pool = RankPool(4)
    results = pool.run(body, 8, timeout=60)   # body(ctx, 8) on ranks 0..3

Every call gets a fresh store namespace (``ctx.store``), so calls never see each
other's keys. Guarantees:

* a call never outlives its ``timeout``: past it, every rank's Python stacks are
  dumped (faulthandler), the workers are killed, :class:`RanksFailed` carries the
  dumps, and the next call starts fresh workers;
* a rank that raises fails the call with its traceback; a rank that dies fails
  it too, unless it is listed in ``may_exit``;
* a rank that leaves threads, file descriptors, child processes or shared memory mappings behind after
  the function returned
  fails the call (``check_leaks``), because ``shutdown()`` must release
  everything;
* its workers' logs live in a folder of the temporary directory
  (``pg-core-pool-PID-*``, ``PID`` the controller's) that goes with them: when the pool
  closes, when a dead pool's workers are started afresh, and when the controller exits
  without closing it (an exception, Ctrl-C). A controller killed outright leaves its
  folder; the next pool started on the machine removes the folders of controllers that are
  gone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import os
import pickle
import re
import secrets
import shutil
import sys
import tempfile
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterable
from datetime import timedelta
from multiprocessing.connection import Client, Connection, Listener, wait
from pathlib import Path
from typing import Any

from ..launchers import launch_command
from ..procs import EXIT_UNKNOWN, ForkedRanks, LaunchedRanks, adopt_launched_rank, prepare_rank, tail

__all__ = ["SHM_DIR", "RankContext", "RankPool", "RanksFailed", "leaks", "resources", "shared_memory", "shm_left"]

_LEAK_GRACE_S = 5.0


@dataclasses.dataclass
class RankContext:
    """What a rank function receives: its rank, the world size, a store namespace
    private to this call, and a suggested per-operation timeout in seconds."""

    rank: int
    size: int
    store: Any
    timeout: float
    job: int


class RanksFailed(AssertionError):
    """A pool call failed on at least one rank; the message has every rank's story."""

    def __init__(self, message: str, outcomes: dict[int, str]) -> None:
        super().__init__(message)
        self.outcomes = outcomes


def _fn_ref(fn: Callable[..., Any]) -> tuple[str, str, str | None]:
    try:
        path: str | None = sys.modules[fn.__module__].__file__
    except (KeyError, AttributeError):
        path = None
    return fn.__module__, fn.__qualname__, path


def _resolve(ref: tuple[str, str, str | None]) -> Callable[..., Any]:
    module_name, qualname, path = ref
    module = sys.modules.get(module_name)
    if module is None:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            if path is None:
                raise
            spec = importlib.util.spec_from_file_location(module_name, path)
            if spec is None or spec.loader is None:
                raise
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            spec.loader.exec_module(module)
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj  # type: ignore[no-any-return]


class RankPool:
    """``world_size`` persistent worker processes; see the module docstring."""

    def __init__(
        self,
        world_size: int,
        *,
        op_timeout: float = 30.0,
        env: dict[str, str] | None = None,
        devices: Iterable[str] = (),
        prelude: tuple[Callable[..., Any], tuple[Any, ...]] | None = None,
        launcher: str | None = None,
    ) -> None:
        """``devices``: accelerator types (``"cuda"``) each worker binds (device ``rank % count``)
        and initialises at start, before any call: a device's context belongs to the process,
        so its threads and file descriptors are not counted as a call's leaks. ``prelude``:
        ``(fn, args)`` run on every rank each time the workers (re)start, before any call and
        without the leak check: what a library starts once per process (NCCL's RAS service,
        say) is started there. ``launcher``: a backend's ``BackendSpec.launcher``
        (``"mpiexec"``): the workers are started together by one launcher command
        (:class:`~pg_core.procs.LaunchedRanks`, a dying rank leaving the others running), each
        learning its rank from the launcher's environment; every guarantee above holds."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.op_timeout = op_timeout
        self._env = dict(env or {})
        self._prelude = prelude
        self.launcher = launcher
        accelerators = sorted(set(devices) - {"cpu"})
        if accelerators:
            self._env["PG_CORE_POOL_DEVICES"] = ",".join(accelerators)
        self._ranks: LaunchedRanks | None = None
        self._conns: list[Connection] = []
        self._logs: list[Path] = []
        self._store: Any = None
        self._jobs = 0
        self._lock = threading.Lock()
        self._tmp = ""  # the current workers' folder, made by _start
        self._folders: list[str] = []  # those not removed yet: at most the current one
        weakref.finalize(self, _remove_folders, self._folders)  # also at the controller's exit

    # -- lifecycle ---------------------------------------------------------------
    def _start(self) -> None:
        from torch.distributed import TCPStore

        _remove_folders(self._folders)  # a dead pool's: its logs were reported with its failure
        _remove_abandoned_folders()
        self._tmp = tempfile.mkdtemp(prefix=f"{_FOLDER_PREFIX}{os.getpid()}-")
        self._folders.append(self._tmp)
        self._store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
        authkey = secrets.token_bytes(16)
        # backlog: every rank connects at once; a full accept queue drops SYNs and retries back off for minutes
        listener = Listener(("127.0.0.1", 0), authkey=authkey, backlog=self.world_size + 8)
        try:
            env = dict(os.environ)
            env.update(self._env)
            env["PG_CORE_POOL_AUTHKEY"] = authkey.hex()
            env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
            host, port = listener.address
            worker = [sys.executable, "-m", "pg_core.testing.pool", host, str(port)]
            size, store_port = str(self.world_size), str(self._store.port)
            ranks: LaunchedRanks
            if self.launcher is not None:  # one command starts them all; each reads its rank from the launcher
                command = launch_command(
                    self.launcher, self.world_size, [*worker, "-", size, store_port, self._tmp], keep_going=True
                )
                ranks = LaunchedRanks(command, self.world_size, env=env, log_dir=self._tmp)
            else:
                ranks = ForkedRanks(  # two processes import torch, then fork the ranks
                    [[*worker, str(rank), size, store_port] for rank in range(self.world_size)],
                    env=env,
                    log_dir=self._tmp,
                )
            self._ranks = ranks
            self._logs = ranks.logs
            conns: dict[int, Connection] = {}
            deadline = time.monotonic() + 120.0
            listener._listener._socket.settimeout(1.0)  # type: ignore[attr-defined]
            while len(conns) < self.world_size:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"rank processes did not start within 120 s:\n{self._tails()}")
                for rank, code in enumerate(ranks.poll()):
                    if code is not None and rank not in conns:
                        raise RuntimeError(f"rank {rank} exited with {code} at start:\n{self._tails()}")
                try:
                    conn = listener.accept()
                except (TimeoutError, OSError):
                    continue
                rank, pid = conn.recv()
                if isinstance(ranks, LaunchedRanks):
                    ranks.bind(rank, pid)
                conns[rank] = conn
            self._conns = [conns[r] for r in range(self.world_size)]
        except BaseException:
            listener.close()
            self._kill()
            raise
        listener.close()

    def close(self) -> None:
        """Stop the workers (politely, then by force) and the store; remove their folder."""
        with self._lock:
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    conn.send(None)
            if self._ranks is not None:
                self._ranks.stop(grace_s=10.0, terminate=False)  # told to exit: no SIGTERM
            self._kill()
            _remove_folders(self._folders)
            self._logs = []

    def _kill(self) -> None:
        if self._ranks is not None:
            self._ranks.kill()
        for conn in self._conns:
            conn.close()
        self._ranks, self._conns, self._store = None, [], None

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _tails(self, ranks: Iterable[int] | None = None, limit: int = 4000) -> str:
        out = []
        for rank in ranks if ranks is not None else range(len(self._logs)):
            text = tail(self._logs[rank], chars=limit)
            if text.strip():
                out.append(f"--- rank {rank} output (tail) ---\n{text}")
        if self._ranks is not None:
            text = tail(self._ranks.launcher_log, chars=limit)
            if text.strip():
                out.append(f"--- {self.launcher or 'launcher (forking the ranks)'} output (tail) ---\n{text}")
        return "\n".join(out)

    # -- running -----------------------------------------------------------------
    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout: float = 120.0,
        may_exit: Iterable[int] = (),
        check_leaks: bool = True,
    ) -> list[Any]:
        """Run ``fn(ctx, *args)`` on every rank; return the per-rank results."""
        with self._lock:
            if self._ranks is None:
                self._start()
                if self._prelude is not None:
                    fn_, args_ = self._prelude
                    self._run(fn_, args_, timeout, set(), check_leaks=False)
            return self._run(fn, args, timeout, set(may_exit), check_leaks=check_leaks)

    def _run(
        self, fn: Callable[..., Any], args: tuple[Any, ...], timeout: float, may_exit: set[int], *, check_leaks: bool
    ) -> list[Any]:
        """Run a job on the started workers (the lock held)."""
        ranks = self._ranks
        assert ranks is not None
        self._jobs += 1
        job = self._jobs
        ranks.truncate_logs()  # each job's output starts clean
        payload = pickle.dumps(("run", job, _fn_ref(fn), args, self.op_timeout, check_leaks))
        try:
            for conn in self._conns:
                conn.send_bytes(payload)
        except OSError:
            self._kill()  # a worker is gone: the next call starts a fresh pool
            raise
        results: dict[int, Any] = {}
        outcomes: dict[int, str] = {}
        pending = dict(enumerate(self._conns))
        deadline = time.monotonic() + timeout
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for ready in wait(list(pending.values()), timeout=remaining):
                rank = next(r for r, c in pending.items() if c is ready)
                conn = pending[rank]
                del pending[rank]
                try:
                    status, value = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    # its sockets close before it is reaped: wait for the exit itself
                    code = ranks.wait(rank, timeout=10)
                    if rank in may_exit:
                        results[rank] = None
                    else:
                        said: object = code
                        if code is None:
                            said = "unknown: it closed its connection but is still running"
                        elif code == EXIT_UNKNOWN and self.launcher is not None:
                            said = f"unknown: its launcher, {self.launcher}, reaped it"
                        outcomes[rank] = f"died (exit code {said})"
                    continue
                if status == "ok":
                    results[rank] = value
                else:
                    outcomes[rank] = value
        died = len(ranks.running()) < self.world_size
        if pending:
            stacks = ranks.dump_stacks(list(pending))
            for rank in pending:
                outcomes[rank] = f"did not finish within {timeout:g} s; its stacks:\n{stacks.get(rank, '')}"
            self._kill()
        elif died:
            self._kill()  # a rank is gone: the next call starts a fresh pool
        if outcomes:
            lines = [f"{fn.__qualname__} failed on {len(outcomes)} of {self.world_size} ranks (job {job}):"]
            for rank in sorted(outcomes):
                lines.append(f"=== rank {rank}: {outcomes[rank]}")
            told = set(pending)  # a hung rank's output tail is the stack dump already shown
            tails = self._tails(sorted(set(outcomes) - told)) if self._logs else ""
            raise RanksFailed("\n".join(lines) + ("\n" + tails if tails else ""), outcomes)
        return [results.get(r) for r in range(self.world_size)]


#: The workers' folders in the temporary directory: this, the controller's pid, ``-``, a suffix.
_FOLDER_PREFIX = "pg-core-pool-"
_FOLDER = re.compile(re.escape(_FOLDER_PREFIX) + r"(\d+)-")


def _remove_folders(folders: list[str]) -> None:
    while folders:
        shutil.rmtree(folders.pop(), ignore_errors=True)


def _remove_abandoned_folders() -> None:
    """Remove the workers' folders of controllers that are gone (killed before they could)."""
    with contextlib.suppress(OSError):
        for entry in os.scandir(tempfile.gettempdir()):
            found = _FOLDER.match(entry.name)
            if found is not None and entry.is_dir(follow_symlinks=False) and not _running(int(found[1])):
                shutil.rmtree(entry.path, ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


# -- the worker side ---------------------------------------------------------------


Resources = tuple[set[threading.Thread], set[str], set[int], set[str]]

#: Where POSIX shared memory segments live (``shm_open``, ``multiprocessing.shared_memory``, MPI's).
SHM_DIR = "/dev/shm"


def resources() -> Resources:
    """This process's live threads, open file descriptors (``"fd->target"``: sockets, pipes,
    event fds, files, whatever ``/proc/self/fd`` shows), child processes and shared memory
    mappings (the ``/dev/shm`` files it maps, :func:`shared_memory`): what :func:`leaks`
    compares against. (All but the threads are read from ``/proc``, so that part is Linux only.)"""
    fds = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                fds.add(f"{fd}->{os.readlink(f'/proc/self/fd/{fd}')}")
    children: set[int] = set()
    with contextlib.suppress(OSError):
        for task in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/children") as f:
                children.update(int(pid) for pid in f.read().split())
    return set(threading.enumerate()), fds, children, shared_memory()


def shared_memory() -> set[str]:
    """The shared memory segments this process maps now: the paths under :data:`SHM_DIR` in
    ``/proc/self/maps``, with `` (deleted)`` where the segment was unlinked but is still mapped
    (its memory stays until the mapping goes). A segment only held open shows among the file
    descriptors instead; one neither mapped nor open, but never unlinked, is no process's: see
    :func:`shm_left`."""
    found: set[str] = set()
    with contextlib.suppress(OSError), open("/proc/self/maps") as f:
        for line in f:
            at = line.find(SHM_DIR + "/")
            if at >= 0:
                found.add(line[at:].rstrip("\n"))
    return found


def shm_left(seen: Iterable[str]) -> list[str]:
    """Of the segments ``seen`` (paths :func:`shared_memory` or the file descriptors gave while a
    group was alive), those that still exist in :data:`SHM_DIR`: after every member shut down,
    a segment the backend made and never unlinked stays in memory until the machine reboots."""
    left = []
    for path in sorted(set(seen)):
        name = path.removesuffix(" (deleted)")
        if not path.endswith(" (deleted)") and name.startswith(SHM_DIR + "/") and os.path.exists(name):
            left.append(name)
    return left


def _described(fd: str) -> str:
    """``"7->socket:[1234]"`` with what the socket is (protocol, local and remote address or
    path, read from ``/proc/net``), so a leak report says whose it is."""
    if "socket:[" not in fd:
        return fd
    inode = fd.rsplit("[", 1)[1].rstrip("]")
    for table, inode_column in (("tcp", 9), ("tcp6", 9), ("udp", 9), ("udp6", 9), ("unix", 6)):
        with contextlib.suppress(OSError), open(f"/proc/net/{table}") as f:
            next(f, None)
            for line in f:
                fields = line.split()
                if len(fields) > inode_column and fields[inode_column] == inode:
                    where = fields[7] if table == "unix" and len(fields) > 7 else " -> ".join(fields[1:3])
                    return f"{fd} ({table} {where})"
    return fd


def leaks(before: Resources, grace_s: float = _LEAK_GRACE_S) -> str | None:
    """Threads, file descriptors, child processes and shared memory mappings left behind since ``before`` (a
    :func:`resources` reading), or ``None``. Where something is left, garbage in reference
    cycles (an exception's traceback holding a closed backend's frames) is collected before
    anything is called a leak: what only the collector would free is not a leak; what is
    still referenced is, a module-level cache included. (Collecting only then, not before
    every reading: a full collection in a process that imported torch takes about 0.2 s of
    CPU, and most calls leave nothing.) Threads that are ending, descriptors closing and
    children exiting get ``grace_s``."""
    import gc

    deadline = time.monotonic() + grace_s
    collected = False
    while True:
        threads, fds, children, shm = resources()
        extra = [t for t in threads - before[0] if t.is_alive()]
        opened = fds - before[1]
        started = children - before[2]
        mapped = shm - before[3]
        if not extra and not opened and not started and not mapped:
            return None
        if not collected:
            gc.collect()
            collected = True
            continue
        if time.monotonic() > deadline:
            parts = []
            if extra:
                parts.append(f"threads {[t.name for t in extra]}")
            if opened:
                parts.append(f"file descriptors {[_described(fd) for fd in sorted(opened)]}")
            if started:
                parts.append(f"child processes {sorted(started)}")
            if mapped:
                parts.append(f"shared memory mappings {sorted(mapped)}")
            return "leaked " + " and ".join(parts)
        for t in extra:
            t.join(timeout=0.1)
        if not extra:
            time.sleep(0.05)  # a socket closing in the kernel, a child exiting: no event to wait on


def _bind_devices(rank: int) -> None:
    """Bind and initialise the accelerators the pool was made for (``RankPool(devices=)``)."""
    import torch

    for device_type in filter(None, os.environ.get("PG_CORE_POOL_DEVICES", "").split(",")):
        module = getattr(torch, device_type)
        module.set_device(rank % max(module.device_count(), 1))
        torch.empty(1, device=device_type)  # the context exists now, not during the first call


def _worker(host: str, port: int, rank: int, size: int, store_port: int) -> None:
    from torch.distributed import PrefixStore, TCPStore

    prepare_rank()  # stacks on SIGUSR1 for the parent's dump_stacks; one intra-op thread
    _bind_devices(rank)
    conn = Client((host, port), authkey=bytes.fromhex(os.environ["PG_CORE_POOL_AUTHKEY"]))
    conn.send((rank, os.getpid()))
    base = TCPStore("127.0.0.1", store_port, is_master=False, timeout=timedelta(seconds=60))
    while True:
        try:
            raw = conn.recv_bytes()
        except (EOFError, OSError):
            return
        message = pickle.loads(raw)
        if message is None:
            return
        _, job, ref, args, op_timeout, check_leaks = message
        before = resources()
        ctx = RankContext(rank, size, PrefixStore(f"pool/job{job}", base), op_timeout, job)
        try:
            fn = _resolve(ref)
            reply: tuple[str, Any] = ("ok", fn(ctx, *args))
        except BaseException as exc:
            reply = ("error", f"raised {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        if reply[0] == "ok" and check_leaks:
            leak = leaks(before)
            if leak is not None:
                reply = ("error", f"returned, but {leak}")
        try:
            data = pickle.dumps(reply)
        except Exception as exc:
            data = pickle.dumps(("error", f"result is not picklable: {exc!r}"))
        conn.send_bytes(data)
        sys.stdout.flush()
        sys.stderr.flush()


if __name__ == "__main__":
    # host port RANK size store_port [log_dir]: RANK "-" when a launcher started the workers
    _rank = adopt_launched_rank(sys.argv[6]) if sys.argv[3] == "-" else int(sys.argv[3])
    _worker(sys.argv[1], int(sys.argv[2]), _rank, int(sys.argv[4]), int(sys.argv[5]))
