"""MPI itself, for the backend: loading mpi4py without initialising MPI, initialising it once
with ``MPI_THREAD_MULTIPLE`` when a group first needs it, and torch's dtypes and reduce ops as
MPI's.

Importing ``mpi4py.MPI`` initialises MPI unless ``mpi4py.rc`` says otherwise, so the first
import (if this module makes it) sets ``rc.initialize = False`` and ``rc.finalize = True``:
MPI is initialised by :func:`initialized_mpi` and finalised by mpi4py at exit. If the user
imported ``mpi4py.MPI`` first, MPI is theirs, initialised their way; :func:`thread_level_problem`
says whether pg-mpi can use it.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import torch
from pg_core.algorithms import BINARY_OPS
from pg_core.errors import BackendUnavailableError, CollectiveTimeout
from pg_core.ops import RedOpType

__all__ = [
    "TYPE_NAMES",
    "initialized_mpi",
    "load_mpi",
    "ranks_share_cpus",
    "thread_level_problem",
    "user_op",
    "wrong_integer_ops",
]

#: Where launchers give the number of the job's ranks on this node: MPICH's Hydra, Open MPI.
_LOCAL_RANKS_ENV: Final = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE")

#: Where launchers give the number of the job's ranks: MPICH's Hydra, Open MPI, PMIx.
_WORLD_SIZE_ENV: Final = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE")

#: cgroup v2's CPU limit of this process's container ("max" or "<quota> <period>" in microseconds).
_CPU_MAX: Final = Path("/sys/fs/cgroup/cpu.max")

#: MPI is one per process: initialising it is the one thing done once per process.
_INIT_LOCK: Final = threading.Lock()

#: torch dtype -> the MPI datatype its reductions use (bool as bytes of 0 and 1). float16 and
#: bfloat16 are not here: MPI has no type for them (see :func:`user_op`).
TYPE_NAMES: Final[dict[torch.dtype, str]] = {
    torch.float32: "FLOAT",
    torch.float64: "DOUBLE",
    torch.complex64: "C_FLOAT_COMPLEX",
    torch.complex128: "C_DOUBLE_COMPLEX",
    torch.bool: "UINT8_T",
    torch.uint8: "UINT8_T",
    torch.int8: "INT8_T",
    torch.int16: "INT16_T",
    torch.int32: "INT32_T",
    torch.int64: "INT64_T",
}

#: pg-core's reduce ops as MPI's (AVG and PREMUL_SUM are SUMs with work around them).
OP_NAMES: Final[dict[RedOpType, str]] = {
    RedOpType.SUM: "SUM",
    RedOpType.AVG: "SUM",
    RedOpType.PREMUL_SUM: "SUM",
    RedOpType.PRODUCT: "PROD",
    RedOpType.MIN: "MIN",
    RedOpType.MAX: "MAX",
    RedOpType.BAND: "BAND",
    RedOpType.BOR: "BOR",
    RedOpType.BXOR: "BXOR",
}


def load_mpi() -> Any:
    """The ``mpi4py.MPI`` module, imported (not initialised) the first time with the ``rc``
    settings in the module docstring."""
    if "mpi4py.MPI" not in sys.modules:
        import mpi4py

        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = True
        mpi4py.rc.thread_level = "multiple"
    from mpi4py import MPI

    return MPI


def thread_level_problem(mpi: Any) -> str | None:
    """Why an already initialised (or finalised) MPI cannot serve pg-mpi, or ``None``."""
    if mpi.Is_finalized():
        return "MPI was already finalised in this process"
    if mpi.Is_initialized() and mpi.Query_thread() < mpi.THREAD_MULTIPLE:
        return (
            f"MPI was initialised with thread level {_level_name(mpi, mpi.Query_thread())}, pg-mpi needs "
            "MPI_THREAD_MULTIPLE (point to point comes from the group's helper threads): initialise it with "
            "MPI_THREAD_MULTIPLE, or leave initialising it to pg-mpi"
        )
    return None


def ranks_share_cpus(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this node runs more of the MPI job's ranks than it has CPUs for (see
    :func:`more_ranks_than_cpus`), from the launcher's count of ranks on the node, this
    process's CPU affinity, the machine's CPUs and a cgroup's CPU limit. ``True`` where the
    launcher gives no count: a wait then gives its CPU away between tests, as if shared."""
    for name in _LOCAL_RANKS_ENV:
        value = environ.get(name, "")
        if value.isdigit():
            local = int(value)
            break
    else:
        return True
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
    return more_ranks_than_cpus(local, affinity=affinity, machine=os.cpu_count() or 1, limit=_cpu_limit())


def more_ranks_than_cpus(local: int, *, affinity: int, machine: int, limit: int | None) -> bool:
    """Whether ``local`` ranks on a node have fewer CPUs than ranks. The CPUs are the ones this
    process may run on (``affinity``, 0 where unknown), or the ``machine``'s where it is bound
    to a single one (as ``mpiexec --bind-to core`` or ``pg-core bench --pin-ranks`` leave
    each rank: on a CPU of its own while there are enough), at most a cgroup's ``limit``."""
    cpus = affinity if affinity > 1 else machine
    if limit is not None:
        cpus = min(cpus, limit)
    return local > cpus


