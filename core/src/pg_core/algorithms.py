"""Every collective, written once on point-to-point messages.

These are the defaults of :class:`pg_core.backend.Backend`: a backend that
implements only ``send`` and ``recv`` gets all of them. They run on a
:class:`Channel`, which a backend may build with its own framing.

Guarantees every algorithm here keeps:

* all ranks end with bitwise-identical ``all_reduce`` results, and
  ``reduce_scatter`` results are reproducible: every element is reduced exactly
  once, in an order fixed by the algorithm (which depends only on the group size,
  the element count, the dtype and the :class:`Tuning`), then copied to whoever
  needs it;
* inputs that the operation does not define as outputs are left unchanged;
* zero-element and 0-d tensors work; zero-element pieces still travel as empty
  messages, so every rank agrees on which messages exist;
* temporary memory is bounded: at most a buffer per rank on the small
  (latency-optimal) paths, and :attr:`Tuning.pipeline` segments of
  :attr:`Tuning.segment_bytes` on the large (bandwidth-optimal) ones, never a
  multiple of the tensor per peer;
* reductions run on the calling thread (see :attr:`Tuning.serial_elems`), or, launched,
  on the thread that completed the message they need;
* every wait is bounded by the channel's deadline;
* the only communication is the channel's ``isend``/``irecv``/``wait``; no step waits
  for a send whose receive the peer could only post after this rank went on (a ring
  step posts its receive, then its send, then waits), so a backend's ``send`` may be
  eager or rendezvous (above its ``eager_limit_bytes`` it may wait for the receiver), as
  long as ``isend`` and ``irecv`` are asynchronous (the :class:`pg_core.backend.Backend`
  contract).

**Written once, run blocking or launched.** Each collective is a generator of
:data:`Steps` (``all_reduce_steps`` beside ``all_reduce``, and so on): it posts its
sends and receives with ``isend``/``irecv`` and yields each work it must see completed
before it goes on. :func:`run` (what ``all_reduce`` and the other plain functions do)
waits for each in the caller's thread; :func:`launch` returns a :class:`Work` at once
and advances the steps from each work's completion, in the thread that completed it,
with no thread of its own: the launched form (API 1.2, ``Backend.launches``) of a
backend whose transport completes works without being waited for (pg-tcp's progress
engine). Both forms send the same messages in the same order and fold in the same
order, so they leave the same bits.

Which algorithm runs is decided from values every rank knows (group size, element
count, dtype and the :class:`Tuning` that every function takes as ``tuning=``,
default :data:`DEFAULT_TUNING`), never from timing, so all ranks always run the
same one. All tensors arrive contiguous and validated by the core; reductions
accept every :class:`~pg_core.ops.ReduceOp` that
:func:`pg_core.backend.default_reduce_ops` allows for the dtype.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

import torch

from .errors import CollectiveTimeout
from .ops import RedOpType, ReduceOp
from .timeouts import Deadline
from .work import Work

__all__ = [
    "BINARY_OPS",
    "DEFAULT_TUNING",
    "Channel",
    "P2PChannel",
    "PointToPoint",
    "Tuning",
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "binomial_tree",
    "broadcast",
    "combine_",
    "divide_",
    "elementwise",
    "gather",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scale_",
    "scatter",
]


class Channel(Protocol):
    """Point-to-point messaging between the ranks of one group, for one operation.
    (The algorithms use ``isend``, ``irecv`` and ``wait``; ``send``, ``recv`` and
    ``sendrecv`` are for a backend's own code.)

    ``send`` returns when the tensor may be reused; ``recv`` fills the tensor
    with the next message from ``peer`` on this channel (messages between two
    ranks arrive in the order sent, and receives match in the order posted).
    ``isend``/``irecv`` start the same and return a :class:`Work`; a buffer given
    to them must not be touched until :meth:`wait` returned for its work.
    ``sendrecv`` does both at once and is how ring steps exchange data without
    deadlock. A receive whose tensor does not match the message's size and dtype
    is an error, never a silent truncation. A channel's deadline bounds every
    call: past it they raise :class:`~pg_core.errors.CollectiveTimeout`.
    """

    rank: int
    size: int

    def send(self, tensor: torch.Tensor, peer: int) -> None: ...

    def recv(self, tensor: torch.Tensor, peer: int) -> None: ...

    def isend(self, tensor: torch.Tensor, peer: int) -> Work: ...

    def irecv(self, tensor: torch.Tensor, peer: int) -> Work: ...

    def sendrecv(self, send_tensor: torch.Tensor, dst: int, recv_tensor: torch.Tensor, src: int) -> None: ...

    def wait(self, work: Work) -> None: ...


class PointToPoint(Protocol):
    """What :class:`P2PChannel` needs of a backend: the contract's point-to-point methods."""

    def send(self, tensor: torch.Tensor, dst: int, tag: int, *, timeout: float) -> None: ...

    def recv(self, tensor: torch.Tensor, src: int, tag: int, *, timeout: float) -> None: ...

    def isend(self, tensor: torch.Tensor, dst: int, tag: int, *, timeout: float) -> Work: ...

    def irecv(self, tensor: torch.Tensor, src: int, tag: int, *, timeout: float) -> Work: ...


class P2PChannel:
    """The :class:`Channel` the default collectives run on: a backend's ``send``/``recv``
    with one tag and one deadline for the whole operation.

    ``isend``/``irecv`` are the backend's own where it has them (``native_isend``,
    ``native_irecv``). Otherwise a send happens at once (a backend without an ``isend`` of its
    own declares no eager limit where it leaves a collective to these defaults: its ``send``
    never waits for its receiver; the core refuses it otherwise) and a receive happens when it is waited for, receives from one peer
    in the order they were posted: no thread, no handoff.
    """

    def __init__(
        self,
        backend: PointToPoint,
        rank: int,
        size: int,
        timeout: float,
        tag: int,
        *,
        native_isend: bool,
        native_irecv: bool,
    ) -> None:
        self.backend = backend
        self.rank = rank
        self.size = size
        self.tag = tag
        self.deadline = Deadline("collective", timeout)
        self._native_isend = native_isend
        self._native_irecv = native_irecv
        self._sends: list[Work] = []  # native sends, whose errors explain a receive's timeout
        self._posted: dict[int, deque[tuple[Work, torch.Tensor]]] = {}  # deferred receives per peer

    def remaining(self) -> float:
        """Seconds left before the deadline; raises once it has passed."""
        return self.deadline.left()

    def send(self, tensor: torch.Tensor, peer: int) -> None:
        self.backend.send(tensor, peer, self.tag, timeout=self.remaining())

    def recv(self, tensor: torch.Tensor, peer: int) -> None:
        if self._posted.get(peer):  # behind receives posted earlier from this peer
            work = self.irecv(tensor, peer)
            self.wait(work)
            return
        self.backend.recv(tensor, peer, self.tag, timeout=self.remaining())

    def isend(self, tensor: torch.Tensor, peer: int) -> Work:
        if not self._native_isend:
            self.send(tensor, peer)
            return Work.completed("send")
        work = self.backend.isend(tensor, peer, self.tag, timeout=self.remaining())
        self._sends.append(work)
        return work

    def irecv(self, tensor: torch.Tensor, peer: int) -> Work:
        if self._native_irecv:
            return self.backend.irecv(tensor, peer, self.tag, timeout=self.remaining())
        work = Work("recv", driver=lambda w, t: self._receive_through(peer, w) if t > 0 else None)
        self._posted.setdefault(peer, deque()).append((work, tensor))
        return work

    def _receive_through(self, peer: int, work: Work) -> None:
        """Receive, in posting order, every deferred receive from ``peer`` up to ``work``."""
        queue = self._posted.get(peer)
        while queue and not work.is_completed():
            posted, tensor = queue.popleft()
            try:
                self.backend.recv(tensor, peer, self.tag, timeout=self.remaining())
            except BaseException as exc:
                posted.set_exception(exc)
                for later, _ in queue:  # the stream from this peer is out of step now
                    later.set_exception(exc)
                queue.clear()
            else:
                posted.set_result(None)

    def sendrecv(self, send_tensor: torch.Tensor, dst: int, recv_tensor: torch.Tensor, src: int) -> None:
        work = self.isend(send_tensor, dst)
        try:
            self.recv(recv_tensor, src)
        except CollectiveTimeout as exc:
            self._raise_failed_send(exc)
            raise
        self.wait(work)

    def wait(self, work: Work) -> None:
        try:
            work.wait(self.remaining())
        except CollectiveTimeout as exc:
            self._raise_failed_send(exc)
            raise

    def _raise_failed_send(self, timeout: CollectiveTimeout) -> None:
        """A receive that timed out often waited on a peer whose own send failed, or on
        this rank's send that failed: that error is the cause, so it is the one raised."""
        for work in self._sends:
            if work.is_completed():
                error = work.exception(0)
                if error is not None:
                    raise error from timeout


def binomial_tree(vrank: int, size: int) -> tuple[int | None, list[int]]:
    """The parent (``None`` at the root) and the children of virtual rank ``vrank`` in a
    binomial tree of ``size`` ranks rooted at virtual rank 0, children smallest subtree
    first. Rank ``r`` of a tree rooted at ``root`` is virtual rank ``(r - root) % size``."""
    children: list[int] = []
    mask = 1
    while mask < size:
        if vrank & mask:
            return vrank - mask, children
        if vrank + mask < size:
            children.append(vrank + mask)
        mask <<= 1
    return None, children


@dataclass(frozen=True)
class Tuning:
    """Where the algorithms switch from latency-optimal to bandwidth-optimal, and
    how they move and reduce large tensors.

    ``small_bytes``: tensors of at most this many bytes (per rank's piece for
    ``all_gather`` and ``reduce_scatter``) use direct exchanges: one message per
    peer, finished in one round. Larger ones use rings (``all_reduce``,
    ``reduce_scatter``, ``all_gather``) whose per-rank traffic does not grow with
    the group size.

    ``segment_bytes``: large transfers move in segments of at most this many
    bytes, which bounds temporary memory to a few segments, lets communication
    overlap reduction, and pipelines ``broadcast``/``reduce`` along a chain when
    that beats a binomial tree.

    ``pipeline``: how many segments a ring keeps in flight (its receive buffers).

    ``serial_elems``: reductions run on the calling thread, in slices of at most
    this many elements (torch's grain size, below which it does not wake its
    intra-op thread pool), as Gloo's do: pool threads spinning after each
    reduction take the cores that the peers and the transport need. ``0`` lets
    torch parallelise each reduction.

    Every rank of a group must use the same ``small_bytes``, ``segment_bytes``
    and ``pipeline``.
    """

    small_bytes: int = 64 * 1024
    segment_bytes: int = 1024 * 1024
    pipeline: int = 4
    serial_elems: int = 32768

    def __post_init__(self) -> None:
        for name, least in (("small_bytes", 0), ("segment_bytes", 1), ("pipeline", 1), ("serial_elems", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < least:
                raise ValueError(f"Tuning.{name} must be an integer >= {least}, got {value!r}")

    def segment_elems(self, dtype_size: int) -> int:
        """Elements per segment for elements of ``dtype_size`` bytes (at least one)."""
        return max(1, self.segment_bytes // dtype_size)


#: The tuning used when a function is not given one.
DEFAULT_TUNING: Final[Tuning] = Tuning()


# -- reductions ------------------------------------------------------------------

_Binary = Callable[..., torch.Tensor]

#: ``fn(a, b, out=c)`` computes ``a (op) b`` elementwise; ``c`` may be ``a`` or ``b``.
#: AVG and PREMUL_SUM sum (the division and the factor are applied around it).
BINARY_OPS: Final[dict[RedOpType, _Binary]] = {
    RedOpType.SUM: torch.add,
    RedOpType.AVG: torch.add,
    RedOpType.PREMUL_SUM: torch.add,
    RedOpType.PRODUCT: torch.mul,
    RedOpType.MIN: torch.minimum,
    RedOpType.MAX: torch.maximum,
    RedOpType.BAND: torch.bitwise_and,
    RedOpType.BOR: torch.bitwise_or,
    RedOpType.BXOR: torch.bitwise_xor,
}


def combine_(acc: torch.Tensor, other: torch.Tensor, op: RedOpType) -> None:
    """``acc = acc (op) other`` in place, for the pairwise ops (SUM for AVG/PREMUL_SUM)."""
    BINARY_OPS[op](acc, other, out=acc)


def elementwise(fn: _Binary, out: torch.Tensor, a: torch.Tensor, b: object, serial: int, **kwargs: Any) -> None:
    """``fn(a, b, out=out, **kwargs)``, in slices of at most ``serial`` elements (``0``: whole):
    how every reduction of the algorithms runs (see :attr:`Tuning.serial_elems`), and how a
    backend's own reductions can run the same way.

    ``a`` has ``out``'s element count; ``b`` is a tensor like it or a scalar.
    Elementwise, so the slicing never changes a result.
    """
    n = out.numel()
    if serial <= 0 or n <= serial:
        fn(a, b, out=out, **kwargs)
    elif isinstance(b, torch.Tensor):
        for o, x, y in zip(out.split(serial), a.split(serial), b.split(serial), strict=True):
            fn(x, y, out=o, **kwargs)
    else:
        for o, x in zip(out.split(serial), a.split(serial), strict=True):
            fn(x, b, out=o, **kwargs)


def scale_(tensor: torch.Tensor, factor: float | complex, serial: int) -> None:
    """The PREMUL_SUM start: ``tensor *= factor`` in place, in slices of ``serial`` elements."""
    elementwise(torch.mul, tensor, tensor, factor, serial)


def divide_(tensor: torch.Tensor, size: int, serial: int) -> None:
    """The AVG finish, ``tensor /= size`` in place in slices of ``serial`` elements: floating
    point divides; integers (never sent by the core) truncate."""
    if tensor.is_floating_point() or tensor.is_complex():
        elementwise(torch.div, tensor, tensor, size, serial)
    else:
        elementwise(torch.div, tensor, tensor, size, serial, rounding_mode="trunc")


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D alias of a contiguous tensor, outside autograd (collectives write parameters too)."""
    if tensor.requires_grad:
        tensor = tensor.detach()
    return tensor if tensor.dim() == 1 else tensor.reshape(-1)


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors share memory."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.nbytes and b0 < a0 + a.nbytes


def _blocks(flat: torch.Tensor, size: int) -> list[torch.Tensor]:
    """``flat`` split into ``size`` contiguous pieces whose lengths differ by at most one."""
    base, rem = divmod(flat.numel(), size)
    bounds = [c * base + min(c, rem) for c in range(size + 1)]
    return [flat[bounds[c] : bounds[c + 1]] for c in range(size)]


def _log2_ceil(n: int) -> int:
    return (n - 1).bit_length()


def _prefer_chain(size: int, segments: int) -> bool:
    """Whether a pipelined chain beats a binomial tree for ``segments`` segments.

    A chain takes ``segments + size - 2`` segment times; a binomial tree's root
    moves every segment ``ceil(log2 size)`` times.
    """
    return size > 2 and segments + size - 2 < _log2_ceil(size) * segments


# -- running an algorithm: blocking, or launched ----------------------------------

#: An algorithm in steps: a generator that posts its sends and receives on the channel and
#: yields each work it must see completed before it goes on (its buffers, its folds). Every
#: collective here is written once, as steps; :func:`run` is its blocking form and
#: :func:`launch` its launched one.
Steps = Generator[Work, None, None]


def run(ch: Channel, steps: Steps) -> None:
    """Run ``steps`` to the end in the calling thread, waiting for each work it yields with
    ``ch.wait`` (which raises its error): the blocking form of every collective here."""
    for work in steps:
        ch.wait(work)


def launch(ch: Channel, steps: Steps, op: str = "collective") -> Work:
    """Start ``steps`` and return a :class:`Work` at once: the launched form of a collective,
    for a channel whose works complete without being waited for (a transport with its own
    progress, such as pg-tcp's). Everything up to the first work that is not complete yet
    runs here, in the calling thread, so an error there (a bad argument, a broken stream)
    raises here; after that, each completed work advances the steps in the thread that
    completed it (``Work.add_done_callback``), up to the next one still pending, with no
    thread of its own. The returned work completes when the steps end, or fails with the
    first error (``ch.wait``'s, as in the blocking form), after which the steps are closed.
    Waiting on it (or polling it) drives the work the steps are at."""
    current: list[Work | None] = [None]

    def drive(_: Work, timeout: float) -> None:
        work = current[0]
        if work is not None and not work.done:
            if timeout <= 0:
                work.is_completed()
            else:
                work.wait_until_done(timeout)
        elif timeout > 0:  # between works (another thread is advancing the steps): wait briefly
            outer.wait_undriven(min(timeout, 0.001))

    def advance(done: Work | None) -> Work | None:
        """Go on after ``done``: the next work still pending (now watched), or ``None`` at the end."""
        if done is not None:
            ch.wait(done)  # complete: returns at once, or raises its error as the blocking form would
        for work in steps:
            if not work.done:
                current[0] = work
                work.add_done_callback(resume)
                return work
            ch.wait(work)
        current[0] = None
        outer.set_result(None)
        return None

    def resume(done: Work) -> None:
        try:
            advance(done)
        except BaseException as exc:
            current[0] = None
            steps.close()
            outer.set_exception(exc)

    outer = Work(op, driver=drive)
    try:
        advance(None)
    except BaseException:
        steps.close()
        raise
    return outer


def _all(works: list[Work]) -> Steps:
    """Wait for each of ``works`` in order, and empty the list (it is reused)."""
    pending = works[:]
    works.clear()
    yield from pending


def _exchange(ch: Channel, send_tensor: torch.Tensor, dst: int, recv_tensor: torch.Tensor, src: int) -> Steps:
    """Send to ``dst`` while receiving from ``src`` (how ring steps exchange data without
    deadlock): the receive is posted first, so a rendezvous send finds it."""
    received = ch.irecv(recv_tensor, src)
    sent = ch.isend(send_tensor, dst)
    yield received
    yield sent


# -- all_reduce ------------------------------------------------------------------


def all_reduce(ch: Channel, tensor: torch.Tensor, op: ReduceOp, *, tuning: Tuning | None = None) -> None:
    """Reduce ``tensor`` over every rank, in place; all ranks end with the same bits.

    Up to :attr:`Tuning.small_bytes` every rank sends its tensor to every peer
    and folds the contributions in rank order ``0 .. size-1`` (one round of
    messages, one receive buffer per peer at most). Larger tensors use a
    segmented, pipelined ring (reduce-scatter, then all-gather): each element
    is reduced once, by one rank, and copied to the others; temporary memory is
    :attr:`Tuning.pipeline` segments.
    """
    run(ch, all_reduce_steps(ch, tensor, op, tuning=tuning))


def all_reduce_steps(ch: Channel, tensor: torch.Tensor, op: ReduceOp, *, tuning: Tuning | None = None) -> Steps:
    """:func:`all_reduce` in steps: see :func:`run` and :func:`launch`."""
    flat = _flat(tensor)
    kind = op.type
    tune = tuning or DEFAULT_TUNING
    if kind is RedOpType.PREMUL_SUM:
        scale_(flat, op.factor_value(), tune.serial_elems)  # once per contribution, at its source
    size = ch.size
    if size == 1:
        return
    if flat.nbytes <= tune.small_bytes:
        yield from _direct_all_reduce(ch, flat, kind, tune.serial_elems)
    else:
        blocks = _blocks(flat, size)
        yield from _ring_reduce_scatter(ch, blocks, blocks, kind, tuning=tune)
        yield from _ring_all_gather(ch, blocks)


def _direct_all_reduce(ch: Channel, flat: torch.Tensor, kind: RedOpType, serial: int) -> Steps:
    """Everyone sends to everyone; each rank folds ``x0 (op) x1 (op) ...`` in rank order."""
    size, rank = ch.size, ch.rank
    fn = BINARY_OPS[kind]
    if size == 2:
        peer = 1 - rank
        other = torch.empty_like(flat)
        yield from _exchange(ch, flat, peer, other, peer)
        if rank == 0:
            elementwise(fn, flat, flat, other, serial)
        else:
            elementwise(fn, flat, other, flat, serial)
    else:
        sends = [ch.isend(flat, (rank + k) % size) for k in range(1, size)]
        # rank 0 folds straight into its tensor; the others fold x0 .. x(rank-1) into
        # a scratch row first, because their own tensor is still being sent and is
        # their contribution at position ``rank``.
        bufs = flat.new_empty((1 if rank == 0 else 2, flat.numel()))
        incoming = bufs[-1]
        acc = flat
        for i in range(size):
            if i == rank:
                if i == 0:
                    continue
                yield from _all(sends)
                elementwise(fn, flat, acc, flat, serial)
                acc = flat
            elif i == 0:
                acc = bufs[0]
                yield ch.irecv(acc, 0)
            else:
                yield ch.irecv(incoming, i)
                if acc is flat and sends:
                    yield from _all(sends)
                elementwise(fn, acc, acc, incoming, serial)
    if kind is RedOpType.AVG:
        divide_(flat, size, serial)


_Started = tuple[Work, Work, torch.Tensor, torch.Tensor, torch.Tensor, bool]


def _ring_reduce_scatter(
    ch: Channel,
    own: Sequence[torch.Tensor],
    acc: Sequence[torch.Tensor],
    kind: RedOpType,
    *,
    tuning: Tuning,
    factor: float | complex | None = None,
) -> Steps:
    """Segmented ring reduce-scatter: on return ``acc[rank]`` holds block ``rank`` reduced.

    ``own[c]`` is this rank's contribution to block ``c`` (read only); ``acc[c]``
    is where this rank keeps the running partial of block ``c`` while it passes
    through (it may be ``own[c]`` itself, or one buffer shared by every block).
    Block ``c`` is folded in ring order ``c+1, c+2, ..., c`` (partial on the
    left), each contribution multiplied by ``factor`` when one is given, and the
    AVG division happens once, on the owner.

    Transfers are numbered ``i = step * nseg + segment``. Up to
    ``tuning.pipeline`` of them are in flight: transfer ``i`` is posted as soon
    as what it sends exists (for ``step > 0``, the fold of transfer
    ``i - nseg``), so segments stream around the ring while earlier ones are
    being reduced. Temporary memory: ``pipeline`` receive segments (as many
    again for scaled sends when ``factor`` is given).
    """
    size, rank = ch.size, ch.rank
    right, left = (rank + 1) % size, (rank - 1) % size
    seg = tuning.segment_elems(own[0].element_size())
    longest = max(block.numel() for block in own)
    nseg = max(1, -(-longest // seg))
    seg_len = min(seg, longest)
    total = (size - 1) * nseg
    depth = min(tuning.pipeline, total)
    serial = tuning.serial_elems
    rbufs = own[0].new_empty((depth, seg_len))
    sbufs = own[0].new_empty((min(depth, nseg), seg_len)) if factor is not None else None
    fn = BINARY_OPS[kind]
    last_step = size - 2

    def start(i: int) -> _Started:
        step, j = divmod(i, nseg)
        lo, hi = j * seg, (j + 1) * seg
        slot = i % depth
        sent, received = (rank - step - 1) % size, (rank - step - 2) % size
        if step > 0:
            src = acc[sent][lo:hi]
        elif factor is not None:
            assert sbufs is not None
            piece = own[sent][lo:hi]
            src = sbufs[slot][: piece.numel()]
            elementwise(torch.mul, src, piece, factor, serial)
        else:
            src = own[sent][lo:hi]
        mine = own[received][lo:hi]
        rbuf = rbufs[slot][: mine.numel()]
        rwork = ch.irecv(rbuf, left)
        swork = ch.isend(src, right)
        return swork, rwork, rbuf, mine, acc[received][lo:hi], step == last_step

    pending: deque[_Started] = deque()
    posted = 0
    for i in range(total):
        # Post what may go now: within ``depth`` of the transfer being folded (its
        # receive buffer is free) and, past step 0, already folded here.
        while posted < total and posted < i + depth and (posted < nseg or posted - nseg < i):
            pending.append(start(posted))
            posted += 1
        swork, rwork, rbuf, mine, dest, final = pending.popleft()
        yield rwork
        yield swork  # ``dest`` may be the buffer that was sent
        if factor is not None:
            elementwise(torch.add, dest, rbuf, mine, serial, alpha=factor)
        else:
            elementwise(fn, dest, rbuf, mine, serial)
        if final and kind is RedOpType.AVG:
            divide_(dest, size, serial)


def _ring_all_gather(ch: Channel, blocks: Sequence[torch.Tensor]) -> Steps:
    """Ring all-gather in place: ``blocks[rank]`` is this rank's; on return every block is filled."""
    size, rank = ch.size, ch.rank
    right, left = (rank + 1) % size, (rank - 1) % size
    for step in range(size - 1):
        yield from _exchange(ch, blocks[(rank - step) % size], right, blocks[(rank - step - 1) % size], left)


def _direct_all_gather(ch: Channel, blocks: Sequence[torch.Tensor]) -> Steps:
    """One message from every rank to every peer: ``blocks[rank]`` is this rank's."""
    size, rank = ch.size, ch.rank
    if size == 2:
        yield from _exchange(ch, blocks[rank], 1 - rank, blocks[1 - rank], 1 - rank)
        return
    sends = [ch.isend(blocks[rank], (rank + k) % size) for k in range(1, size)]
    for k in range(1, size):
        peer = (rank - k) % size
        yield ch.irecv(blocks[peer], peer)
    yield from _all(sends)


# -- broadcast and reduce --------------------------------------------------------


def broadcast(ch: Channel, tensor: torch.Tensor, src: int, *, tuning: Tuning | None = None) -> None:
    """Copy ``src``'s ``tensor`` into ``tensor`` on every rank.

    A binomial tree rooted at ``src``; when a pipelined chain is faster (large
    tensors on three or more ranks) the tensor flows down the chain
    ``src, src+1, ...`` in segments. No temporary memory.
    """
    run(ch, broadcast_steps(ch, tensor, src, tuning=tuning))


def broadcast_steps(ch: Channel, tensor: torch.Tensor, src: int, *, tuning: Tuning | None = None) -> Steps:
    """:func:`broadcast` in steps: see :func:`run` and :func:`launch`."""
    size = ch.size
    if size == 1:
        return
    flat = _flat(tensor)
    seg = (tuning or DEFAULT_TUNING).segment_elems(flat.element_size())
    nseg = max(1, -(-flat.numel() // seg))
    vrank = (ch.rank - src) % size
    if _prefer_chain(size, nseg):
        yield from _chain_broadcast(ch, flat, vrank, seg, nseg)
    else:
        yield from _tree_broadcast(ch, flat, vrank, src)


def _tree_broadcast(ch: Channel, flat: torch.Tensor, vrank: int, root: int) -> Steps:
    size = ch.size
    parent, children = binomial_tree(vrank, size)
    if parent is not None:
        yield ch.irecv(flat, (parent + root) % size)
    for child in reversed(children):  # largest subtree first
        yield ch.isend(flat, (child + root) % size)


def _chain_broadcast(ch: Channel, flat: torch.Tensor, vrank: int, seg: int, nseg: int) -> Steps:
    size, rank = ch.size, ch.rank
    right, left = (rank + 1) % size, (rank - 1) % size
    previous: Work | None = None
    for j in range(nseg):
        piece = flat[j * seg : (j + 1) * seg]
        if vrank > 0:
            yield ch.irecv(piece, left)
        if vrank < size - 1:
            work = ch.isend(piece, right)
            if previous is not None:
                yield previous
            previous = work
    if previous is not None:
        yield previous


def reduce(ch: Channel, tensor: torch.Tensor, dst: int, op: ReduceOp, *, tuning: Tuning | None = None) -> None:
    """Reduce ``tensor`` over every rank into ``tensor`` on ``dst``.

    Other ranks' tensors are left unchanged. A binomial tree rooted at ``dst``
    folding in ascending ``(rank - dst) % size`` order, or, when it is faster
    (large tensors on three or more ranks), a pipelined chain
    ``dst+size-1 -> ... -> dst``; both move the tensor in segments, so temporary
    memory is a few segments.
    """
    run(ch, reduce_steps(ch, tensor, dst, op, tuning=tuning))


def reduce_steps(ch: Channel, tensor: torch.Tensor, dst: int, op: ReduceOp, *, tuning: Tuning | None = None) -> Steps:
    """:func:`reduce` in steps: see :func:`run` and :func:`launch`."""
    flat = _flat(tensor)
    tune = tuning or DEFAULT_TUNING
    size = ch.size
    factor = op.factor_value() if op.type is RedOpType.PREMUL_SUM else None
    if size == 1:
        if factor is not None:
            scale_(flat, factor, tune.serial_elems)
        return
    seg = tune.segment_elems(flat.element_size())
    nseg = max(1, -(-flat.numel() // seg))
    vrank = (ch.rank - dst) % size
    if _prefer_chain(size, nseg):
        yield from _chain_reduce(
            ch, flat, vrank, kind=op.type, factor=factor, seg=seg, nseg=nseg, serial=tune.serial_elems
        )
    else:
        yield from _tree_reduce(
            ch, flat, vrank, dst, kind=op.type, factor=factor, seg=seg, nseg=nseg, serial=tune.serial_elems
        )


def _tree_reduce(
    ch: Channel,
    flat: torch.Tensor,
    vrank: int,
    root: int,
    *,
    kind: RedOpType,
    factor: float | complex | None,
    seg: int,
    nseg: int,
    serial: int,
) -> Steps:
    size = ch.size
    vparent, vchildren = binomial_tree(vrank, size)
    parent = None if vparent is None else (vparent + root) % size
    children = [(c + root) % size for c in vchildren]
    seg_len = min(seg, flat.numel())
    rbuf = flat.new_empty(seg_len) if children else None
    # a non-root rank never writes its tensor: it reduces (or scales) into ``abuf``
    abuf = flat.new_empty(seg_len) if parent is not None and (children or factor is not None) else None
    fn = BINARY_OPS[kind]
    if parent is None and factor is not None:
        scale_(flat, factor, serial)
    for j in range(nseg):
        mine = flat[j * seg : (j + 1) * seg]
        n = mine.numel()
        acc = mine
        if parent is not None and factor is not None:
            assert abuf is not None
            acc = abuf[:n]
            elementwise(torch.mul, acc, mine, factor, serial)
        for child in children:
            assert rbuf is not None
            incoming = rbuf[:n]
            yield ch.irecv(incoming, child)
            dest = abuf[:n] if acc is mine and abuf is not None else acc
            elementwise(fn, dest, acc, incoming, serial)
            acc = dest
        if parent is not None:
            yield ch.isend(acc, parent)
    if parent is None and kind is RedOpType.AVG:
        divide_(flat, size, serial)


def _chain_reduce(
    ch: Channel,
    flat: torch.Tensor,
    vrank: int,
    *,
    kind: RedOpType,
    factor: float | complex | None,
    seg: int,
    nseg: int,
    serial: int,
) -> Steps:
    """Partials flow from ``vrank size-1`` down to ``vrank 0``: ``x0 (op) (x1 (op) (...))``."""
    size, rank = ch.size, ch.rank
    right, left = (rank + 1) % size, (rank - 1) % size
    seg_len = min(seg, flat.numel())
    fn = BINARY_OPS[kind]
    if vrank == size - 1:  # the far end: sends its own segments
        sbuf = flat.new_empty(seg_len) if factor is not None else None
        for j in range(nseg):
            mine = flat[j * seg : (j + 1) * seg]
            if factor is not None:
                assert sbuf is not None
                scaled = sbuf[: mine.numel()]
                elementwise(torch.mul, scaled, mine, factor, serial)
                mine = scaled
            yield ch.isend(mine, left)
        return
    bufs = flat.new_empty((2, seg_len))
    sends: list[Work | None] = [None, None]
    for j in range(nseg):
        mine = flat[j * seg : (j + 1) * seg]
        slot = j & 1
        previous = sends[slot]
        if previous is not None:
            yield previous
        incoming = bufs[slot][: mine.numel()]
        yield ch.irecv(incoming, right)
        dest = mine if vrank == 0 else incoming
        if factor is not None:
            elementwise(torch.add, dest, incoming, mine, serial, alpha=factor)
        else:
            elementwise(fn, dest, mine, incoming, serial)
        if vrank == 0:
            if kind is RedOpType.AVG:
                divide_(dest, size, serial)
        else:
            sends[slot] = ch.isend(dest, left)
    for work in sends:
        if work is not None:
            yield work


# -- gathers ---------------------------------------------------------------------


def all_gather(
    ch: Channel, output_list: list[torch.Tensor], tensor: torch.Tensor, *, tuning: Tuning | None = None
) -> None:
    """``output_list[i]`` receives rank ``i``'s ``tensor`` on every rank.

    Direct exchange up to :attr:`Tuning.small_bytes` per rank, a ring beyond.
    ``tensor`` may be ``output_list[rank]`` itself.
    """
    run(ch, all_gather_steps(ch, output_list, tensor, tuning=tuning))


def all_gather_steps(
    ch: Channel, output_list: list[torch.Tensor], tensor: torch.Tensor, *, tuning: Tuning | None = None
) -> Steps:
    """:func:`all_gather` in steps: see :func:`run` and :func:`launch`."""
    blocks = [_flat(out) for out in output_list]
    yield from _all_gather_blocks(ch, blocks, _flat(tensor), tuning or DEFAULT_TUNING)


def all_gather_into_tensor(
    ch: Channel, output: torch.Tensor, input: torch.Tensor, *, tuning: Tuning | None = None
) -> None:
    """``output`` (``size * input.numel()`` elements, flat) becomes every rank's ``input`` in rank order.

    ``input`` may be this rank's block of ``output``.
    """
    run(ch, all_gather_into_tensor_steps(ch, output, input, tuning=tuning))


def all_gather_into_tensor_steps(
    ch: Channel, output: torch.Tensor, input: torch.Tensor, *, tuning: Tuning | None = None
) -> Steps:
    """:func:`all_gather_into_tensor` in steps: see :func:`run` and :func:`launch`."""
    blocks = _blocks(_flat(output), ch.size)
    yield from _all_gather_blocks(ch, blocks, _flat(input), tuning or DEFAULT_TUNING)


def _all_gather_blocks(ch: Channel, blocks: list[torch.Tensor], mine: torch.Tensor, tuning: Tuning) -> Steps:
    # Sends always read this rank's output block, so an input that aliases another
    # block is copied out before anything can overwrite it.
    blocks[ch.rank].copy_(mine)
    if ch.size == 1:
        return
    if mine.nbytes <= tuning.small_bytes:
        yield from _direct_all_gather(ch, blocks)
    else:
        yield from _ring_all_gather(ch, blocks)


def gather(
    ch: Channel,
    tensor: torch.Tensor,
    gather_list: list[torch.Tensor] | None,
    dst: int,
    *,
    tuning: Tuning | None = None,
) -> None:
    """``gather_list[i]`` on ``dst`` receives rank ``i``'s ``tensor``; other ranks only send.

    ``gather_list`` is a list on ``dst`` and ``None`` elsewhere. Linear: the
    root receives from each rank in rank order. (``tuning`` is accepted and
    unused.)
    """
    run(ch, gather_steps(ch, tensor, gather_list, dst, tuning=tuning))


def gather_steps(
    ch: Channel,
    tensor: torch.Tensor,
    gather_list: list[torch.Tensor] | None,
    dst: int,
    *,
    tuning: Tuning | None = None,
) -> Steps:
    """:func:`gather` in steps: see :func:`run` and :func:`launch`."""
    if ch.rank != dst:
        yield ch.isend(_flat(tensor), dst)
        return
    if gather_list is None:
        raise ValueError(f"gather: rank {dst} is the destination and needs a gather_list")
    _flat(gather_list[dst]).copy_(_flat(tensor))
    for peer in range(ch.size):
        if peer != dst:
            yield ch.irecv(_flat(gather_list[peer]), peer)


def scatter(
    ch: Channel,
    tensor: torch.Tensor,
    scatter_list: list[torch.Tensor] | None,
    src: int,
    *,
    tuning: Tuning | None = None,
) -> None:
    """``tensor`` on rank ``i`` receives ``scatter_list[i]`` of ``src``.

    ``scatter_list`` is a list on ``src`` and ``None`` elsewhere; it is not
    modified. Linear: the root sends to each rank in turn. (``tuning`` is
    accepted and unused.)
    """
    run(ch, scatter_steps(ch, tensor, scatter_list, src, tuning=tuning))


def scatter_steps(
    ch: Channel,
    tensor: torch.Tensor,
    scatter_list: list[torch.Tensor] | None,
    src: int,
    *,
    tuning: Tuning | None = None,
) -> Steps:
    """:func:`scatter` in steps: see :func:`run` and :func:`launch`."""
    if ch.rank != src:
        yield ch.irecv(_flat(tensor), src)
        return
    if scatter_list is None:
        raise ValueError(f"scatter: rank {src} is the source and needs a scatter_list")
    for k in range(1, ch.size):
        peer = (src + k) % ch.size
        yield ch.isend(_flat(scatter_list[peer]), peer)
    _flat(tensor).copy_(_flat(scatter_list[src]))


# -- reduce_scatter --------------------------------------------------------------


def reduce_scatter(
    ch: Channel,
    output: torch.Tensor,
    input_list: list[torch.Tensor],
    op: ReduceOp,
    *,
    tuning: Tuning | None = None,
) -> None:
    """``output`` on rank ``i`` becomes ``input_list[i]`` reduced over every rank.

    Every ``input_list`` entry has ``output``'s element count; inputs are left
    unchanged. Direct exchange (fold in rank order ``0 .. size-1``, the same bits
    as the direct ``all_reduce``) up to :attr:`Tuning.small_bytes` of
    ``output``, a segmented ring beyond (fold in ring order); either way every
    element is reduced exactly once.
    """
    run(ch, reduce_scatter_steps(ch, output, input_list, op, tuning=tuning))


def reduce_scatter_steps(
    ch: Channel,
    output: torch.Tensor,
    input_list: list[torch.Tensor],
    op: ReduceOp,
    *,
    tuning: Tuning | None = None,
) -> Steps:
    """:func:`reduce_scatter` in steps: see :func:`run` and :func:`launch`."""
    pieces = [_flat(piece) for piece in input_list]
    yield from _reduce_scatter_blocks(ch, _flat(output), pieces, op, tuning or DEFAULT_TUNING)


def reduce_scatter_tensor(
    ch: Channel, output: torch.Tensor, input: torch.Tensor, op: ReduceOp, *, tuning: Tuning | None = None
) -> None:
    """:func:`reduce_scatter` with ``input`` (flat) holding ``size`` blocks of ``output``'s element count.

    ``output`` may be this rank's block of ``input``.
    """
    run(ch, reduce_scatter_tensor_steps(ch, output, input, op, tuning=tuning))


def reduce_scatter_tensor_steps(
    ch: Channel, output: torch.Tensor, input: torch.Tensor, op: ReduceOp, *, tuning: Tuning | None = None
) -> Steps:
    """:func:`reduce_scatter_tensor` in steps: see :func:`run` and :func:`launch`."""
    pieces = _blocks(_flat(input), ch.size)
    yield from _reduce_scatter_blocks(ch, _flat(output), pieces, op, tuning or DEFAULT_TUNING)


def _reduce_scatter_blocks(
    ch: Channel, out: torch.Tensor, pieces: list[torch.Tensor], op: ReduceOp, tuning: Tuning
) -> Steps:
    size = ch.size
    kind = op.type
    factor = op.factor_value() if kind is RedOpType.PREMUL_SUM else None
    serial = tuning.serial_elems
    target = out
    if any(_overlaps(out, piece) for piece in pieces):
        target = torch.empty_like(out)  # the output doubles as scratch, so it must not be an input
    if size == 1:
        if factor is not None:
            elementwise(torch.mul, target, pieces[0], factor, serial)
        else:
            target.copy_(pieces[0])
    elif out.nbytes <= tuning.small_bytes:
        if factor is not None:
            pieces = [torch.mul(piece, factor) for piece in pieces]
        yield from _direct_reduce_scatter(ch, target, pieces, kind, serial)
    else:
        yield from _ring_reduce_scatter(ch, pieces, [target] * size, kind, tuning=tuning, factor=factor)
    if target is not out:
        out.copy_(target)


def _direct_reduce_scatter(
    ch: Channel, out: torch.Tensor, pieces: list[torch.Tensor], kind: RedOpType, serial: int
) -> Steps:
    """Everyone sends each peer its piece; each rank folds its block in rank order."""
    size, rank = ch.size, ch.rank
    fn = BINARY_OPS[kind]
    sends = [ch.isend(pieces[(rank + k) % size], (rank + k) % size) for k in range(1, size)]
    incoming = torch.empty_like(out)
    acc = pieces[0]
    for i in range(size):
        if i == rank:
            x = pieces[rank]
        elif i == 0:
            yield ch.irecv(out, 0)  # x0 lands in the output, which is the accumulator from now on
            acc = out
            continue
        else:
            yield ch.irecv(incoming, i)
            x = incoming
        if i:
            elementwise(fn, out, acc, x, serial)
            acc = out
    if kind is RedOpType.AVG:
        divide_(out, size, serial)
    yield from _all(sends)


# -- all_to_all ------------------------------------------------------------------


def all_to_all(
    ch: Channel,
    output_list: list[torch.Tensor],
    input_list: list[torch.Tensor],
    *,
    tuning: Tuning | None = None,
) -> None:
    """``output_list[i]`` receives rank ``i``'s ``input_list[rank]``; pieces may differ in size.

    Pairwise schedule: at step ``k`` a rank sends to ``rank+k`` and receives from
    ``rank-k``; all sends are posted at once, so the steps overlap. Inputs are
    left unchanged. (``tuning`` is accepted and unused.)
    """
    run(ch, all_to_all_steps(ch, output_list, input_list, tuning=tuning))


def all_to_all_steps(
    ch: Channel,
    output_list: list[torch.Tensor],
    input_list: list[torch.Tensor],
    *,
    tuning: Tuning | None = None,
) -> Steps:
    """:func:`all_to_all` in steps: see :func:`run` and :func:`launch`."""
    yield from _all_to_all_pieces(ch, [_flat(out) for out in output_list], [_flat(piece) for piece in input_list])


def all_to_all_single(
    ch: Channel,
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: list[int],
    input_split_sizes: list[int],
    *,
    tuning: Tuning | None = None,
) -> None:
    """:func:`all_to_all` on dim-0 slices: ``input`` is split by ``input_split_sizes``
    (one entry per rank), ``output`` is filled by ``output_split_sizes``.

    ``output`` may be ``input`` itself. (``tuning`` is accepted and unused.)
    """
    run(ch, all_to_all_single_steps(ch, output, input, output_split_sizes, input_split_sizes, tuning=tuning))


def all_to_all_single_steps(
    ch: Channel,
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: list[int],
    input_split_sizes: list[int],
    *,
    tuning: Tuning | None = None,
) -> Steps:
    """:func:`all_to_all_single` in steps: see :func:`run` and :func:`launch`."""
    out_flat, in_flat = _flat(output), _flat(input)
    if _overlaps(out_flat, in_flat):
        in_flat = in_flat.clone()
    yield from _all_to_all_pieces(
        ch,
        _split(out_flat, output_split_sizes, math.prod(output.shape[1:])),
        _split(in_flat, input_split_sizes, math.prod(input.shape[1:])),
    )


def _split(flat: torch.Tensor, rows: list[int], row_numel: int) -> list[torch.Tensor]:
    pieces = []
    offset = 0
    for count in rows:
        end = offset + count * row_numel
        pieces.append(flat[offset:end])
        offset = end
    return pieces


def _all_to_all_pieces(ch: Channel, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> Steps:
    size, rank = ch.size, ch.rank
    sends = [ch.isend(inputs[(rank + k) % size], (rank + k) % size) for k in range(1, size)]
    outputs[rank].copy_(inputs[rank])
    for k in range(1, size):
        peer = (rank - k) % size
        yield ch.irecv(outputs[peer], peer)
    yield from _all(sends)


# -- barrier ---------------------------------------------------------------------


def barrier(ch: Channel, *, tuning: Tuning | None = None, token: torch.Tensor | None = None) -> None:
    """Return only after every rank of the group has entered the barrier.

    Dissemination: ``ceil(log2 size)`` rounds of messages of ``token`` (default one byte;
    a channel that carries empty messages may pass an empty tensor). (``tuning`` is
    accepted and unused.)
    """
    run(ch, barrier_steps(ch, tuning=tuning, token=token))


def barrier_steps(ch: Channel, *, tuning: Tuning | None = None, token: torch.Tensor | None = None) -> Steps:
    """:func:`barrier` in steps: see :func:`run` and :func:`launch`."""
    size, rank = ch.size, ch.rank
    if size == 1:
        return
    if token is None:
        token = torch.zeros(1, dtype=torch.uint8)
    echo = torch.empty_like(token)
    distance = 1
    while distance < size:
        yield from _exchange(ch, token, (rank + distance) % size, echo, (rank - distance) % size)
        distance <<= 1
