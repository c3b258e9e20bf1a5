"""``GlooBackend``: a group's operations on one ``torch.distributed.ProcessGroupGloo``.

The Gloo object is built from the group's own prefixed store, with the group's rank and
size: no ``init_process_group``, no default group, nothing global. What the wrapper adds
is what Gloo lacks for pg-core's contract, each found by testing Gloo itself:

* **Collectives are Gloo's own** (:class:`pg_core.c10d.C10dBackend`), each with the call's
  timeout in its options: a blocking one waited for in the calling thread, an asynchronous
  one launched there, Gloo's work becoming the user's (no thread per operation). A dtype Gloo
  cannot move (``int16``, complex, in the copying collectives) travels as its bytes, which is
  exact.
* **Waits that can be interrupted** (:mod:`pg_gloo.waiting`). Nothing wakes a thread waiting
  in Gloo but the operation's end or Gloo's timeout, so no caller waits there for longer than
  ``SLICE_S``: a collective's work is waited for in slices of torch's ``Work.wait(timeout)``
  (an expired slice leaves a collective as it was), a receive by a waiter thread (a receive's
  expired wait closes every connection). Between slices a wait raises for ``abort()``
  (:class:`~pg_core.errors.GroupClosedError`), a peer gone, its deadline; Ctrl-C arrives with
  the slice's end. A wait that stops early closes Gloo's connections first (unless every peer
  it needs is gone), so a tensor is never written after its operation failed.
* **Who left, and how** (:mod:`pg_gloo.watch`): one idle connection to every peer, on which a
  rank says ``aborted`` or ``shut down`` as it goes; one that ends without a word is a rank
  that died. Errors name the group rank from it (Gloo's name a socket address), and a send
  looks at it first, so a send to a rank that died a moment ago raises instead of being lost.
* **Point to point** (:mod:`pg_gloo.messages`). Gloo's ``send`` completes only once the
  receiver has posted its receive, at every size, and a receive whose buffer is smaller than
  the message aborts the whole process (``op.preamble.length <= op.nbytes``). So a message
  starts with a 16-byte header (size, dtype) that the receiver reads first. Up to the eager
  limit the plugin declares (``Capabilities.eager_limit_bytes``, API 1.10: 2 MiB, chosen by
  measurement in docs/decisions.md) the payload follows the header in one Gloo message, a copy
  that a reaper thread lets go once Gloo has sent it, so ``send`` returns at once; above it,
  the payload is a second Gloo message sent from the caller's tensor and received into the
  receiver's, no copy on either side, and ``send`` waits until Gloo has sent it (the receiver
  has posted its receive), as torch's own Gloo ``send`` does. A receive of the wrong size or
  dtype is refused with :class:`~pg_core.errors.CollectiveMismatchError` before anything
  reaches its tensor (after draining the message, so the stream stays in step). ``isend`` and
  ``irecv`` are native: posted in the caller's thread, in the stream's order, their works
  completed by the waiter threads that sit in Gloo's waits, and waited for in slices. The
  eager copies waiting for their receivers are bounded (``max_buffered_send_bytes``, default
  256 MiB): past it, an eager send waits for earlier ones to be received.
* **Coalescing** (``group.coalescing()``, API 1.3): Gloo has none (torch's ``ProcessGroupGloo``
  says ``supports_coalescing`` is False and raises on ``_start_coalescing``), so pg-gloo does
  not claim it and the core runs a batch one call after another, in order.
* **Errors are pg-core's.** Gloo's timeout becomes
  :class:`~pg_core.errors.CollectiveTimeout`; a closed or reset connection,
  :class:`~pg_core.errors.PeerFailureError` naming the rank (from the watch). Gloo closes its
  connections on a timeout (both sides see it), so after one this backend refuses everything
  at once with a ``PeerFailureError`` that says so: form a new group.
* **Abort** closes Gloo's connections, then every wait raises. ``ProcessGroupGloo.abort()``
  wakes none of the threads blocked in Gloo (pg-gloo's waiter threads, its send reaper,
  torch's worker threads): a receive posted after it and let expire does, within
  milliseconds (:func:`~pg_gloo.waiting.wake_gloo_waits`), so they end with the abort, not
  at Gloo's timeout. The Gloo object's destructor joins torch's threads: it is let go in a
  thread of its own, so ``abort()`` returns at once.
"""