def _cpu_limit() -> int | None:
    """The CPUs a cgroup v2 limit allows this process (rounded up), or None where unlimited."""
    try:
        quota, period = _CPU_MAX.read_text().split()[:2]
        return None if quota == "max" else max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        return None


def _level_name(mpi: Any, level: int) -> str:
    names = ("THREAD_SINGLE", "THREAD_FUNNELED", "THREAD_SERIALIZED", "THREAD_MULTIPLE")
    return next((f"MPI_{n}" for n in names if getattr(mpi, n) == level), str(level))


class _Initialising:
    r"""``MPI_Init_thread`` running in a thread of its own, so that whoever needs MPI waits for
    it against a deadline: MPICH's ``MPI_Init`` returns only once every rank of the job has
    called it (Hydra's PMI exchange), so a rank that starts late holds up the others' first
    group without any timeout of theirs. One per process, as MPI is.

    The call goes through ``ctypes`` to the library mpi4py loaded (a foreign call releases
    the GIL; mpi4py's ``MPI.Init_thread`` holds it, which would stop every thread of the
    process, the waiting one included, until the last rank starts). mpi4py takes an MPI
    initialised by someone else as it is; what its own initialisation adds for pg-mpi is the
    error handler, so ``MPI_ERRORS_RETURN`` is set on ``MPI_COMM_WORLD`` and ``MPI_COMM_SELF``
    here (errors become ``MPI.Exception``\ s; the groups' communicators inherit it)."""

    def __init__(self, mpi: Any) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.started = time.monotonic()
        threading.Thread(target=self._run, args=(mpi,), name="pg-mpi-init", daemon=True).start()

    def _run(self, mpi: Any) -> None:
        try:
            init_thread = ctypes.CDLL(mpi.__file__).MPI_Init_thread  # (found among the module's libraries)
            provided = ctypes.c_int(-1)
            code = init_thread(None, None, ctypes.c_int(mpi.THREAD_MULTIPLE), ctypes.byref(provided))
            if code != 0:
                raise RuntimeError(f"MPI_Init_thread returned error code {code}")
            for comm in (mpi.COMM_WORLD, mpi.COMM_SELF):
                comm.Set_errhandler(mpi.ERRORS_RETURN)
            atexit.register(_exit_after_uncaught_exception, mpi)
        except BaseException as exc:
            self.error = exc
        finally:
            self.done.set()


#: The initialisation this process started, once one did (MPI is one per process).
_initialising: list[_Initialising] = []


def initialized_mpi(deadline: float | None = None, who: str = "pg-mpi") -> Any:
    """``mpi4py.MPI``, with MPI initialised (``MPI_THREAD_MULTIPLE``) if it was not, waiting
    for the initialisation until ``deadline`` (``time.monotonic()``; ``None``: no bound).
    Raises :class:`~pg_core.errors.CollectiveTimeout` past the deadline (the initialisation
    goes on, and the next caller waits for it again), and
    :class:`~pg_core.errors.BackendUnavailableError` if the library gives less than
    ``MPI_THREAD_MULTIPLE``. ``who`` names the caller in the timeout's message."""
    mpi = load_mpi()
    with _INIT_LOCK:
        if not _initialising and not mpi.Is_initialized() and not mpi.Is_finalized():
            _initialising.append(_Initialising(mpi))
        starting = _initialising[0] if _initialising else None
    if starting is not None:
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        if not starting.done.wait(left):
            size = next((os.environ[k] for k in _WORLD_SIZE_ENV if os.environ.get(k, "").isdigit()), "all")
            raise CollectiveTimeout(
                f"{who}: MPI_Init has not returned {time.monotonic() - starting.started:.1f} s after this "
                f"process called it: MPICH's MPI_Init waits until every rank of the MPI job ({size} ranks, "
                "started by one mpiexec) has called it, and some have not yet (a rank that starts late, or "
                "that never uses pg-mpi or mpi4py). The initialisation goes on; start every rank's first "
                "mpi group within the timeout, or give the group a longer timeout",
                op="MPI_Init",
            )
        if starting.error is not None:
            raise BackendUnavailableError(
                f"Backend 'mpi' cannot run here: MPI_Init_thread failed: {starting.error}"
            ) from starting.error
    problem = thread_level_problem(mpi)
    if problem is None and mpi.Query_thread() < mpi.THREAD_MULTIPLE:
        problem = (
            f"the MPI library gives thread level {_level_name(mpi, mpi.Query_thread())} where pg-mpi needs "
            "MPI_THREAD_MULTIPLE; use an MPI built with thread support (the mpich wheel is)"
        )
    if problem is not None:
        raise BackendUnavailableError(f"Backend 'mpi' cannot run here: {problem}")
    return mpi


