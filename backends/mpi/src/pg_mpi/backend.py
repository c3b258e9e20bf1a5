"""``MPIBackend``: a group's operations on an MPI communicator of its own, through mpi4py.

**Forming.** A group maps its ranks to ``MPI_COMM_WORLD`` ranks through its store (each
member sets its world rank, world size and launcher job id under its group rank), checks
that they are one MPI job (the same world size and job id, distinct world ranks, and a
ring of messages over ``MPI_COMM_WORLD`` that each member receives from the world rank its
neighbour claimed, within the group's timeout), then builds its communicator with
``MPI_Comm_create_group`` over exactly its members: several groups per process, overlapping
or not, and ``new_group`` subgroups the same way. Members that are not one job raise
:class:`~pg_core.errors.BackendUnavailableError` saying how to launch. A subgroup made by
``ProcessGroup.split`` on an ``mpi`` group that stays on ``mpi`` takes its communicator from
``MPI_Comm_split`` of the parent's instead (:meth:`MPIBackend.split`, backend API 1.6:
``ctx.split_from``), with no store exchange and no handshake: the members are the parent's.
MPI has no non-blocking ``MPI_Comm_split``, so that call waits without the group's timeout;
in practice it returns at once, because the core calls it right after the split's
``all_gather_object``, in which every member of the parent was just heard from (only a
member dying in between leaves the others waiting, as in ``MPI_Comm_create_group``). A
communicator no subgroup took (its formation failed) is freed (:meth:`MPIBackend.release_split`).
MPI is initialised (``MPI_THREAD_MULTIPLE``) by the first group that needs it, in a thread of
its own waited for until the group's timeout (MPICH's ``MPI_Init`` waits for every rank of the
job: :func:`~pg_mpi._mpi.initialized_mpi`); the initialisation, the store exchange and the
handshake share one deadline. ``shutdown`` and ``abort`` free the communicator, however it was
made; mpi4py finalises MPI at exit.

**Operations** are MPI's own, on the tensors' memory (no copy) where the call's buffers are
one tensor each: ``Iallreduce``, ``Ibcast``, ``Ireduce``, ``Iallgather``,
``Ireduce_scatter_block``, ``Ialltoallv``, ``Igather``, ``Iscatter``, ``Ibarrier``,
``Isend``/``Improbe``+``Imrecv``. Lists of tensors are joined into (or split out of) one
buffer. A blocking call polls its request (``MPI_Test`` back to back, yielding the CPU
between tests where the node has more of the job's ranks than CPUs, then backing off to 1 ms
naps) until it completes or its timeout passes (:class:`~pg_core.errors.CollectiveTimeout`);
an asynchronous one returns a :class:`~pg_core.work.Work` that tests the request when it is
waited for or polled (API 1.2: no thread per operation). A blocking ``all_reduce`` of a
dtype and op MPI reduces itself also has a prepared form (API 1.5: the datatype and op looked
up once), which the core calls once a call of that kind has gone the full way. ``AVG`` is MPI's sum divided by the
group size, ``PREMUL_SUM`` the input times the factor summed by MPI; ``float16`` and
``bfloat16`` reduce through user-defined ``MPI_Op``\\ s that run torch's elementwise ops, and so
do integer sums and products where the MPI library's do not wrap around as torch's do (Open
MPI's AVX sums of 8- and 16-bit integers saturate; see :func:`~pg_mpi._mpi.wrong_integer_ops`).

**Point to point.** Sends up to the declared eager limit (:data:`~pg_mpi.plugin.EAGER_LIMIT`,
4 KiB) never wait for their receivers: ``send`` (and ``isend``, whose work is then done at
once) is ``MPI_Bsend`` on a communicator given MPI's automatic buffer (MPI 4.1's
``MPI_Comm_attach_buffer`` with ``MPI_BUFFER_AUTOMATIC``; MPI copies the message in C as it
needs), or, where the library predates it, a copy of this backend's own posted with
``MPI_Isend``, at most the option ``max_send_copy_bytes`` (256 MiB) of such copies in flight at
once (beyond it a send first waits, at most its timeout, for earlier ones to be received).
Above the limit nothing is copied: ``send`` is ``MPI_Isend`` from the tensor's memory, polled
until MPI is done with it (for a large message, once the receiver has posted the matching
receive: MPI's standard mode, as ``comm.Send``), and ``isend``'s work completes then. A send
that times out stays posted (MPI takes no send back), its tensor held. ``send_bytes`` copies
the message's parts into one buffer and posts it with ``MPI_Isend`` (so it returns at once,
within the same budget); ``shutdown`` waits for the copies still in flight. A receive is
``MPI_Irecv`` straight into the tensor (no probe, no extra message): a message of another size
is refused with :class:`~pg_core.errors.CollectiveMismatchError` from the receive's status
(MPI's truncation error where it is longer: MPI then has written the part that fits, and
nothing else), and the message is consumed, so the stream stays in step; ``recv_bytes``
matches its message first (``MPI_Improbe``) to learn its size, then receives it with one
receive; ``irecv`` progresses when its work is waited for or polled. A receive from any source
is the same receive from ``MPI_ANY_SOURCE``, returning the sender's rank.

**Faults.** MPI reports no peer's death to the others, and MPICH's Hydra ends the job when a
rank dies (with ``-disable-auto-cleanup`` too, as measured: the README's Faults); a survivor
that lives on sees its operation end at its timeout with ``CollectiveTimeout``. A collective
that times out stays with MPI (it cannot be cancelled): its request and buffers are kept, and
the rank tells the others (a notice above the core's tags), so that a rank that comes to that
collective late is refused instead of completing against it (:meth:`MPIBackend._give_up`).
The core refuses the group's later collectives, as after any collective failure. A receive
that times out is cancelled and waited for, so nothing is written into its tensor afterwards.
A rank that aborts tells the others the same way (:meth:`MPIBackend._farewell`, never waiting
on a peer); their waits look for notices where they read their own closed state, and an
operation that needs the aborted rank raises :class:`~pg_core.errors.PeerFailureError`
("rank R aborted") within a millisecond instead of waiting for its timeout, its receive
withdrawn or its collective kept as above.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

import torch
from pg_core.backend import Backend, BackendContext, tensor_bytes
from pg_core.errors import (
    BackendUnavailableError,
    CollectiveMismatchError,
    CollectiveTimeout,
    GroupClosedError,
    PeerFailureError,
)
from pg_core.ops import RedOpType, ReduceOp
from pg_core.store import wait_for
from pg_core.work import Work

from ._mpi import OP_NAMES, TYPE_NAMES, initialized_mpi, ranks_share_cpus, user_op, wrong_integer_ops
from .plugin import EAGER_LIMIT, HOW_TO_LAUNCH, MAX_TAG

__all__ = ["MPIBackend"]

#: How long a wait tests its request back to back, before it naps between tests, the nap
#: doubling from 10 us to :data:`_MAX_NAP`. MPI progresses an operation only inside MPI calls,
#: on every rank, so a rank that naps while its peers wait for its part delays them all: no
#: naps at first. Where the node has more of the job's ranks than CPUs (3 ranks on 2 cores:
#: :func:`~pg_mpi._mpi.ranks_share_cpus`), the wait gives the CPU away (``sched_yield``)
#: before each test, since a spinning rank keeps the one whose part it waits for off the CPU:
#: that took a 4-byte all_reduce at 3 ranks on 2 cores from about 440 to 36 us (median).
#: Where each rank has a CPU, it yields only every :data:`_CHECK_EVERY` tests: a
#: ``sched_yield`` is a system call of 1.1-1.6 us on this project's 2-vCPU machine, a quarter
#: of a 4-byte all_reduce at 2 ranks (docs/benchmarks.md, "pg-mpi's waits").
_YIELD_S: Final = 2e-2
_MAX_NAP: Final = 1e-3

#: While testing back to back, a wait reads the clock and the closed state (and, where each
#: rank has a CPU, yields) every this many polls, not every poll: where ranks share a core,
#: what a wait does between tests comes back many times over (docs/decisions.md: "pg-mpi's
#: waits poll without a lock"). A poll and a yield take about a microsecond, so a deadline
#: or an abort is seen within a few tens of them.
_CHECK_EVERY: Final = 16

#: The tests of one burst between two such checks (a ``for`` over it is the loop's only work
#: between tests, so that a test follows the last one as soon as it can).
_BURST: Final = range(_CHECK_EVERY)

#: How a wait names its operation in an error: the name, or a callable that makes it (where
#: making it would cost the call that does not fail).
_What = str | Callable[[], str]

#: Give the CPU to another runnable process (a rank sharing this core), keeping the GIL free.
_yield: Final[Callable[[], None]] = getattr(os, "sched_yield", lambda: time.sleep(0))

#: The default of the option ``max_send_copy_bytes``: how many bytes of copied messages
#: (``send``, ``send_bytes``) may wait for their receivers at once; a send beyond it waits for
#: earlier ones to be received. ``isend`` copies nothing (MPI reads the tensor).
_SEND_COPY_BUDGET: Final = 256 << 20

#: How long withdrawing a receive that timed out may wait for MPI to finish with it: one that
#: MPI had already matched is being written and completes; past this, the error says so.
_WITHDRAW_S: Final = 5.0

#: How long a rank that gave up on a collective drives its notices to the others (see
#: ``MPIBackend._give_up``): eager messages, delivered within microseconds by a live peer.
_NOTICE_S: Final = 1.0

#: How long ``abort`` drives its notices to the others (see ``MPIBackend._farewell``): abort
#: never waits on a peer, and MPICH moves a small message within the MPI calls that post and
#: test it, so this bound is rarely reached.
_FAREWELL_S: Final = 5e-2

#: A notice is 16 bytes: 8 that name the group formation (``MPIBackend._mark``), so that a
#: notice left unread on a freed communicator is never taken for one of a later communicator
#: to which MPI gave the same context, then the collective's number, big-endian (a give-up
#: notice), or these 8 bytes (an abort notice: no collective has that number).
_ABORTED: Final = b"\xff" * 8

#: After this long without a collective, a rank probes for notices up to this many times
#: before its next (see ``MPIBackend._noticed``): messages that queued meanwhile are taken in
#: one per probe.
_IDLE_S: Final = 1e-3
_IDLE_PROBES: Final = 64

#: Environment variables that name a launcher's job (where it sets one); Hydra sets none.
_JOB_ENV: Final = ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "SLURM_JOB_ID", "SLURM_STEP_ID")

#: dtypes MPI has no type for: carried as 2-byte elements, reduced by torch in a user MPI_Op.
_TORCH_REDUCED: Final = frozenset({torch.float16, torch.bfloat16})


class MPIBackend(Backend):
    """One MPI communicator per group formation (see the module docstring)."""

    #: collectives take ``async_op`` and launch MPI's non-blocking forms (API 1.2)
    launches = True

    def __init__(self, ctx: BackendContext) -> None:
        self.ctx, self.rank, self.size = ctx, ctx.rank, ctx.size
        #: forming (MPI's initialisation, the store exchange, the handshake) ends by this
        deadline = time.monotonic() + ctx.timeout
        self._mpi = initialized_mpi(deadline, f"Backend 'mpi' of group {ctx.group_name!r} rank {ctx.rank}")
        #: bytes of copied messages a send may leave in flight (option ``max_send_copy_bytes``)
        self._copy_budget = ctx.byte_option("max_send_copy_bytes", _SEND_COPY_BUDGET)
        #: whether a wait yields the CPU before each test of its request (see :data:`_YIELD_S`)
        self._yield_each = ranks_share_cpus()
        #: (integer dtype, MPI op name) that this MPI does not wrap around as torch does: torch reduces them
        self._wrong_ops = wrong_integer_ops(self._mpi)
        #: why operations are refused (shutdown or abort), or None
        self._closed: str | None = None
        self._lock = threading.Lock()
        #: an entry per polling loop (or split) running now, so that abort frees the communicator
        #: after they leave it. A list: its append and pop are atomic, so a poll takes no lock
        #: (where ranks share cores, a lock and a notify per call cost a small all_reduce tens
        #: of microseconds); only a loop that leaves after a close wakes the closer.
        self._polling: list[None] = []
        self._idle = threading.Condition(self._lock)
        #: sends in flight, and how many of their bytes are copies (held against the budget)
        self._sends: list[_Send] = []
        self._copied = 0
        self._send_errors: dict[int, BaseException] = {}
        #: user-defined MPI_Ops by (dtype, reduce op), made on first use, freed at shutdown
        self._user_ops: dict[tuple[torch.dtype, RedOpType], Any] = {}
        #: the ranks a collective needs besides this one
        self._others: Final = tuple(r for r in range(self.size) if r != self.rank)
        #: the tag of the notices a rank sends the others when it gives up on a collective or
        #: aborts: above every tag the core uses (``MAX_TAG``), where the library's bound leaves
        #: room (MPICH's does)
        tag_ub = int(self._mpi.COMM_WORLD.Get_attr(self._mpi.TAG_UB))
        self._notice_tag: int | None = MAX_TAG + 1 if tag_ub > MAX_TAG else None
        #: the notice this rank sends when it aborts, and the one it takes a peer's abort by
        #: what every notice of this formation starts with (see _ABORTED)
        self._mark: Final = hashlib.sha256(ctx.group_uid.encode()).digest()[:8]
        #: peer -> the first collective it gave up on (after its timeout), from its notices
        self._gave_up: dict[int, int] = {}
        #: peers that aborted, from their notices: operations that need them are refused
        self._aborted_peers: set[int] = set()
        #: sends since one last looked for notices (see :meth:`_check`)
        self._sent_unheard = 0
        #: operations that timed out or lost a peer but that MPI may still complete (a collective
        #: cannot be cancelled), and abort's notices: their requests and the buffers MPI reads
        #: and writes, kept as long as this backend
        self._abandoned: list[tuple[Any, object]] = []
        self._comm: Any = None  # (forming polls, and a poll looks for notices where there is a communicator)
        split_from = getattr(ctx, "split_from", None)  # (a BackendContext of pg-core before 1.6 has none)
        self._comm = (
            _form(ctx, self._mpi, self._wait_until, deadline)
            if split_from is None
            else _adopt(ctx, self._mpi, split_from)
        )
        #: sends up to the eager limit are MPI's buffered sends (the communicator has MPI's
        #: automatic buffer), else copies of this backend's own
        self._buffered = _attach_automatic_buffer(self._mpi, self._comm)
        #: collectives this rank posted on the communicator (the core hands them over one at a time)
        self._seq = 0
        #: when this rank's last collective completed (``time.monotonic()``)
        self._active = 0.0
        #: asynchronous all_reduce by (dtype, reduce op type): its launch (:meth:`_launcher`), or
        #: None where it takes the general way
        self._launchers: dict[tuple[torch.dtype, RedOpType], Callable[[torch.Tensor, float], Work] | None] = {}

    @property
    def comm(self) -> Any:
        """The group's ``mpi4py.MPI.Intracomm`` (its ranks are the group's ranks)."""
        return self._comm

    # -- a native split (API 1.6) ---------------------------------------------------------
    def split(self, color: int | None, rank: int, *, timeout: float) -> Any:
        """``MPI_Comm_split`` of the group's communicator (``MPI_UNDEFINED`` for ``color=None``),
        ranked by ``rank``: the new ``Intracomm``, or ``None`` where this member joins none.
        MPI has no non-blocking form, so ``timeout`` cannot bound it (see the module
        docstring); an ``abort`` from another thread waits for it (at most 5 s) before it frees
        the communicator."""
        mpi = self._mpi
        self._polling.append(None)
        try:
            made = self._posting("split")[0].Split(mpi.UNDEFINED if color is None else color, rank)
        except mpi.Exception as exc:
            raise self._error(exc, "split") from exc
        finally:
            self._left()
        return None if made == mpi.COMM_NULL else made

    def release_split(self, handle: Any) -> None:
        """Free a communicator :meth:`split` made that no subgroup's backend took (its subgroup
        failed to form; backend API 1.7). ``MPI_Comm_free`` is collective in the standard, but
        MPICH does not wait in it for the other members (they free theirs the same way, or when
        their subgroup's backend shuts down)."""
        if handle != self._mpi.COMM_NULL:
            handle.Free()

    # -- waiting --------------------------------------------------------------------------
    def _wait_until(
        self, ready: Callable[[], bool], deadline: float, *, what: str = "", needs: Sequence[int] = ()
    ) -> bool:
        """Whether ``ready()`` became true before ``deadline`` passed: tested now, then polled
        (:meth:`_poll`, with ``what`` and ``needs``). Raises ``GroupClosedError`` once aborted."""
        return ready() or self._poll(ready, deadline, what=what, needs=needs)

    def _poll(self, ready: Callable[[], bool], deadline: float, *, what: _What = "", needs: Sequence[int] = ()) -> bool:
        """Poll ``ready()``, which was just false, until it is true (``True``) or ``deadline``
        passes (``False``): for :data:`_YIELD_S` back to back, with a ``sched_yield`` before
        each poll where ranks share CPUs, reading the clock and the closed state and looking
        for the peers' notices (and yielding, where they do not) only every
        :data:`_CHECK_EVERY` polls; after that, naps between polls, doubling to 1 ms. Raises
        ``GroupClosedError`` once aborted, and ``PeerFailureError`` (the operation ``what``)
        once a rank in ``needs``, the ranks the operation waits for, told this one it aborted
        (:meth:`_listen`; the caller withdraws or keeps what it posted)."""
        self._polling.append(None)
        try:
            naps_from = time.monotonic() + _YIELD_S
            burst = _BURST
            while True:
                if self._yield_each:
                    for _ in burst:
                        _yield()
                        if ready():
                            return True
                else:
                    for _ in burst:  # (tests back to back: each loop step is a test's latency)
                        if ready():
                            return True
                    _yield()
                if self._closed is not None:
                    raise self._closed_error()
                self._listen(what, needs)
                now = time.monotonic()
                if now >= deadline:
                    return False
                if now >= naps_from:
                    break
            nap = 1e-5
            while not ready():
                if self._closed is not None:
                    raise self._closed_error()
                self._listen(what, needs)
                if time.monotonic() >= deadline:
                    return False
                time.sleep(nap)
                nap = min(nap * 2, _MAX_NAP)
            return True
        finally:
            self._left()

    def _left(self) -> None:
        """A polling loop (or split) leaves: after a close, wake the closer waiting for it
        (:meth:`_free` marks the backend closed before it waits, so a loop that saw it open
        had left before the closer looked)."""
        self._polling.pop()
        if self._closed is not None:
            with self._lock:
                self._idle.notify_all()

    def _check(self, what: str, peers: Sequence[int] = (), *, sending: bool = False) -> Any:
        """The communicator, or the error this backend's state calls for, before anything is
        posted. A send to a peer known to have aborted is refused; a send returns at once, so
        one send in :data:`_CHECK_EVERY` also looks for notices (a probe on every send cost a
        4-byte send_recv at 2 ranks 0.4-0.9 us, 6-9 %). A receive is not refused here, since MPI
        still delivers what the peer sent before it aborted (its wait raises where nothing came)."""
        if self._closed is not None:
            raise self._closed_error(what)
        if sending:
            self._sent_unheard += 1
            if self._sent_unheard >= _CHECK_EVERY:
                self._sent_unheard = 0
                self._listen(what, peers)
            elif self._aborted_peers:
                self._refuse_aborted(what, peers)
        for peer in peers:
            failed = self._send_errors.get(peer)
            if failed is not None:
                raise PeerFailureError(f"{what}: an earlier send to rank {peer} failed: {failed}", peers=[peer])
        return self._comm

    def _closed_error(self, what: str = "") -> GroupClosedError:
        """Why an operation (``what``) is refused once ``shutdown`` or ``abort`` closed this backend."""
        prefix = f"{what}: " if what else ""
        return GroupClosedError(f"{prefix}group {self.ctx.group_name!r}: backend 'mpi' was {self._closed}")

    def _error(self, exc: BaseException, what: str, peers: Sequence[int] = ()) -> BaseException:
        """An ``MPI.Exception`` as pg-core's error (a failed or aborted process: ``PeerFailureError``)."""
        mpi = self._mpi
        if isinstance(exc, mpi.Exception):
            failed = {getattr(mpi, name, None) for name in ("ERR_PROC_FAILED", "ERR_PROC_ABORTED")} - {None}
            text = f"{what}: MPI failed: {exc.Get_error_string()}"
            if exc.Get_error_class() in failed:
                return PeerFailureError(text, peers=peers)
            return RuntimeError(text)
        return exc

    # -- notices: a peer gave up on a collective, or aborted --------------------------------
    def _listen(self, what: _What, needs: Sequence[int]) -> None:
        """Take in the notices that have come (one ``MPI_Iprobe``, 0.2-0.4 us, where none has),
        then raise ``PeerFailureError`` for ``what`` if a rank in ``needs`` aborted."""
        comm, tag = self._comm, self._notice_tag
        if comm is not None and tag is not None and comm.Iprobe(self._mpi.ANY_SOURCE, tag):
            self._take_notices(comm, patience=1)
        if needs and self._aborted_peers:
            self._refuse_aborted(what, needs)

    def _take_notices(self, comm: Any, *, patience: int) -> None:
        """Receive the notices waiting on ``comm`` until ``patience`` probes in a row find none
        (MPICH takes in about one waiting message per probe), recording who gave up on which
        collective and who aborted. A notice of another formation is dropped."""
        mpi, tag = self._mpi, self._notice_tag
        status = mpi.Status()
        misses = 0
        while tag is not None and misses < patience:
            message = comm.Improbe(mpi.ANY_SOURCE, tag, status)
            if message is None:
                misses += 1
                continue
            misses = 0
            note = bytearray(16)
            message.Recv([note, mpi.BYTE])
            peer = int(status.Get_source())
            if note[:8] != self._mark:  # another formation's, left on a communicator MPI freed
                continue
            if note[8:] == _ABORTED:
                self._aborted_peers.add(peer)
                continue
            given_up = int.from_bytes(note[8:], "big")
            self._gave_up[peer] = min(self._gave_up.get(peer, given_up), given_up)

    def _refuse_aborted(self, what: _What, needs: Sequence[int]) -> None:
        """Raise ``PeerFailureError`` for ``what`` if ranks in ``needs`` aborted (they said so)."""
        lost = [p for p in needs if p in self._aborted_peers]
        if lost:
            raise PeerFailureError(
                f"{what if isinstance(what, str) else what()}: {'; '.join(f'rank {p} aborted' for p in lost)} (backend 'mpi' of group "
                f"{self.ctx.group_name!r}; {'it' if len(lost) == 1 else 'they'} said so on leaving): the operation "
                f"cannot complete; form a new group without {'it' if len(lost) == 1 else 'them'} (shrink() this one)",
                peers=lost,
            )

    def _keep(self, request: Any, buffers: object) -> None:
        """Hold an operation MPI may still complete (its request and buffers) as long as this backend."""
        with self._lock:
            self._abandoned.append((request, buffers))

    def _timeout(self, what: str, timeout: float, peers: Sequence[int] = ()) -> CollectiveTimeout:
        who = f"rank {', '.join(map(str, peers))}" if peers else "the other ranks (MPI does not say which)"
        return CollectiveTimeout(f"{what}: not complete after {timeout:g} s; waiting for {who}", op=what, peers=peers)

    # -- collectives given up on -----------------------------------------------------------
    def _posting(self, what: str) -> tuple[Any, int]:
        """The communicator and the number of the collective about to be posted on it, unless a
        peer already gave up on that collective (see :meth:`_give_up`): then this rank's call
        would complete against the peer's abandoned one (MPI matches collectives by order
        alone), and it is refused with ``CollectiveTimeout`` naming that peer."""
        comm = self._check(what)
        self._seq += 1
        tag = self._notice_tag
        if self._gave_up or self._aborted_peers or (tag is not None and self._noticed(comm)):
            self._refuse_abandoned(comm, what, self._seq)
        return comm, self._seq

    def _noticed(self, comm: Any) -> bool:
        """Whether a notice (a peer gave up on a collective) waits on ``comm``. MPICH's
        ``MPI_Iprobe`` looks before it progresses, and each progress takes in about one message
        that arrived while this process made no MPI call: one probe (0.2-0.4 us) while
        collectives follow each other (a notice that came while this rank waited in its last
        collective was taken in by that wait's polls), up to :data:`_IDLE_PROBES` after a
        pause of :data:`_IDLE_S` (a rank coming late to a collective comes after a pause)."""
        any_source, tag = self._mpi.ANY_SOURCE, self._notice_tag
        if time.monotonic() - self._active <= _IDLE_S:
            return bool(comm.Iprobe(any_source, tag))
        return any(comm.Iprobe(any_source, tag) for _ in range(_IDLE_PROBES))

    def _refuse_abandoned(self, comm: Any, what: str, seq: int) -> None:
        """Take the peers' notices in, then raise ``PeerFailureError`` if one aborted (a
        collective needs every rank), or ``CollectiveTimeout`` if one gave up on collective
        ``seq`` or an earlier one (a peer that gave up on a later one has passed this one: it
        may complete)."""
        self._take_notices(comm, patience=_IDLE_PROBES)  # (the others' notices, queued behind other messages)
        self._refuse_aborted(what, self._others)
        late = sorted(p for p, n in self._gave_up.items() if n <= seq)
        if late:
            first = min(self._gave_up[p] for p in late)
            raise CollectiveTimeout(
                f"{what}: group rank{'s' if len(late) > 1 else ''} {', '.join(map(str, late))} gave up on this "
                f"group's collective #{first} on backend 'mpi' (after its timeout) before this rank's call #{seq} "
                "came; MPI would complete this call against the abandoned one, so it is refused. The group's "
                "collectives cannot go on: form a new group (new_group or a new ProcessGroup)",
                op=what,
                peers=late,
            )

    def _give_up(self, request: Any, keep: object, seq: int) -> None:
        """Collective ``seq`` timed out here. MPI cannot cancel it, so its request and buffers
        stay with this backend (nothing MPI may still read or write is freed), and every other
        rank is told (a notice on the communicator, tag above the core's), so that a rank
        that comes to it late is refused instead of completing against it."""
        self._keep(request, keep)
        comm, tag = self._comm, self._notice_tag
        if tag is None or comm is None or self._closed is not None:
            return
        note = bytearray(self._mark + seq.to_bytes(8, "big"))
        notices = []
        for peer in range(self.size):
            if peer == self.rank:
                continue
            try:
                notices.append(comm.Isend([note, self._mpi.BYTE], peer, tag))
            except self._mpi.Exception:
                continue  # (the peer's failure shows in its own operations)
        # delivered before this returns (MPICH moves even a small message only inside MPI
        # calls, and the caller may not make another): at most a second
        with contextlib.suppress(self._mpi.Exception, GroupClosedError):
            self._wait_until(lambda: bool(self._mpi.Request.Testall(notices)), time.monotonic() + _NOTICE_S)
        with self._lock:
            self._sends.extend(_Send(r, note, -1) for r in notices if r)

    def _work(
        self,
        request: Any,
        what: str,
        timeout: float,
        *,
        seq: int,
        then: Callable[[], None] | None = None,
        keep: object = None,
    ) -> Work:
        """A :class:`Work` that completes with collective ``seq``'s ``request`` (then runs
        ``then``), failing with ``CollectiveTimeout`` ``timeout`` seconds after now (the
        collective given up on: :meth:`_give_up`), or with ``PeerFailureError`` once a peer
        aborted (the collective kept). ``keep`` is held until it completes (the buffers MPI
        reads and writes)."""
        deadline = time.monotonic() + timeout
        testing = threading.Lock()  # MPI_Test of one request from one thread at a time
        held = [keep]

        def drive(work: Work, budget: float) -> None:
            if not testing.acquire(blocking=False) and (budget <= 0 or not testing.acquire(timeout=budget)):
                return
            try:
                if work.done:  # completed by another thread meanwhile
                    return
                done = request.Test()
                if not done:
                    if budget <= 0:
                        self._listen(what, self._others)
                    else:
                        done = self._poll(
                            request.Test, min(deadline, time.monotonic() + budget), what=what, needs=self._others
                        )
                if not done:
                    if time.monotonic() >= deadline:
                        self._give_up(request, keep, seq)
                        work.set_exception(self._timeout(what, timeout))
                    return
                self._active = time.monotonic()
                if then is not None:
                    then()
            except PeerFailureError as exc:
                self._keep(request, keep)
                work.set_exception(exc)
            except BaseException as exc:
                work.set_exception(self._error(exc, what))
            else:
                work.set_result(None)
            finally:
                if work.done:
                    held.clear()
                testing.release()

        return Work(what, driver=drive)

    def _run(
        self,
        what: str,
        post: Callable[[Any], Any],
        timeout: float,
        *,
        async_op: bool,
        then: Callable[[], None] | None = None,
        keep: object = None,
    ) -> Work | None:
        """Post a non-blocking collective (``post(comm)`` returns MPI's request); wait for it, or
        with ``async_op`` return its work."""
        comm, seq = self._posting(what)
        try:
            request = post(comm)
        except self._mpi.Exception as exc:
            raise self._error(exc, what) from exc
        if async_op:
            return self._work(request, what, timeout, seq=seq, then=then, keep=keep)
        try:
            done = self._wait_until(request.Test, time.monotonic() + timeout, what=what, needs=self._others)
        except PeerFailureError:
            self._keep(request, keep)
            raise
        except self._mpi.Exception as exc:
            raise self._error(exc, what) from exc
        if not done:
            self._give_up(request, keep, seq)
            raise self._timeout(what, timeout)
        self._active = time.monotonic()
        if then is not None:
            then()
        return None

    # -- buffers and types ----------------------------------------------------------------
    def _memory(self, t: torch.Tensor) -> Any:
        """A dense tensor's memory as a buffer, made in C by mpi4py (a third of a ctypes array's
        cost); like :func:`~pg_core.backend.tensor_bytes`, it does not keep the tensor alive."""
        return self._mpi.buffer.fromaddress(t.data_ptr(), t.numel() * t.element_size())

    def _bytes(self, t: torch.Tensor) -> list[Any]:
        """``t``'s memory as MPI bytes (copies of any dtype are exact this way)."""
        return [self._memory(t), t.numel() * t.element_size(), self._mpi.BYTE]

    def _typed(self, t: torch.Tensor) -> list[Any]:
        """``t``'s memory as MPI elements of its dtype (float16/bfloat16: 2-byte elements)."""
        name = TYPE_NAMES.get(t.dtype, "INT16_T")
        return [self._memory(t), t.numel(), getattr(self._mpi, name)]

    def _torch_reduced(self, dtype: torch.dtype, op: ReduceOp) -> bool:
        """Whether torch reduces ``dtype`` in a user-defined op: MPI has no type for it, or
        MPI's op on it does not wrap around as torch's does (see :func:`wrong_integer_ops`)."""
        return dtype in _TORCH_REDUCED or (dtype, OP_NAMES[op.type]) in self._wrong_ops

    def _op(self, dtype: torch.dtype, op: ReduceOp) -> Any:
        """MPI's op for ``op`` on ``dtype``: a predefined one, or this backend's user-defined one."""
        if not self._torch_reduced(dtype, op):
            return getattr(self._mpi, OP_NAMES[op.type])
        key = (dtype, op.type)
        with self._lock:
            made = self._user_ops.get(key)
            if made is None:
                made = self._user_ops[key] = user_op(self._mpi, dtype, op.type)
        return made

    @staticmethod
    def _scaled(t: torch.Tensor, op: ReduceOp, *, in_place: bool) -> torch.Tensor:
        """``t`` times the PREMUL_SUM factor (in place, or a new tensor), else ``t``."""
        if op.type is not RedOpType.PREMUL_SUM:
            return t
        factor = op.factor_value()
        return t.mul_(factor) if in_place else torch.mul(t, factor)

    def _averaged(self, t: torch.Tensor, op: ReduceOp) -> Callable[[], None] | None:
        """The AVG finish (divide the sum by the group size), or ``None``."""
        if op.type is not RedOpType.AVG:
            return None

        def divide() -> None:
            if t.numel():
                t.div_(self.size)

        return divide

    # -- collectives ----------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, *, timeout: float, async_op: bool = False) -> Work | None:
        if async_op:
            key = (tensor.dtype, op.type)
            launch = self._launchers.get(key)
            if launch is None and key not in self._launchers:
                launch = self._launchers[key] = self._launcher(tensor.dtype, op)
            if launch is not None:
                return launch(tensor, timeout)
        mpi_op = self._op(tensor.dtype, op)
        self._scaled(tensor, op, in_place=True)
        buf = self._typed(tensor)
        return self._run(
            "all_reduce",
            lambda comm: comm.Iallreduce(self._mpi.IN_PLACE, buf, mpi_op),
            timeout,
            async_op=async_op,
            then=self._averaged(tensor, op),
            keep=tensor,
        )

    def prepared_all_reduce(
        self, dtype: torch.dtype, op: ReduceOp, *, timeout: float
    ) -> Callable[[torch.Tensor], None] | None:
        """:meth:`all_reduce` for blocking calls of one dtype and reduce op, with MPI's datatype
        and op looked up once: ``MPI_Iallreduce`` and its polled wait, nothing else (pg-core
        backend API 1.5). ``None`` for AVG and PREMUL_SUM (a step before or after) and for the
        dtypes and ops torch reduces in a user-defined op."""
        if op.type in (RedOpType.AVG, RedOpType.PREMUL_SUM) or self._torch_reduced(dtype, op):
            return None
        mpi = self._mpi
        mpi_op, mpi_type, in_place = getattr(mpi, OP_NAMES[op.type]), getattr(mpi, TYPE_NAMES[dtype]), mpi.IN_PLACE
        address, itemsize = mpi.buffer.fromaddress, dtype.itemsize  # (a buffer of the tensor's memory, made in C)
        posting, poll, error, tag, noticed = self._posting, self._poll, self._error, self._notice_tag, self._noticed
        aborted, others = self._aborted_peers, self._others

        def run(tensor: torch.Tensor) -> None:
            comm = self._comm
            if self._closed is not None or self._gave_up or aborted or (tag is not None and noticed(comm)):
                comm, _ = posting("all_reduce")  # the full check: raises, or counts the call
            else:
                self._seq += 1
            try:
                buf = address(tensor.data_ptr(), tensor.numel() * itemsize)
                request = comm.Iallreduce(in_place, [buf, mpi_type], mpi_op)
                if not request.Test() and not poll(
                    request.Test, time.monotonic() + timeout, what="all_reduce", needs=others
                ):
                    self._give_up(request, tensor, self._seq)
                    raise self._timeout("all_reduce", timeout)
                self._active = time.monotonic()
            except PeerFailureError:
                self._keep(request, tensor)
                raise
            except mpi.Exception as exc:
                raise error(exc, "all_reduce") from exc

        return run

    def _launcher(self, dtype: torch.dtype, op: ReduceOp) -> Callable[[torch.Tensor, float], Work] | None:
        """``all_reduce(tensor, op, timeout=..., async_op=True)`` for one dtype and reduce op,
        with MPI's datatype and op looked up once, as :meth:`prepared_all_reduce` does for the
        blocking call: ``MPI_Iallreduce`` and the work that tests its request when waited for or
        polled (:meth:`_work`), nothing else. (A test right after posting rarely completes it,
        even where every peer posted first: MPICH advances the collective's schedule over
        several tests.) ``None`` where :meth:`prepared_all_reduce` is."""
        if op.type in (RedOpType.AVG, RedOpType.PREMUL_SUM) or self._torch_reduced(dtype, op):
            return None
        mpi = self._mpi
        mpi_op, mpi_type, in_place = getattr(mpi, OP_NAMES[op.type]), getattr(mpi, TYPE_NAMES[dtype]), mpi.IN_PLACE
        address, itemsize = mpi.buffer.fromaddress, dtype.itemsize
        posting, error, tag, noticed, work = self._posting, self._error, self._notice_tag, self._noticed, self._work
        aborted = self._aborted_peers

        def launch(tensor: torch.Tensor, timeout: float) -> Work:
            comm = self._comm
            if self._closed is not None or self._gave_up or aborted or (tag is not None and noticed(comm)):
                comm, seq = posting("all_reduce")  # the full check: raises, or counts the call
            else:
                seq = self._seq = self._seq + 1
            try:
                request = comm.Iallreduce(
                    in_place, [address(tensor.data_ptr(), tensor.numel() * itemsize), mpi_type], mpi_op
                )
            except mpi.Exception as exc:
                raise error(exc, "all_reduce") from exc
            return work(request, "all_reduce", timeout, seq=seq, keep=tensor)

        return launch

    def broadcast(self, tensor: torch.Tensor, src: int, *, timeout: float, async_op: bool = False) -> Work | None:
        buf = self._bytes(tensor)
        return self._run("broadcast", lambda comm: comm.Ibcast(buf, root=src), timeout, async_op=async_op, keep=tensor)

    def reduce(
        self, tensor: torch.Tensor, dst: int, op: ReduceOp, *, timeout: float, async_op: bool = False
    ) -> Work | None:
        mpi_op = self._op(tensor.dtype, op)
        if self.rank == dst:
            self._scaled(tensor, op, in_place=True)
            buf = self._typed(tensor)
            return self._run(
                "reduce",
                lambda comm: comm.Ireduce(self._mpi.IN_PLACE, buf, mpi_op, root=dst),
                timeout,
                async_op=async_op,
                then=self._averaged(tensor, op),
                keep=tensor,
            )
        source = self._scaled(tensor, op, in_place=False)  # off the root the input stays as it is
        sbuf = self._typed(source)
        return self._run(
            "reduce", lambda comm: comm.Ireduce(sbuf, None, mpi_op, root=dst), timeout, async_op=async_op, keep=source
        )

    def all_gather(
        self, output_list: list[torch.Tensor], tensor: torch.Tensor, *, timeout: float, async_op: bool = False
    ) -> Work | None:
        nbytes = tensor.numel() * tensor.element_size()
        joined = torch.empty(nbytes * self.size, dtype=torch.uint8)
        sbuf, rbuf = self._bytes(tensor), [tensor_bytes(joined), nbytes, self._mpi.BYTE]

        def split() -> None:
            for out, piece in zip(output_list, joined.split(nbytes) if nbytes else [joined] * self.size, strict=True):
                _flat_bytes(out).copy_(piece)

        return self._run(
            "all_gather",
            lambda comm: comm.Iallgather(sbuf, rbuf),
            timeout,
            async_op=async_op,
            then=split,
            keep=(tensor, joined),
        )

    def all_gather_into_tensor(
        self, output: torch.Tensor, input: torch.Tensor, *, timeout: float, async_op: bool = False
    ) -> Work | None:
        nbytes = input.numel() * input.element_size()
        sbuf: Any = self._bytes(input)
        out_at, in_at = output.data_ptr(), input.data_ptr()
        if nbytes and in_at == out_at + self.rank * nbytes:  # its own slot (FSDP2): MPI refuses aliases
            sbuf = self._mpi.IN_PLACE
        elif nbytes and in_at < out_at + output.nbytes and out_at < in_at + nbytes:  # any other overlap
            input = input.clone()
            sbuf = self._bytes(input)
        rbuf = [tensor_bytes(output), nbytes, self._mpi.BYTE]
        return self._run(
            "all_gather_into_tensor",
            lambda comm: comm.Iallgather(sbuf, rbuf),
            timeout,
            async_op=async_op,
            keep=(input, output),
        )

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input_list: list[torch.Tensor],
        op: ReduceOp,
        *,
        timeout: float,
        async_op: bool = False,
    ) -> Work | None:
        joined = torch.cat([t.reshape(-1) for t in input_list]) if input_list else output.new_empty(0)
        return self._reduce_scatter(
            "reduce_scatter", output, self._scaled(joined, op, in_place=True), op, timeout=timeout, async_op=async_op
        )

    def reduce_scatter_tensor(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp, *, timeout: float, async_op: bool = False
    ) -> Work | None:
        source = self._scaled(input, op, in_place=False)
        return self._reduce_scatter("reduce_scatter_tensor", output, source, op, timeout=timeout, async_op=async_op)

    def _reduce_scatter(
        self, what: str, output: torch.Tensor, source: torch.Tensor, op: ReduceOp, *, timeout: float, async_op: bool
    ) -> Work | None:
        mpi_op = self._op(output.dtype, op)
        rbuf = self._typed(output)
        sbuf = [self._memory(source), rbuf[1], rbuf[2]]  # a block's count, as the receive's
        return self._run(
            what,
            lambda comm: comm.Ireduce_scatter_block(sbuf, rbuf, mpi_op),
            timeout,
            async_op=async_op,
            then=self._averaged(output, op),
            keep=(source, output),
        )

    def all_to_all(
        self, output_list: list[torch.Tensor], input_list: list[torch.Tensor], *, timeout: float, async_op: bool = False
    ) -> Work | None:
        out_sizes = [t.numel() * t.element_size() for t in output_list]
        in_sizes = [t.numel() * t.element_size() for t in input_list]
        joined = torch.cat([_flat_bytes(t) for t in input_list])
        received = torch.empty(sum(out_sizes), dtype=torch.uint8)

        def split() -> None:
            for out, piece in zip(output_list, received.split(out_sizes), strict=True):
                _flat_bytes(out).copy_(piece)

        return self._all_to_all(
            "all_to_all", received, joined, out_sizes, in_sizes, timeout=timeout, async_op=async_op, then=split
        )

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        *,
        timeout: float,
        async_op: bool = False,
    ) -> Work | None:
        out_row = math.prod(output.shape[1:]) * output.element_size()
        in_row = math.prod(input.shape[1:]) * input.element_size()
        return self._all_to_all(
            "all_to_all_single",
            output,
            input,
            [n * out_row for n in output_split_sizes],
            [n * in_row for n in input_split_sizes],
            timeout=timeout,
            async_op=async_op,
        )

    def _all_to_all(
        self,
        what: str,
        output: torch.Tensor,
        input: torch.Tensor,
        out_sizes: list[int],
        in_sizes: list[int],
        *,
        timeout: float,
        async_op: bool,
        then: Callable[[], None] | None = None,
    ) -> Work | None:
        byte = self._mpi.BYTE
        sbuf = [tensor_bytes(input), (in_sizes, _offsets(in_sizes)), byte]
        rbuf = [tensor_bytes(output), (out_sizes, _offsets(out_sizes)), byte]
        return self._run(
            what, lambda comm: comm.Ialltoallv(sbuf, rbuf), timeout, async_op=async_op, then=then, keep=(input, output)
        )

    def gather(
        self,
        tensor: torch.Tensor,
        gather_list: list[torch.Tensor] | None,
        dst: int,
        *,
        timeout: float,
        async_op: bool = False,
    ) -> Work | None:
        nbytes = tensor.numel() * tensor.element_size()
        sbuf = self._bytes(tensor)
        if gather_list is None:
            return self._run(
                "gather", lambda comm: comm.Igather(sbuf, None, root=dst), timeout, async_op=async_op, keep=tensor
            )
        joined = torch.empty(nbytes * self.size, dtype=torch.uint8)
        rbuf = [tensor_bytes(joined), nbytes, self._mpi.BYTE]

        def split() -> None:
            for out, piece in zip(gather_list, joined.split(nbytes) if nbytes else [joined] * self.size, strict=True):
                _flat_bytes(out).copy_(piece)

        return self._run(
            "gather",
            lambda comm: comm.Igather(sbuf, rbuf, root=dst),
            timeout,
            async_op=async_op,
            then=split,
            keep=(tensor, joined),
        )

    def scatter(
        self,
        tensor: torch.Tensor,
        scatter_list: list[torch.Tensor] | None,
        src: int,
        *,
        timeout: float,
        async_op: bool = False,
    ) -> Work | None:
        nbytes = tensor.numel() * tensor.element_size()
        rbuf = self._bytes(tensor)
        if scatter_list is None:
            return self._run(
                "scatter", lambda comm: comm.Iscatter(None, rbuf, root=src), timeout, async_op=async_op, keep=tensor
            )
        joined = torch.cat([_flat_bytes(t) for t in scatter_list])
        sbuf = [tensor_bytes(joined), nbytes, self._mpi.BYTE]
        return self._run(
            "scatter",
            lambda comm: comm.Iscatter(sbuf, rbuf, root=src),
            timeout,
            async_op=async_op,
            keep=(tensor, joined),
        )

    def barrier(self, *, timeout: float, async_op: bool = False) -> Work | None:
        return self._run("barrier", lambda comm: comm.Ibarrier(), timeout, async_op=async_op)

    # -- point to point -------------------------------------------------------------------
    def send(self, tensor: torch.Tensor, dst: int, tag: int, *, timeout: float) -> None:
        """Up to :data:`~pg_mpi.plugin.EAGER_LIMIT` bytes, MPI's buffered send (``MPI_Bsend`` into
        the communicator's automatic buffer): it returns at once, whether or not the receiver
        has posted its receive (where the library has no automatic buffer, a copy of this
        backend's own posted with ``MPI_Isend``, within ``max_send_copy_bytes``:
        :meth:`_reserve`). Above it, ``MPI_Isend`` from the tensor's own memory, waited for
        (:meth:`_rendezvous`): it returns once MPI is done with the tensor, which for a large
        message is once the receiver has posted the matching receive."""
        nbytes = tensor.nbytes
        if nbytes > EAGER_LIMIT:
            self._rendezvous(tensor, dst, tag, timeout)
            return
        if self._buffered:
            mpi = self._mpi
            unheard = self._sent_unheard + 1
            if unheard < _CHECK_EVERY and self._closed is None and not self._send_errors and not self._aborted_peers:
                self._sent_unheard = unheard  # (the hot path: _check's work only where there is something to refuse)
                comm = self._comm
            else:
                comm = self._check("send", [dst], sending=True)
            try:
                comm.Bsend([mpi.buffer.fromaddress(tensor.data_ptr(), nbytes), nbytes, mpi.BYTE], dst, tag)
            except mpi.Exception as exc:
                raise self._error(exc, f"send to rank {dst} (tag {tag})", [dst]) from exc
            return
        what = f"send to rank {dst} (tag {tag})"
        self._reserve(nbytes, what, timeout)
        self._copy_and_post(tensor, nbytes, dst, tag, what)

    def _rendezvous(self, tensor: torch.Tensor, dst: int, tag: int, timeout: float) -> None:
        """A blocking send above the eager limit: ``MPI_Isend`` from the tensor's memory (no
        copy), polled until MPI is done with it or ``timeout`` passes. MPI takes no send back,
        so one that times out (or whose peer aborted, or whose group was aborted meanwhile)
        stays posted, its tensor held by this backend, and the error says not to modify it."""
        mpi = self._mpi
        unheard = self._sent_unheard + 1
        if unheard < _CHECK_EVERY and self._closed is None and not self._send_errors and not self._aborted_peers:
            self._sent_unheard = unheard  # (the hot path, as in send)
            comm = self._comm
        else:
            comm = self._check(f"send to rank {dst} (tag {tag})", [dst], sending=True)
        nbytes = tensor.nbytes
        try:
            request = comm.Isend([mpi.buffer.fromaddress(tensor.data_ptr(), nbytes), nbytes, mpi.BYTE], dst, tag)
        except mpi.Exception as exc:
            raise self._error(exc, f"send to rank {dst} (tag {tag})", [dst]) from exc
        try:
            done = request.Test() or self._poll(
                request.Test, time.monotonic() + timeout, what=lambda: f"send to rank {dst} (tag {tag})", needs=[dst]
            )
        except mpi.Exception as exc:
            self._keep(request, tensor)
            raise self._error(exc, f"send to rank {dst} (tag {tag})", [dst]) from exc
        except BaseException:  # (the peer aborted, or this group was: the message stays posted)
            self._keep(request, tensor)
            raise
        if not done:
            self._keep(request, tensor)
            raise CollectiveTimeout(
                f"send to rank {dst} (tag {tag}): rank {dst} has not received the message after {timeout:g} s: a send of more than "
                f"{EAGER_LIMIT} bytes (backend 'mpi''s eager limit) waits for its receiver, so post the receive "
                "first (irecv) or use isend. The message stays posted (MPI takes no send back): do not modify "
                f"the tensor until rank {dst} receives it or the group is shut down",
                op="send",
                peers=[dst],
            )

    def _copy_and_post(self, tensor: torch.Tensor, nbytes: int, dst: int, tag: int, what: str) -> None:
        """Copy the tensor (at most the eager limit) into a buffer of the message's own and post
        it (``nbytes`` reserved): a send where the library has no automatic buffer."""
        self._post(bytearray(self._memory(tensor)), dst, tag, what, nbytes)

    def isend(self, tensor: torch.Tensor, dst: int, tag: int, *, timeout: float) -> Work:
        """Up to the eager limit, :meth:`send` (buffered: the work is done at once). Above it,
        ``MPI_Isend`` from the tensor's own memory, without a copy (the contract's rule: the
        caller leaves the tensor alone until the work completes): the work completes when MPI
        is done with the tensor (for a large message, once the receiver has taken it), and
        holds the tensor until then, as does this backend if the work is dropped. Past
        ``timeout`` that work fails with ``CollectiveTimeout``; the message stays posted (MPI
        takes no send back), so the tensor must still not be modified."""
        if tensor.numel() * tensor.element_size() <= EAGER_LIMIT:
            self.send(tensor, dst, tag, timeout=timeout)
            return Work.completed("isend")
        what = f"isend to rank {dst} (tag {tag})"
        comm = self._check(what, [dst], sending=True)
        try:
            request = comm.Isend(self._bytes(tensor), dst, tag)
        except self._mpi.Exception as exc:
            raise self._error(exc, what, [dst]) from exc
        entry = _Send(request, tensor, dst, testing=threading.Lock())
        with self._lock:
            self._sends.append(entry)
        deadline = time.monotonic() + timeout

        def drive(work: Work, budget: float) -> None:
            testing = entry.testing
            assert testing is not None
            if not testing.acquire(blocking=False) and (budget <= 0 or not testing.acquire(timeout=budget)):
                return
            try:
                if work.done:
                    return
                done = request.Test()
                if not done:
                    if budget <= 0:
                        self._listen(what, [dst])
                    else:
                        done = self._poll(
                            request.Test, min(deadline, time.monotonic() + budget), what=what, needs=[dst]
                        )
                if done:
                    work.set_result(None)
                elif time.monotonic() >= deadline:
                    work.set_exception(
                        CollectiveTimeout(
                            f"{what}: rank {dst} has not taken the message after {timeout:g} s; it stays posted "
                            "(MPI takes no send back): do not modify the tensor until rank "
                            f"{dst} receives it or the group is shut down",
                            op="isend",
                            peers=[dst],
                        )
                    )
            except PeerFailureError as exc:  # (the send stays posted: _reap keeps it)
                work.set_exception(exc)
            except BaseException as exc:
                work.set_exception(self._error(exc, what, [dst]))
            finally:
                testing.release()

        return Work("isend", driver=drive)

    def recv(self, tensor: torch.Tensor, src: int, tag: int, *, timeout: float) -> None:
        """:meth:`irecv` and its wait, in this thread, without the work."""
        self._recv(tensor, src, tag, timeout)

    def recv_anysource(self, tensor: torch.Tensor, tag: int, *, timeout: float) -> int:
        """:meth:`recv` from ``MPI_ANY_SOURCE``: MPI's own matching is the contract's (each
        peer's messages in the order it sent them; a message goes to the first posted receive
        that accepts it). Returns the sender's rank (the communicator's ranks are the group's)."""
        return self._recv(tensor, None, tag, timeout)

    def _recv(self, tensor: torch.Tensor, src: int | None, tag: int, timeout: float) -> int:
        """A blocking receive from ``src`` (``None``: any source); the sender's rank."""
        mpi = self._mpi
        peers = self._peers(src)
        # (the hot path: _check's work only where there is something to refuse)
        if self._closed is None and not self._send_errors:
            comm = self._comm
        else:
            comm = self._check("recv", () if src is None else peers)
        status = mpi.Status()
        nbytes = tensor.nbytes
        try:
            request = comm.Irecv(
                [mpi.buffer.fromaddress(tensor.data_ptr(), nbytes), nbytes, mpi.BYTE],
                mpi.ANY_SOURCE if src is None else src,
                tag,
            )
            try:
                if not request.Test(status) and not self._poll(
                    lambda: request.Test(status),
                    time.monotonic() + timeout,
                    what=lambda: _receiving(src, tag),  # (named only if it fails: a blocking recv's hot path)
                    needs=peers,
                ):
                    self._withdraw(request, status, tensor, what=_receiving(src, tag), timeout=timeout, peers=peers)
            except PeerFailureError as exc:
                what = _receiving(src, tag)
                self._withdraw(request, status, tensor, what=what, timeout=timeout, peers=peers, failure=exc)
        except mpi.Exception as exc:
            raise self._received_error(exc, tensor, _sender(src, status), tag) from exc
        if status.Get_count(mpi.BYTE) != nbytes:
            self._check_count(status, tensor, tag)  # (raises, naming the sender)
        return src if src is not None else int(status.Get_source())

    def irecv(self, tensor: torch.Tensor, src: int, tag: int, *, timeout: float) -> Work:
        """``MPI_Irecv`` into the tensor's memory, posted now (so receives on one stream match
        messages in the order they were called), tested when the work is waited for or polled.
        A message of another size is refused with ``CollectiveMismatchError`` (it was received,
        so the stream stays in step); past ``timeout`` the receive is withdrawn
        (:meth:`_withdraw`)."""
        return self._irecv(tensor, src, tag, timeout)

    def irecv_anysource(self, tensor: torch.Tensor, tag: int, *, timeout: float) -> Work:
        """:meth:`irecv` from ``MPI_ANY_SOURCE``, posted now; the work's result is the sender's rank."""
        return self._irecv(tensor, None, tag, timeout)

    def _irecv(self, tensor: torch.Tensor, src: int | None, tag: int, timeout: float) -> Work:
        mpi, peers = self._mpi, self._peers(src)
        if self._closed is None and not self._send_errors:  # (the hot path, as in _recv)
            comm = self._comm
        else:
            comm = self._check(_receiving(src, tag), () if src is None else peers)
        status = mpi.Status()
        nbytes = tensor.nbytes
        try:
            request = comm.Irecv(
                [mpi.buffer.fromaddress(tensor.data_ptr(), nbytes), nbytes, mpi.BYTE],
                mpi.ANY_SOURCE if src is None else src,
                tag,
            )
        except mpi.Exception as exc:
            raise self._error(exc, _receiving(src, tag), peers) from exc
        try:  # a message that came before its receive is taken now: the work is returned done
            done = request.Test(status)
            if done:
                sender = self._check_count(status, tensor, tag)  # (raises, naming the sender)
                return Work.completed("recv", None if src is not None else sender)
        except (mpi.Exception, CollectiveMismatchError) as exc:
            failed = Work("recv")
            if isinstance(exc, mpi.Exception):
                exc = self._received_error(exc, tensor, _sender(src, status), tag)
            failed.set_exception(exc)
            return failed
        deadline = time.monotonic() + timeout
        testing = threading.Lock()

        def what() -> str:  # (named only where it is said: a look for notices, a failure)
            return _receiving(src, tag)

        def drive(work: Work, budget: float) -> None:
            if not testing.acquire(blocking=False) and (budget <= 0 or not testing.acquire(timeout=budget)):
                return
            try:
                if work.done:
                    return
                try:
                    try:
                        done = request.Test(status)
                        if not done:
                            if budget <= 0:
                                self._listen(what, peers)
                            else:
                                done = self._poll(
                                    lambda: request.Test(status),
                                    min(deadline, time.monotonic() + budget),
                                    what=what,
                                    needs=peers,
                                )
                        if not done:
                            if time.monotonic() < deadline:
                                return
                            self._withdraw(request, status, tensor, what=what(), timeout=timeout, peers=peers)
                    except PeerFailureError as exc:
                        self._withdraw(request, status, tensor, what=what(), timeout=timeout, peers=peers, failure=exc)
                except mpi.Exception as exc:
                    raise self._received_error(exc, tensor, _sender(src, status), tag) from None
                sender = self._check_count(status, tensor, tag)
            except BaseException as exc:
                work.set_exception(self._error(exc, what(), peers))
            else:
                work.set_result(None if src is not None else sender)
            finally:
                testing.release()

        return Work("recv", driver=drive)

    def _withdraw(
        self,
        request: Any,
        status: Any,
        tensor: torch.Tensor,
        *,
        what: str,
        timeout: float,
        peers: Sequence[int],
        failure: PeerFailureError | None = None,
    ) -> None:
        """A receive timed out (or its peer aborted: ``failure``): cancel it (``MPI_Cancel``) and
        wait for MPI to finish with it, so that nothing is written into ``tensor`` once this
        returns. Returns normally where the message came after all (MPI had matched it: the
        receive is complete and ``status`` says so); raises ``CollectiveTimeout`` (or
        ``failure``) where the receive was withdrawn, or ``CollectiveTimeout`` where MPI did not
        let go of it within :data:`_WITHDRAW_S` (then the tensor is kept, and the error says
        that MPI may still write into it)."""
        request.Cancel()
        try:
            finished = self._wait_until(lambda: request.Test(status), time.monotonic() + _WITHDRAW_S)
        except GroupClosedError:
            finished = False
        if finished and not status.Is_cancelled():
            return  # received after all: not a timeout
        if finished:
            raise failure or self._timeout(what, timeout, peers)
        with self._lock:
            self._abandoned.append((request, tensor))
        raise CollectiveTimeout(
            f"{what}: not complete after {timeout:g} s, and MPI had already matched the message and did not "
            f"let go of the receive within {_WITHDRAW_S:g} s more: the tensor may still be written; do not "
            "reuse it",
            op=what,
            peers=peers,
        )

    def _peers(self, src: int | None) -> list[int]:
        """The ranks a receive waits for: ``src``, or every other rank for any source."""
        return [src] if src is not None else [r for r in range(self.size) if r != self.rank]

    def _received_error(self, exc: BaseException, tensor: torch.Tensor, src: int | None, tag: int) -> BaseException:
        """A receive's ``MPI.Exception`` as pg-core's error: a message larger than the tensor
        (MPI's truncation) is a ``CollectiveMismatchError``."""
        what = _receiving(src, tag)
        if isinstance(exc, self._mpi.Exception) and exc.Get_error_class() == self._mpi.ERR_TRUNCATE:
            want = tensor.numel() * tensor.element_size()
            return self._mismatch(what, f"larger than {want} bytes", tensor, want, src)
        return self._error(exc, what, self._peers(src))

    def _check_count(self, status: Any, tensor: torch.Tensor, tag: int) -> int:
        """The sender of the message received, once it is checked to have the tensor's size
        (else ``CollectiveMismatchError`` naming the sender)."""
        src = int(status.Get_source())
        got, want = status.Get_count(self._mpi.BYTE), tensor.numel() * tensor.element_size()
        if got != want:
            raise self._mismatch(_receiving(src, tag), f"{got} bytes", tensor, want, src)
        return src

    def _mismatch(
        self, what: str, sent: str, tensor: torch.Tensor, want: int, src: int | None
    ) -> CollectiveMismatchError:
        return CollectiveMismatchError(
            f"{what}: the message is {sent}, the receiving tensor {tuple(tensor.shape)} x "
            f"{str(tensor.dtype).removeprefix('torch.')} is {want} bytes",
            peers=self._peers(src),
        )

    def send_bytes(self, data: Any, dst: int, tag: int, *, timeout: float) -> None:
        """The message's parts copied into one buffer of its own, posted with ``MPI_Isend``;
        returns at once, unless the budget of copies in flight is full (as :meth:`send`)."""
        views = [memoryview(p).cast("B") for p in data]  # the message's parts (API >= 1.1)
        nbytes = sum(v.nbytes for v in views)
        what = f"send_bytes to rank {dst} (tag {tag})"
        self._reserve(nbytes, what, timeout)
        payload = bytearray(nbytes)
        offset = 0
        for view in views:
            payload[offset : offset + view.nbytes] = view
            offset += view.nbytes
        self._post(payload, dst, tag, what, nbytes)

    def _reserve(self, nbytes: int, what: str, timeout: float) -> None:
        """Count ``nbytes`` of a copy against ``max_send_copy_bytes``, first waiting (at most
        ``timeout``) for earlier sends to be received where they fill it. A message larger
        than the budget goes alone."""
        if self._room(nbytes):
            return

        def reaped() -> bool:
            return self._reaped_room(nbytes)

        if not self._wait_until(reaped, time.monotonic() + timeout):
            waiting = sorted({e.dst for e in list(self._sends) if e.copied})
            raise CollectiveTimeout(
                f"{what}: {self._copied} bytes of earlier sends to rank{'s' if len(waiting) > 1 else ''} "
                f"{', '.join(map(str, waiting))} still wait for their receivers after {timeout:g} s, and pg-mpi "
                f"holds at most max_send_copy_bytes={self._copy_budget} bytes of copied messages in flight "
                f"(this one is {nbytes}): receive them, or give the group's 'mpi' backend a larger "
                "max_send_copy_bytes option",
                op=what,
                peers=waiting,
            )

    def _room(self, nbytes: int) -> bool:
        """Count ``nbytes`` against the budget of copies in flight, if they fit now (or nothing
        is in flight)."""
        with self._lock:
            if self._copied and self._copied + nbytes > self._copy_budget:
                return False
            self._copied += nbytes
            return True

    def _reaped_room(self, nbytes: int) -> bool:
        """:meth:`_room`, after dropping the sends that completed since the last look."""
        if self._sends:
            self._reap()
        return self._room(nbytes)

    def _post(self, payload: bytearray, dst: int, tag: int, what: str, nbytes: int) -> None:
        """``MPI_Isend`` of a copy's first ``nbytes`` (reserved by :meth:`_reserve`), kept
        until MPI is done with it (a later MPI call completes it; ``shutdown`` waits for it)."""
        try:
            comm = self._check(what, [dst], sending=True)
            try:
                request = comm.Isend([payload, self._mpi.BYTE], dst, tag)
            except self._mpi.Exception as exc:
                raise self._error(exc, what, [dst]) from exc
        except BaseException:
            with self._lock:
                self._copied -= nbytes
            raise
        with self._lock:
            self._sends.append(_Send(request, payload, dst, copied=nbytes))
        self._reap()

    def recv_bytes(self, src: int, tag: int, *, timeout: float) -> bytearray:
        deadline = time.monotonic() + timeout
        what = f"recv_bytes from rank {src} (tag {tag})"
        message, nbytes = self._probe(src, tag, deadline, timeout, what)
        buffer = bytearray(nbytes)
        try:
            request = message.Irecv([buffer, nbytes, self._mpi.BYTE])
            done = self._wait_until(request.Test, deadline, what=what, needs=[src])
        except PeerFailureError:  # matched, so not cancellable: the buffer stays with MPI
            self._keep(request, buffer)
            raise
        except self._mpi.Exception as exc:
            raise self._error(exc, what, [src]) from exc
        if not done:
            self._keep(request, buffer)
            raise self._timeout(what, timeout, [src])
        return buffer

    def _probe(self, src: int, tag: int, deadline: float, timeout: float, what: str) -> tuple[Any, int]:
        """The next message from ``src`` with ``tag``, matched (``MPI_Improbe``), and its size in bytes."""
        comm = self._check(what, [src])
        status = self._mpi.Status()
        found: list[Any] = []

        def probe() -> bool:
            message = comm.Improbe(src, tag, status)
            if message is None:
                return False
            found.append(message)
            return True

        try:
            if not self._wait_until(probe, deadline, what=what, needs=[src]):
                raise CollectiveTimeout(f"{what}: no message within {timeout:g} s", op=what, peers=[src])
        except self._mpi.Exception as exc:
            raise self._error(exc, what, [src]) from exc
        return found[0], status.Get_count(self._mpi.BYTE)

    def _reap(self) -> None:
        """Drop the sends that completed, releasing their copies' share of the budget; record
        a failed one for its peer. A send to a peer that aborted will never be received: it
        is kept as long as this backend (MPI takes no send back) but no longer counted, so
        that neither the budget nor ``shutdown`` waits for it. A send whose work is being
        waited for is left to it."""
        with self._lock:
            pending, self._sends = self._sends, []
        left, freed = [], 0
        for entry in pending:
            if entry.testing is not None and not entry.testing.acquire(blocking=False):
                left.append(entry)
                continue
            try:
                if not entry.request.Test():
                    if entry.dst in self._aborted_peers:
                        self._keep(entry.request, entry.payload)
                    else:
                        left.append(entry)
                        continue
            except self._mpi.Exception as exc:
                dst = entry.dst
                self._send_errors.setdefault(dst, self._error(exc, f"send to rank {dst}", [dst]))
            finally:
                if entry.testing is not None:
                    entry.testing.release()
            freed += entry.copied
        with self._lock:
            self._sends[:0] = left
            self._copied -= freed

    def _sent(self) -> bool:
        """Whether every send has completed (reaping the ones that have)."""
        self._reap()
        return not self._sends

    # -- life -----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Wait (at most the group's timeout) for sends still in flight, then
        free the communicator and this backend's MPI ops."""
        deadline = time.monotonic() + self.ctx.timeout
        if self._closed is None:
            try:
                self._wait_until(self._sent, deadline)
            except GroupClosedError:
                pass
        self._free("shut down")

    def abort(self) -> None:
        """Tell the other ranks (:meth:`_farewell`), refuse everything from now on; polling
        loops in other threads raise ``GroupClosedError`` within a nap, then the communicator is
        freed. Never waits on a peer."""
        self._farewell()
        self._free("aborted")

    def _farewell(self) -> None:
        """Send every other rank an abort notice (tag above the core's), so that their
        operations that need this rank raise ``PeerFailureError`` ("rank R aborted") instead of
        waiting for their timeout. The notices are driven for at most :data:`_FAREWELL_S`
        (MPICH moves such a small message within the calls that post and test it) and then
        left with MPI, their requests kept as long as this backend; a peer that has left
        already never takes its notice in (and a later communicator's never matches it: the
        notice names this formation)."""
        mpi, comm, tag = self._mpi, self._comm, self._notice_tag
        if comm is None or tag is None or self._closed is not None or mpi.Is_finalized():
            return
        note = self._mark + _ABORTED
        notices = []
        for peer in self._others:
            with contextlib.suppress(mpi.Exception):  # (the peer's failure shows in its own operations)
                notices.append(comm.Isend([note, mpi.BYTE], peer, tag))
        until = time.monotonic() + _FAREWELL_S
        with contextlib.suppress(mpi.Exception):
            while not mpi.Request.Testall(notices) and time.monotonic() < until:
                _yield()
        self._keep(notices, note)

    def _free(self, how: str) -> None:
        with self._lock:
            if self._closed is None:
                self._closed = how
            self._idle.wait_for(lambda: not self._polling, timeout=5.0)
            comm, self._comm = self._comm, None
            ops, self._user_ops = list(self._user_ops.values()), {}
            self._sends.clear()
            self._copied = 0
        if comm is not None and not self._mpi.Is_finalized():
            comm.Free()
            for op in ops:
                op.Free()