from __future__ import annotations

import collections
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

import torch
from pg_core.backend import BackendContext
from pg_core.buffers import SpareBuffers
from pg_core.c10d import C10dBackend, first_line, flat_bytes, timeout_delta
from pg_core.errors import CollectiveTimeout, GroupClosedError, PeerFailureError, PGError
from pg_core.ops import ReduceOp
from pg_core.store import advertise_address
from pg_core.work import Work, then
from torch.distributed import ProcessGroupGloo

from .messages import MAX_BUFFERED_SEND_BYTES, Messages, Sent, _Receive
from .waiting import SLICE, SlicedWaits, Ticket, Waiters, confined_to_one_cpu, slice_ended
from .watch import ABORTED, DIED, SHUT_DOWN, PeerWatch

__all__ = ["GlooBackend"]

#: How long a wait gives Gloo to end an operation itself once a peer it needs is seen gone.
_PATIENCE_S: Final = 1.0
_ABRUPT: Final = frozenset({DIED, ABORTED})
_EVERY_WAY: Final = frozenset({DIED, ABORTED, SHUT_DOWN})

#: Gloo's words for a connection that is gone (its pair.cc messages).
_PEER_GONE: Final = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Read error",
    "Write error",
    "Broken pipe",
    "Connection refused",
    "Socket closed",
)