def _exit_after_uncaught_exception(mpi: Any) -> None:
    """At exit, for MPI that pg-mpi initialised: if the program is ending on an uncaught
    exception, leave at once with status 1 instead of letting mpi4py call ``MPI_Finalize``,
    which waits for every other rank to finalise too (MPICH's does): the others, blocked on
    this rank, and this rank would each wait for their timeouts. A rank that leaves without
    finalising is a failed rank to the launcher (Hydra's default ends the job; with
    ``-disable-auto-cleanup`` the others see it as a dead peer), and it ends as Python ends on
    an uncaught exception (status 1; by SIGINT for ``KeyboardInterrupt``). The atexit handlers
    registered before MPI was initialised do not run (as with ``MPI_Abort``); stdout and
    stderr are flushed.

    The interpreter sets ``sys.last_value`` when it prints an uncaught exception; an
    interactive session sets it for every error typed, so there this does nothing."""
    failure = getattr(sys, "last_value", None)
    if failure is None or hasattr(sys, "ps1") or sys.flags.interactive:
        return
    if mpi.Is_initialized() and not mpi.Is_finalized():
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        if isinstance(failure, KeyboardInterrupt):  # Python ends on SIGINT itself: so does this
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(1)


#: The integer reductions :func:`wrong_integer_ops` checks: those whose result can overflow.
_OVERFLOWING: Final = ("SUM", "PROD")

#: Elements per check: more than any vector unit takes at once (64 bytes is AVX-512's), so
#: that a library's vectorised loop runs, not only its scalar tail.
_CHECK_COUNT: Final = 1024

_wrong_ops: frozenset[tuple[torch.dtype, str]] | None = None


def wrong_integer_ops(mpi: Any) -> frozenset[tuple[torch.dtype, str]]:
    """The (integer dtype, MPI op name) pairs, among ``SUM`` and ``PROD``, whose predefined
    ``MPI_Op`` does not wrap around on overflow as torch's integer arithmetic does; pg-mpi
    reduces those through :func:`user_op` instead. Found once per process, with MPI
    initialised, by ``MPI_Reduce_local`` on values that overflow (the per-type functions it
    runs are the ones collectives run).

    Why: Open MPI's ``op/avx`` component (Open MPI 4.1 and later, on CPUs with AVX) adds 8- and
    16-bit integers with saturating instructions: under Open MPI 5.0.11, ``MPI_SUM`` of two
    ``int8`` 127s gave 127 (torch: -2) and of two ``uint8`` 255s gave 255 (torch: 254) in the
    vectorised part of a buffer, while MPICH wraps (open-mpi/ompi#8045, closed as wontfix).
    Asking the library, not its name, keeps MPI's own op wherever it is right: MPICH, an
    Open MPI without ``op/avx`` (``OMPI_MCA_op=^avx``), a CPU without AVX."""
    global _wrong_ops
    with _INIT_LOCK:
        if _wrong_ops is None:
            _wrong_ops = frozenset(
                (dtype, name)
                for dtype, type_name in TYPE_NAMES.items()
                if not dtype.is_floating_point and not dtype.is_complex and dtype is not torch.bool
                for name in _OVERFLOWING
                if not _wraps(mpi, dtype, type_name, name)
            )
    return _wrong_ops


def _wraps(mpi: Any, dtype: torch.dtype, type_name: str, op_name: str) -> bool:
    """Whether MPI's ``op_name`` on ``dtype`` gives torch's result for the type's extremes,
    each reduced with itself (``max + max`` overflows every integer type)."""
    info = torch.iinfo(dtype)
    source = torch.tensor([info.max, info.min], dtype=dtype).repeat(_CHECK_COUNT // 2)
    inout = source.clone()
    expected = (torch.add if op_name == "SUM" else torch.mul)(source, inout)
    mpi_type = getattr(mpi, type_name)

    def buf(t: torch.Tensor) -> list[Any]:
        return [mpi.buffer.fromaddress(t.data_ptr(), t.numel() * t.element_size()), t.numel(), mpi_type]

    getattr(mpi, op_name).Reduce_local(buf(source), buf(inout))
    return torch.equal(inout, expected)


def user_op(mpi: Any, dtype: torch.dtype, kind: RedOpType) -> Any:
    """A new commutative ``MPI_Op`` that reduces ``dtype`` (carried as MPI elements of its
    size: 2-byte ones for float16 and bfloat16) with torch's own elementwise op for ``kind``:
    ``inout = in (op) inout``, rounded or wrapped around to ``dtype`` as torch's CPU ops do
    (the core's table of them, :data:`pg_core.algorithms.BINARY_OPS`). The caller frees it."""
    fn = BINARY_OPS[kind]

    def reduce(inbuf: Any, inoutbuf: Any, _datatype: Any) -> None:
        inout = torch.frombuffer(inoutbuf, dtype=dtype)
        if inout.numel():
            source = torch.frombuffer(bytearray(inbuf), dtype=dtype)  # MPI's input may be read-only
            inout.copy_(fn(source, inout))

    return mpi.Op.Create(reduce, commute=True)