class _Send:
    """A send in flight: its request, the buffer MPI reads (the message's copy, or the
    tensor of an ``isend``), its destination, how many of its bytes are a copy held against
    the budget, and, for an ``isend``, the lock its work holds while testing the request (MPI
    lets one thread test a request at a time)."""

    __slots__ = ("copied", "dst", "payload", "request", "testing")

    def __init__(
        self,
        request: Any,
        payload: bytearray | torch.Tensor,
        dst: int,
        *,
        copied: int = 0,
        testing: threading.Lock | None = None,
    ) -> None:
        self.request, self.payload, self.dst = request, payload, dst
        self.copied, self.testing = copied, testing


def _attach_automatic_buffer(mpi: Any, comm: Any) -> bool:
    """Give ``comm`` MPI's automatic buffer for buffered sends (``MPI_Comm_attach_buffer`` with
    ``MPI_BUFFER_AUTOMATIC``, MPI 4.1: MPI allocates what each ``MPI_Bsend`` needs, and freeing
    the communicator does not wait for the messages); ``False`` where the library has none."""
    automatic = getattr(mpi, "BUFFER_AUTOMATIC", None)
    if automatic is None or not hasattr(comm, "Attach_buffer"):
        return False
    try:
        comm.Attach_buffer(automatic)
    except (mpi.Exception, NotImplementedError):
        return False
    return True