class GlooBackend(SlicedWaits, Messages, C10dBackend):
    """One ``ProcessGroupGloo`` per group formation and device type."""

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        #: why this backend cannot communicate any more (Gloo closed its connections), or None
        self._broken: str | None = None
        #: Gloo's sends in flight, in posting order, each with its buffer (Gloo needs it until the
        #: receiver has the message), destination, deadline and the spare buffer it is part of, if
        #: any: gathered in ``_unreaped`` (under ``_lock``), handed to the reaper thread in batches
        #: (see ``_REAP_SENDS``), which waits for them in order
        self._unreaped: list[Sent] = []
        self._unreaped_bytes = 0
        self._sends: queue.SimpleQueue[list[Sent] | None] = queue.SimpleQueue()
        #: buffers of finished messages, for the next ones: large sends' payloads and receives'
        #: first buffers (a fresh tensor of megabytes costs its page faults: pg_core.buffers)
        self._spares = SpareBuffers()
        self._reaper: threading.Thread | None = None
        #: per (peer, tag), the receives waiting to post their first Gloo receive (see messages)
        self._streams: dict[tuple[int, int], collections.deque[_Receive]] = {}
        #: sends above the eager limit whose payload Gloo has not sent yet
        self._large: set[Ticket] = set()
        self._lock = threading.Lock()
        #: held while Gloo's connections are being closed (abort, or a failed wait that cuts them)
        self._closing = threading.Lock()
        #: a send the reaper saw fail, per destination: raised by that peer's next operation
        self._send_errors: dict[int, BaseException] = {}
        #: set once ``abort()`` has closed Gloo's connections: blocked operations raise
        self._aborted = False
        #: this process may run on one CPU only: an asynchronous post yields it (SlicedWaits._launched)
        self._one_cpu = confined_to_one_cpu()
        #: bytes of sends copied and not yet taken by their receivers, bounded by ``_budget``
        self._buffered = 0
        self._buffered_cond = threading.Condition(self._lock)
        # (0: every send waits until its receiver has it)
        self._budget = ctx.byte_option("max_buffered_send_bytes", MAX_BUFFERED_SEND_BYTES, minimum=0)
        self._everyone = tuple(r for r in range(ctx.size) if r != ctx.rank)
        self._waiters = Waiters(ctx.group_name)
        options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        host = str(ctx.options.get("addr") or advertise_address(ctx.store))
        options._devices = [ProcessGroupGloo.create_device(hostname=host)]  # Gloo listens on this address only
        options._timeout = timeout_delta(ctx.timeout)
        options._threads = int(ctx.options.get("threads", 2))
        self._watch = PeerWatch(
            ctx.store,
            ctx.rank,
            ctx.size,
            host,
            ctx.timeout,
            name=ctx.group_name,
            uid=ctx.group_uid,
            auth_key=ctx.auth_key,
        )
        try:
            self._pg = ProcessGroupGloo(self.rendezvous("Gloo connect"), ctx.rank, ctx.size, options)
        except RuntimeError as exc:
            self._watch.close(b"A")
            raise self._error(exc, "connect", ctx.timeout) from exc
        except BaseException:
            self._watch.close(b"A")
            raise

    # -- errors -------------------------------------------------------------------------
    def _ready(self, what: str, peers: Sequence[int] = (), *, receiving: bool = False) -> Any:
        """The Gloo object, or the error this backend's state calls for, before anything is sent
        (``peers``: whom the operation needs; a collective needs everyone). A collective needs
        no peer that died or aborted; a send, no peer gone at all (one that shut down will not
        receive it); a receive is left to Gloo, which still delivers what a peer sent before it
        left, and fails at once where nothing is left."""
        pg = self._pg
        if pg is not None and self._broken is None and not self._send_errors and not self._watch.gone:
            return pg  # the common case, first
        if receiving:
            self._alarm(what, peers, kinds=frozenset())
        else:
            self._alarm(what, peers or self._everyone, kinds=_EVERY_WAY if peers else _ABRUPT, patience=0.0)
        for peer in peers:
            failed = self._send_errors.get(peer)
            if failed is not None:
                raise PeerFailureError(f"{what}: an earlier send to rank {peer} failed: {failed}", peers=[peer])
        return self.c10d

    def _alarm(
        self,
        what: str,
        peers: Sequence[int],
        *,
        kinds: frozenset[str] = frozenset({DIED, ABORTED}),
        patience: float = _PATIENCE_S,
    ) -> None:
        """Raise what stops an operation that needs ``peers``: this backend aborted or broken, or
        one of them gone in one of ``kinds`` of ways for at least ``patience`` seconds. (A wait
        gives Gloo that long to end the operation itself: with what a peer sent before it left,
        or with Gloo's own error; a peer that shut down had finished, so Gloo decides alone.)"""
        if self._aborted:
            raise GroupClosedError(
                f"{what}: backend 'gloo' of group {self.ctx.group_name!r} was aborted while the operation waited"
            )
        if self._broken is not None:
            raise PeerFailureError(
                f"{what}: backend 'gloo' of group {self.ctx.group_name!r} cannot communicate any more: {self._broken}. "
                "Gloo's connections are closed; form a new group (or shrink() this one)",
                peers=peers,
            )
        gone = self._watch.gone
        if not gone or not kinds:
            return
        lost = [p for p in peers if gone.get(p) in kinds]
        if lost and (patience <= 0 or time.monotonic() - self._watch.first_seen(lost) >= patience):
            raise PeerFailureError(f"{what}: {_who(lost, gone)}", peers=_blamed(lost, gone))

    def _error(self, exc: BaseException, what: str, timeout: float, peers: Sequence[int] = ()) -> BaseException:
        """Gloo's ``RuntimeError`` as pg-core's error (anything unrecognised is returned as is)."""
        if isinstance(exc, PGError):  # pg-core's own (a RuntimeError too): already says it
            return exc
        text = first_line(exc)
        if "Application timeout caused pair closure" in text and (self._aborted or self._broken is not None):
            try:  # this backend closed them (abort, or a cut) and woke the wait: say why, as a wait would
                self._alarm(what, peers, kinds=frozenset(), patience=0.0)
            except PGError as said:  # may be kept (a send's failure, for the next call): its traceback
                said.__traceback__ = said.__context__ = None  # and context would pin frames, Gloo's work among them
                return said
        if "Connect timeout" in text and self._watch.gone:  # forming: a peer left, and the watch knows who
            lost = sorted(self._watch.gone)
            return PeerFailureError(
                f"{what}: {_who(lost, self._watch.gone)} (Gloo: {text})", peers=_blamed(lost, self._watch.gone)
            )
        if "Timed out" in text or "timed out" in text or "Connect timeout" in text:
            self._broken = f"{what} timed out after {timeout:g} s"
            return CollectiveTimeout(
                f"{what}: Gloo gave up after {timeout:g} s ({text}); Gloo closes its connections on a timeout, "
                "so this group's gloo backend refuses every later operation: form a new group",
                op=what,
                peers=peers,
            )
        closed = any(words in text for words in _PEER_GONE)
        gone = self._gone(peers or self._everyone) if closed else {}
        lost = [p for p in (peers or self._everyone) if p in gone] or sorted(gone)
        if lost:  # the watch knows who, and how: Gloo's text names a socket address
            return PeerFailureError(f"{what}: {_who(lost, gone)} (Gloo: {text})", peers=_blamed(lost, gone))
        if "Application timeout caused pair closure" in text:
            self._broken = self._broken or "Gloo closed its connections after a timeout"
            return PeerFailureError(
                f"{what}: Gloo's connection was closed by an earlier timeout ({text}); form a new group", peers=peers
            )
        if closed:  # alive, and no last word: it gave up on an operation of its own
            self._broken = self._broken or "a peer closed its Gloo connections after giving up on an operation"
            return CollectiveTimeout(
                f"{what}: a peer closed its Gloo connection, alive and without aborting: it gave up on an "
                f"operation of its own (its timeout, or an interrupt), and Gloo closed every connection of the "
                f"group ({text}); this group's gloo backend refuses every later operation: form a new group",
                op=what,
                peers=peers,
            )
        return exc

    def _gone(self, peers: Sequence[int]) -> dict[int, str]:
        """The peers known gone once Gloo said a connection closed: one look at each of ``peers``'
        watch connections (a dead peer's is closed already, as its Gloo connections are), then,
        if none is, at most 0.5 s for a last word on its way (an aborting peer says it first).
        None gone: the peer is alive and closed its connections itself (Gloo closes every
        connection of a group when one of its operations times out)."""
        for peer in peers:
            self._watch.check(peer)
        return self._watch.wait_gone(0.5)

    def prepared_all_reduce(
        self, dtype: torch.dtype, op: ReduceOp, *, timeout: float
    ) -> Callable[[torch.Tensor], None] | None:
        """The blocking all_reduce with its options built once, waited for as every other call."""
        if super().prepared_all_reduce(dtype, op, timeout=timeout) is None:
            return None
        opts = self._opts("allreduce", timeout, op=op)
        ready, error, finish, everyone = self._ready, self._error, self._finish, self._everyone

        def run(tensor: torch.Tensor) -> None:
            pg = ready("all_reduce")
            try:
                work = pg.allreduce([tensor], opts)
            except RuntimeError as exc:
                raise error(exc, "all_reduce", timeout) from exc
            try:
                if slice_ended(work, SLICE):  # the first slice, inline: most calls end in it
                    return
            except RuntimeError as exc:
                raise error(exc, "all_reduce", timeout, everyone) from exc
            finish(work, "all_reduce", timeout, everyone)

        return run

    #: what Gloo's copying collectives refuse ("Invalid scalar type"): moved as bytes
    as_bytes = frozenset({torch.int16, torch.complex64, torch.complex128})

    #: a coalesced batch runs one call after another (the core's order): torch's Gloo cannot
    #: launch several as one (torch 2.13: ``supports_coalescing`` is False and
    #: ``_start_coalescing`` raises; pinned by ``test_gloo_has_no_coalescing``)
    coalesces = False

    # -- collectives: where Gloo differs ------------------------------------------------------
    def reduce(
        self, tensor: torch.Tensor, dst: int, op: ReduceOp, *, timeout: float, async_op: bool = False
    ) -> Work | None:
        # Gloo uses every rank's buffer as scratch: off the root, the input must not change
        return super().reduce(
            tensor if dst == self.rank else tensor.clone(), dst, op, timeout=timeout, async_op=async_op
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
        return self._reduce_then_slice(output, torch.cat([t.reshape(-1) for t in input_list]), op, timeout, async_op)

    def reduce_scatter_tensor(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp, *, timeout: float, async_op: bool = False
    ) -> Work | None:
        return self._reduce_then_slice(output, input.reshape(-1).clone(), op, timeout, async_op)

    def _reduce_then_slice(
        self, output: torch.Tensor, whole: torch.Tensor, op: ReduceOp, timeout: float, async_op: bool
    ) -> Work | None:
        """Gloo's reduce-scatter is an all-reduce of the whole input and a slice of it (what
        ``ProcessGroupGloo`` does itself), but its work has no future, so it could not complete an
        asynchronous call without a thread: the all-reduce is posted here instead, on a copy."""
        piece = output.numel()

        def copy_out() -> None:
            output.reshape(-1).copy_(whole[self.rank * piece : (self.rank + 1) * piece])

        work = super().all_reduce(whole, op, timeout=timeout, async_op=async_op)
        if work is None:
            copy_out()
            return None
        return then(work, copy_out)

    def all_to_all(
        self, output_list: list[torch.Tensor], input_list: list[torch.Tensor], *, timeout: float, async_op: bool = False
    ) -> Work | None:
        outs = [flat_bytes(t) for t in output_list]
        ins = [flat_bytes(t) for t in input_list]
        if len({t.numel() for t in outs} | {t.numel() for t in ins}) == 1:  # Gloo's alltoall: equal sizes only
            return super().all_to_all(outs, ins, timeout=timeout, async_op=async_op)
        # pieces of different sizes: one alltoall_base over the bytes, then the pieces copied out
        joined = torch.cat(ins) if ins else torch.empty(0, dtype=torch.uint8)
        received = torch.empty(sum(t.numel() for t in outs), dtype=torch.uint8)
        out_sizes, in_sizes = [t.numel() for t in outs], [t.numel() for t in ins]

        def copy_out() -> None:
            for out, piece in zip(outs, received.split(out_sizes), strict=True):
                out.copy_(piece)

        work = super().all_to_all_single(received, joined, out_sizes, in_sizes, timeout=timeout, async_op=async_op)
        if work is None:
            copy_out()
            return None
        return then(work, copy_out)

    # -- life ---------------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._broken is not None:  # Gloo's connections are closed: nothing to drain
            self.abort(word=b"S")
            return
        self._drain_large(self.ctx.timeout + 1.0)  # the sends in flight first
        self._stop_reaper(self.ctx.timeout + 1.0)
        self._watch.close(b"S")
        self._waiters.close()
        super().shutdown()
        self._spares.clear()

    def abort(self, word: bytes = b"A") -> None:
        """Close Gloo's connections now, then make every wait raise: operations blocked in other
        threads get :class:`~pg_core.errors.GroupClosedError` within ``SLICE_S``, and the peers
        are told (their errors say this rank aborted). The threads blocked in Gloo's waits are
        woken (:func:`~pg_gloo.waiting.wake_gloo_waits`); the Gloo object is let go in a thread
        of its own, whose end waits for torch's. The peers are told first, so that what their
        Gloo connections' closing fails reads as this abort."""
        self._watch.close(word)
        with self._closing:
            pg, self._pg = self._pg, None
            if pg is not None:
                pg.abort()
            self._broken = self._broken or "the group was aborted"
            self._aborted = True
        if pg is not None:
            self._wake(pg)  # Gloo's own threads leave their waits now
        self._stop_reaper(0.0)
        self._waiters.close()
        with self._buffered_cond:
            self._buffered_cond.notify_all()
        self._spares.clear()
        if pg is not None:
            self._release(pg)

    @staticmethod
    def _release(pg: Any) -> None:
        """Let go of an aborted Gloo object without waiting: its destructor joins Gloo's threads
        (woken from their waits by then, :func:`~pg_gloo.waiting.wake_gloo_waits`). While the interpreter
        finalizes (a group never shut down, collected at exit) no thread can start (starting one
        waits forever): the object is let go here."""
        holder = [pg]
        del pg
        if sys.is_finalizing():
            holder.clear()
            return
        threading.Thread(target=_let_go, args=(holder,), name="pg-gloo-release", daemon=True).start()

    def _stop_reaper(self, bound: float) -> None:
        with self._lock:
            reaper, self._reaper = self._reaper, None
            batch = self._take_unreaped()
        if reaper is not None:
            self._sends.put(batch)
            self._sends.put(None)
            if bound > 0:
                reaper.join(timeout=bound)


def _let_go(holder: list[Any]) -> None:
    time.sleep(0.01)  # let go of the GIL first (see pg_core.c10d._GIL_HANDOFF_S)
    holder.clear()


def _who(lost: Sequence[int], gone: dict[int, str]) -> str:
    """The peers gone, the dead first (a peer that aborted after a death is its consequence)."""
    return "; ".join(f"rank {p} {gone[p]}" for p in sorted(lost, key=lambda p: gone[p] != DIED))


def _blamed(lost: Sequence[int], gone: dict[int, str]) -> list[int]:
    """Whom an error names (its ``peers``, which ``shrink()`` leaves out): the peers that died,
    or if none did, those that aborted or shut down."""
    return [p for p in lost if gone[p] == DIED] or list(lost)