def _receiving(src: int | None, tag: int) -> str:
    """How an error names a receive."""
    return f"recv from rank {src} (tag {tag})" if src is not None else f"recv from any rank (tag {tag})"


def _sender(src: int | None, status: Any) -> int | None:
    """The sender of a receive that failed: ``src``, or for any source the one MPI's status
    names, where it names one."""
    if src is not None:
        return src
    source = status.Get_source()
    return int(source) if source >= 0 else None


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A dense tensor's memory as a 1-D ``uint8`` view."""
    return t.reshape(-1).view(torch.uint8)


def _offsets(sizes: list[int]) -> list[int]:
    out, total = [], 0
    for n in sizes:
        out.append(total)
        total += n
    return out


def _job_id() -> str:
    """The launcher's name for this job, where it gives one (Hydra gives none)."""
    return "/".join(f"{k}={os.environ[k]}" for k in _JOB_ENV if k in os.environ)


def _form(
    ctx: BackendContext, mpi: Any, wait_until: Callable[[Callable[[], bool], float], bool], deadline: float
) -> Any:
    """The group's communicator over exactly its members (see the module docstring), the
    store exchange and the handshake done by ``deadline``."""
    world = mpi.COMM_WORLD
    name = f"group {ctx.group_name!r}"
    me = {"world_rank": world.Get_rank(), "world_size": world.Get_size(), "job": _job_id()}
    ctx.store.set(f"member/{ctx.rank}", json.dumps(me))
    keys = [f"member/{r}" for r in range(ctx.size)]
    left = max(deadline - time.monotonic(), 1e-3)
    wait_for(ctx.store, keys, left, what=f"{name} rank {ctx.rank}: the MPI ranks of its members")
    members = [json.loads(ctx.store.get(k)) for k in keys]
    worlds = {(m["world_size"], m["job"]) for m in members}
    ranks = [int(m["world_rank"]) for m in members]
    if len(worlds) > 1 or len(set(ranks)) != len(ranks):
        seen = ", ".join(
            f"rank {r}: MPI world rank {m['world_rank']} of {m['world_size']}{' in ' + m['job'] if m['job'] else ''}"
            for r, m in enumerate(members)
        )
        raise BackendUnavailableError(
            f"Backend 'mpi' cannot form {name}: its members are not processes of one MPI job ({seen}); {HOW_TO_LAUNCH}"
        )
    digest = hashlib.sha256(ctx.group_uid.encode()).digest()
    tag = int.from_bytes(digest[:8], "big") % (int(world.Get_attr(mpi.TAG_UB)) + 1)
    if ctx.size > 1:
        _handshake(ctx, mpi, ranks, token=digest[:16], tag=tag, wait_until=wait_until, name=name, deadline=deadline)
    world_group = world.Get_group()
    members_group = world_group.Incl(ranks)
    try:
        return world.Create_group(members_group, tag)
    finally:
        members_group.Free()
        world_group.Free()


def _adopt(ctx: BackendContext, mpi: Any, comm: Any) -> Any:
    """The communicator the parent's :meth:`MPIBackend.split` made for this subgroup, checked
    against the group's size and this member's rank (freed if it is not the group's)."""
    if not isinstance(comm, mpi.Intracomm) or comm == mpi.COMM_NULL:
        raise TypeError(
            f"Backend 'mpi' of group {ctx.group_name!r}: ctx.split_from must be an mpi4py Intracomm made by "
            f"MPIBackend.split, got {comm!r}"
        )
    size, rank = comm.Get_size(), comm.Get_rank()
    if (size, rank) != (ctx.size, ctx.rank):
        comm.Free()
        raise ValueError(
            f"Backend 'mpi' of group {ctx.group_name!r}: the split communicator has {size} ranks with this process "
            f"at rank {rank}, but the group has {ctx.size} with this member at rank {ctx.rank}; the core and the "
            "backend disagree on the split"
        )
    return comm


def _handshake(
    ctx: BackendContext,
    mpi: Any,
    ranks: list[int],
    *,
    token: bytes,
    tag: int,
    wait_until: Callable[[Callable[[], bool], float], bool],
    name: str,
    deadline: float,
) -> None:
    """Each member sends ``token`` to the next member's world rank and receives it from the
    previous one's, within the group's timeout: proof that the world ranks in the store are
    these processes (members of different jobs with equal world sizes would otherwise meet
    in ``MPI_Comm_create_group`` and wait forever)."""
    world = mpi.COMM_WORLD
    after, before = ranks[(ctx.rank + 1) % ctx.size], ranks[(ctx.rank - 1) % ctx.size]
    got = bytearray(len(token))
    send = world.Isend([token, len(token), mpi.BYTE], after, tag)
    recv = world.Irecv([got, len(got), mpi.BYTE], before, tag)
    requests = [send, recv]
    if not wait_until(lambda: bool(mpi.Request.Testall(requests)), deadline):
        recv.Cancel()
        recv.Wait()
        send.Free()
        raise BackendUnavailableError(
            f"Backend 'mpi' cannot form {name}: rank {ctx.rank} heard nothing over MPI from MPI world rank {before} "
            f"(group rank {(ctx.rank - 1) % ctx.size}) within {ctx.timeout:g} s, though every member set its world "
            f"rank in the store: the members are not processes of one MPI job; {HOW_TO_LAUNCH}"
        )
    if bytes(got) != token:
        raise BackendUnavailableError(
            f"Backend 'mpi' cannot form {name}: MPI world rank {before} sent another group's handshake "
            f"(tag {tag}): two groups formed at once whose tags collide, or the members are not one MPI job"
        )
