"""``TCPBackend``: pg-core's reference backend, every operation over :mod:`pg_tcp.transport`.

What this file shows a plugin author
====================================

* **Point to point is native.** ``send``/``recv`` post one request on the
  transport and wait for it in the calling thread (no thread handoff);
  ``isend``/``irecv`` return a :class:`~pg_core.work.Work` that the transport's
  progress thread completes while the caller computes. ``recv_anysource``/
  ``irecv_anysource`` (declared as ``"recv_anysource"``) are the same receive with no
  peer named, matched with the named ones of its tag oldest first. ``send_bytes``/
  ``recv_bytes`` carry messages whose size the receiver does not know (the core
  builds object and unknown-shape operations on them).
* **Collectives are pg-core's algorithms on our own channel.** Each collective
  takes the next sequence number and runs :mod:`pg_core.algorithms` on a
  :class:`TCPChannel`, whose frames carry (sequence number, op, argument, dtype,
  size). The receiving side compares them with what it expects, so ranks that
  call different collectives, or the same one with other shapes, dtypes, roots
  or reduce ops, raise :class:`~pg_core.errors.CollectiveMismatchError` instead of
  exchanging garbage. Because the transport's ``isend``/``irecv`` are truly
  asynchronous and its sends never wait for the receiver, the generic
  algorithms are already the right ones (direct exchanges for small tensors,
  segmented rings and chains for large ones).
* **Collectives launch without a thread** (``launches = True``, API 1.2). Every
  algorithm is written once as steps (:data:`pg_core.algorithms.Steps`: a generator
  that yields the works it must wait for); a blocking call runs them in the caller's
  thread (:func:`pg_core.algorithms.run`), a call with ``async_op=True`` starts them and
  returns a :class:`~pg_core.work.Work` at once (:func:`pg_core.algorithms.launch`):
  each message's completion advances the steps in whichever thread drives the
  transport, the waiter or its progress thread. Collectives start one at a time in
  call order (:meth:`TCPBackend._collective`), so frames keep their sequence numbers.
  Measured (``pg-core bench --async``, docs/benchmarks.md): ``async_op=True`` plus
  ``wait()`` within a few microseconds of the blocking call, where the group's progress
  thread cost 60-80 us before.
* **Native only where it is measurably faster.** Three paths are pg-tcp's own, each
  measured against :mod:`pg_core.algorithms` on this same backend and transport (a
  subclass whose ``all_reduce``/``barrier`` call the core's), side by side in one run,
  medians, 2-core machine (2026-11-25): the two-rank small ``all_reduce``
  (:func:`_pair_all_reduce`), the large ``all_reduce`` (:func:`_ring_all_reduce`) and
  ``barrier`` (:meth:`TCPBackend.barrier`); each says its figures. Reductions run
  the core's way (:func:`pg_core.algorithms.elementwise`, single-threaded slices);
  everything else is generic.
"""

from __future__ import annotations

import mmap
import threading
import time
from collections.abc import Callable, Sequence
from typing import Final, TypeVar

import torch
from pg_core import algorithms
from pg_core.backend import Backend, BackendContext, tensor_bytes
from pg_core.ops import RedOpType, ReduceOp
from pg_core.work import Work

from .transport import ANY, Recv, Send, Transport
from .wire import BYTES, COLL, DTYPE_CODE, OPCODE, RAW, TENSOR, encode_arg

__all__ = ["TCPBackend", "TCPChannel"]

_R = TypeVar("_R", Send, Recv)

_EMPTY = torch.empty(0, dtype=torch.uint8)

#: Segment size of the rings and chains. Measured with 2-4 ranks on 2 cores: 2 MiB
#: beat 0.5, 1 and 4 MiB (small segments pay per-message overhead, large ones
#: leave the wire idle while a segment is folded).
_SEGMENT_BYTES: Final = 2 * 1024 * 1024


def _byte_view(data: bytes | bytearray | memoryview | mmap.mmap) -> memoryview:
    view = memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _arg(*, root: int = -1, op: ReduceOp | None = None) -> int:
    """The op's argument as it travels in a collective frame's tag: root and reduce op."""
    return encode_arg(root=root, op=None if op is None else op.type)


class _Posted(Work):
    """A request of a blocking collective, as the :class:`Work` its steps yield: only
    :meth:`TCPChannel.wait` waits for it, driving the transport for the request itself
    (:meth:`Transport.wait`), so it is never registered with the transport (what
    :meth:`Transport.work_for` would do, a few microseconds per message)."""

    __slots__ = ("req",)

    def __init__(self, req: Send | Recv) -> None:
        super().__init__(req.name)
        self.req = req

    @property
    def done(self) -> bool:
        return self.req.done


class TCPChannel:
    """The :class:`pg_core.algorithms.Channel` of one collective call.

    Every frame it sends is stamped with the call's sequence number, opcode and
    argument plus the tensor's dtype and size; every receive expects exactly that.
    One deadline (the call's timeout) bounds every wait. ``launched``: the call was
    launched (``async_op=True``), so its ``isend``/``irecv`` works complete even while
    nobody waits (the transport's progress thread drives them while they are pending);
    otherwise the caller, who waits for each at once, drives them.
    """

    __slots__ = (
        "_arg",
        "_attach",
        "_deadline",
        "_op",
        "_opcode",
        "_seq",
        "_timeout",
        "_transport",
        "rank",
        "size",
    )

    def __init__(
        self, transport: Transport, op: str, seq: int, arg: int, timeout: float, *, launched: bool = False
    ) -> None:
        self.rank = transport.rank
        self.size = transport.size
        self._transport = transport
        self._attach = transport.post_async if launched else _Posted
        self._op = op
        self._opcode = OPCODE[op]
        self._seq = seq
        self._arg = arg
        self._timeout = timeout
        self._deadline = time.monotonic() + timeout

    def launched(self) -> TCPChannel:
        """This channel, for a launched collective: from now on its ``isend``/``irecv`` works
        complete even while nobody waits (see the class docstring)."""
        self._attach = self._transport.post_async
        return self

    def post_send(self, tensor: torch.Tensor, peer: int) -> Send:
        return self._transport.post_send(self._frame(Send, tensor, peer))

    def post_recv(self, tensor: torch.Tensor, peer: int) -> Recv:
        return self._transport.post_recv(self._frame(Recv, tensor, peer))

    def _frame(self, kind: type[_R], tensor: torch.Tensor, peer: int) -> _R:
        """A request stamped with this collective's op, argument, sequence number and deadline."""
        return kind(
            self._op,
            COLL,
            peer,
            tensor_bytes(tensor),
            opcode=self._opcode,
            dtype=DTYPE_CODE[tensor.dtype],
            tag=self._arg,
            seq=self._seq,
            timeout=self._timeout,
            deadline=self._deadline,
            keep=tensor,
        )

    # -- the Channel protocol --------------------------------------------------------
    def send(self, tensor: torch.Tensor, peer: int) -> None:
        self._transport.wait(self.post_send(tensor, peer))

    def recv(self, tensor: torch.Tensor, peer: int) -> None:
        self._transport.wait(self.post_recv(tensor, peer))

    def isend(self, tensor: torch.Tensor, peer: int) -> Work:
        return self._attach(self.post_send(tensor, peer))

    def irecv(self, tensor: torch.Tensor, peer: int) -> Work:
        return self._attach(self.post_recv(tensor, peer))

    def sendrecv(self, send_tensor: torch.Tensor, dst: int, recv_tensor: torch.Tensor, src: int) -> None:
        received = self.post_recv(recv_tensor, src)
        sent = self.post_send(send_tensor, dst)
        self._transport.wait(sent)
        self._transport.wait(received)

    def wait(self, work: Work) -> None:
        if type(work) is _Posted:  # a blocking collective's request: waited for here, in the caller's thread
            self._transport.wait(work.req)
        else:
            work.wait()  # the request's own deadline (the channel's) bounds it


class TCPBackend(Backend):
    """pg-core's reference backend: pure Python over a mesh of TCP connections.

    Options (``ProcessGroup(..., options={"tcp": {...}})``): ``addr``, the
    address to listen on and advertise (default: the interface that reaches the
    store; also ``PG_CORE_ADDR``); ``small_bytes`` (default 64 KiB) and
    ``segment_bytes`` (default 2 MiB), the :class:`pg_core.algorithms.Tuning` of
    the collectives and of the native ring (every rank must pass the same values);
    ``max_message_bytes`` (default 256 MiB), the largest byte message a peer may announce,
    ``max_unexpected_bytes`` (default 512 MiB), what a peer may have buffered here ahead of its
    receives (see :mod:`pg_tcp.transport`, "Limits"), and ``max_buffered_send_bytes`` (default
    256 MiB), what blocking sends whose receivers were not reading may leave copied here (see
    :mod:`pg_tcp.transport`, "Blocking sends that do not fit the kernel").
    """

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        self._tuning = algorithms.Tuning(
            small_bytes=int(ctx.options.get("small_bytes", algorithms.DEFAULT_TUNING.small_bytes)),
            segment_bytes=int(ctx.options.get("segment_bytes", _SEGMENT_BYTES)),
        )
        self._transport = Transport(ctx)
        self._seq = 0
        #: the last launched collective's work: the next collective starts once it ended
        self._last: Work | None = None
        self._scratch_bufs: dict[tuple[torch.dtype, torch.Size], torch.Tensor] = {}

    #: collectives launch with ``async_op=True`` (API 1.2), without a thread: see :meth:`_collective`
    launches = True

    def __repr__(self) -> str:
        return f"<TCPBackend group={self.ctx.group_name!r} rank={self.rank}/{self.size}>"

    # -- point to point --------------------------------------------------------------
    def _send_request(self, name: str, tensor: torch.Tensor, dst: int, tag: int, timeout: float) -> Send:
        return self._transport.post_send(
            Send(
                name,
                TENSOR,
                dst,
                tensor_bytes(tensor),
                dtype=DTYPE_CODE[tensor.dtype],
                tag=tag,
                timeout=timeout,
                keep=tensor,
            )
        )

    def _recv_request(self, name: str, tensor: torch.Tensor, src: int, tag: int, timeout: float) -> Recv:
        return self._transport.post_recv(
            Recv(
                name,
                TENSOR,
                src,
                tensor_bytes(tensor),
                dtype=DTYPE_CODE[tensor.dtype],
                tag=tag,
                timeout=timeout,
                keep=tensor,
            )
        )

    def send(self, tensor: torch.Tensor, dst: int, tag: int, *, timeout: float) -> None:
        """Returns without waiting for ``dst``'s receive, whatever the size: what the kernel does not
        take is copied and finished by the transport (:meth:`Transport.wait_send`)."""
        self._transport.wait_send(self._send_request("send", tensor, dst, tag, timeout))

    def recv(self, tensor: torch.Tensor, src: int, tag: int, *, timeout: float) -> None:
        self._transport.wait(self._recv_request("recv", tensor, src, tag, timeout))

    def isend(self, tensor: torch.Tensor, dst: int, tag: int, *, timeout: float) -> Work:
        return self._transport.post_async(self._send_request("isend", tensor, dst, tag, timeout))

    def irecv(self, tensor: torch.Tensor, src: int, tag: int, *, timeout: float) -> Work:
        return self._transport.post_async(self._recv_request("irecv", tensor, src, tag, timeout))

    def recv_anysource(self, tensor: torch.Tensor, tag: int, *, timeout: float) -> int:
        """The oldest message queued on ``tag`` from any peer, or the first to arrive; named and
        any-source receives of a tag are matched oldest first (see :mod:`pg_tcp.transport`)."""
        req = self._recv_request("recv", tensor, ANY, tag, timeout)
        self._transport.wait(req)
        return req.peer

    def irecv_anysource(self, tensor: torch.Tensor, tag: int, *, timeout: float) -> Work:
        return self._transport.post_async(self._recv_request("irecv", tensor, ANY, tag, timeout))

    def send_bytes(
        self,
        data: bytes | bytearray | memoryview | mmap.mmap | Sequence[bytes | bytearray | memoryview | mmap.mmap],
        dst: int,
        tag: int,
        *,
        timeout: float,
    ) -> None:
        """One frame whose payload is ``data``, or the parts of a list back to back (written
        with one ``sendmsg``, never joined)."""
        single = isinstance(data, (bytes, bytearray, memoryview, mmap.mmap))
        parts = _byte_view(data) if single else [_byte_view(d) for d in data]  # type: ignore[union-attr, arg-type]
        self._transport.wait_send(
            self._transport.post_send(
                Send("send_bytes", BYTES, dst, parts, dtype=RAW, tag=tag, timeout=timeout, keep=data)
            )
        )

    def recv_bytes(self, src: int, tag: int, *, timeout: float) -> bytearray | mmap.mmap:
        req = self._transport.post_recv(Recv("recv_bytes", BYTES, src, None, dtype=RAW, tag=tag, timeout=timeout))
        self._transport.wait(req)
        assert req.result is not None
        return req.result

    # -- collectives ---------------------------------------------------------------------
    def _scratch(self, like: torch.Tensor) -> torch.Tensor:
        """A reusable receive buffer shaped like ``like`` (collectives run one at a time)."""
        key = (like.dtype, like.shape)
        buf = self._scratch_bufs.get(key)
        if buf is None:
            if len(self._scratch_bufs) >= 16:
                self._scratch_bufs.clear()
            buf = self._scratch_bufs[key] = torch.empty_like(like)
        return buf

    def _channel(self, op: str, timeout: float, arg: int = 0) -> TCPChannel:
        """The channel of the next collective; raises at once if it cannot succeed."""
        self._seq += 1
        self._transport.begin_collective(op, self._seq, arg)
        return TCPChannel(self._transport, op, self._seq, arg, timeout)

    def _collective(
        self, op: str, timeout: float, arg: int, steps: Callable[[TCPChannel], algorithms.Steps], async_op: bool
    ) -> Work | None:
        """Run collective ``op``, whose algorithm ``steps`` gives for its channel: blocking, in
        the caller's thread (:func:`pg_core.algorithms.run`), or launched (``async_op``), its
        work returned at once and its steps advanced by the completion of each message
        (:func:`pg_core.algorithms.launch`), with no thread of its own.

        Collectives start one at a time, in call order, as the frames' sequence numbers
        require: one called while a launched one is still running starts when that one ends.
        A blocking one waits for it here (driving the transport); a launched one is chained
        behind it, so the caller never blocks. A chained collective's timeout counts from its
        start."""
        last = self._last
        if not async_op:
            if last is not None and not last.done:
                last.exception()  # its own deadline bounds it; a failure broke the stream, which _channel says
            ch = self._channel(op, timeout, arg)
            algorithms.run(ch, steps(ch))
            return None
        if last is None or last.done:
            ch = self._channel(op, timeout, arg).launched()
            work = algorithms.launch(ch, steps(ch), op)
        else:
            work = self._behind(last, op, timeout, arg, steps)
        self._last = work
        return work

    def _behind(
        self, last: Work, op: str, timeout: float, arg: int, steps: Callable[[TCPChannel], algorithms.Steps]
    ) -> Work:
        """Collective ``op``, launched once ``last`` (the previous launched collective) ended."""
        started: list[Work] = []
        finished = threading.Event()

        def drive(_: Work, seconds: float) -> None:
            inner = started[0] if started else last
            if seconds <= 0:
                inner.is_completed()
            elif not inner.done:
                inner.wait_until_done(seconds)
            else:  # ended, and the callback that goes on is running in another thread
                finished.wait(min(seconds, 0.001))

        outer = Work(op, driver=drive)
        outer.add_done_callback(lambda _: finished.set())

        def ended(inner: Work) -> None:
            error = inner.exception(0)
            if error is not None:
                outer.set_exception(error)
            else:
                outer.set_result(None)

        def start(_: Work) -> None:
            try:
                ch = self._channel(op, timeout, arg).launched()
                inner = algorithms.launch(ch, steps(ch), op)
            except BaseException as exc:
                outer.set_exception(exc)
                return
            started.append(inner)
            inner.add_done_callback(ended)

        last.add_done_callback(start)
        return outer

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, *, timeout: float, async_op: bool = False) -> Work | None:
        small = tensor.numel() * tensor.element_size() <= self._tuning.small_bytes
        tuning = self._tuning
        steps: Callable[[TCPChannel], algorithms.Steps]
        if self.size == 1 or (small and self.size > 2):
            steps = lambda ch: algorithms.all_reduce_steps(ch, tensor, op, tuning=tuning)  # noqa: E731
        elif small:
            scratch = self._scratch(tensor)
            steps = lambda ch: _pair_all_reduce(ch, tensor, op, scratch)  # noqa: E731
        else:
            steps = lambda ch: _ring_all_reduce(ch, tensor.view(-1), op, tuning)  # noqa: E731
        return self._collective("all_reduce", timeout, _arg(op=op), steps, async_op)

    def broadcast(self, tensor: torch.Tensor, src: int, *, timeout: float, async_op: bool = False) -> Work | None:
        tuning = self._tuning
        return self._collective(
            "broadcast",
            timeout,
            _arg(root=src),
            lambda ch: algorithms.broadcast_steps(ch, tensor, src, tuning=tuning),
            async_op,
        )

    def reduce(
        self, tensor: torch.Tensor, dst: int, op: ReduceOp, *, timeout: float, async_op: bool = False
    ) -> Work | None:
        tuning = self._tuning
        return self._collective(
            "reduce",
            timeout,
            _arg(root=dst, op=op),
            lambda ch: algorithms.reduce_steps(ch, tensor, dst, op, tuning=tuning),
            async_op,
        )

    def all_gather(
        self, output_list: list[torch.Tensor], tensor: torch.Tensor, *, timeout: float, async_op: bool = False
    ) -> Work | None:
        tuning = self._tuning
        return self._collective(
            "all_gather",
            timeout,
            0,
            lambda ch: algorithms.all_gather_steps(ch, output_list, tensor, tuning=tuning),
            async_op,
        )

    def all_gather_into_tensor(
        self, output: torch.Tensor, input: torch.Tensor, *, timeout: float, async_op: bool = False
    ) -> Work | None:
        tuning = self._tuning
        return self._collective(
            "all_gather_into_tensor",
            timeout,
            0,
            lambda ch: algorithms.all_gather_into_tensor_steps(ch, output, input, tuning=tuning),
            async_op,
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
        tuning = self._tuning
        return self._collective(
            "reduce_scatter",
            timeout,
            _arg(op=op),
            lambda ch: algorithms.reduce_scatter_steps(ch, output, input_list, op, tuning=tuning),
            async_op,
        )

    def reduce_scatter_tensor(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp, *, timeout: float, async_op: bool = False
    ) -> Work | None:
        tuning = self._tuning
        return self._collective(
            "reduce_scatter_tensor",
            timeout,
            _arg(op=op),
            lambda ch: algorithms.reduce_scatter_tensor_steps(ch, output, input, op, tuning=tuning),
            async_op,
        )

    def all_to_all(
        self,
        output_list: list[torch.Tensor],
        input_list: list[torch.Tensor],
        *,
        timeout: float,
        async_op: bool = False,
    ) -> Work | None:
        return self._collective(
            "all_to_all", timeout, 0, lambda ch: algorithms.all_to_all_steps(ch, output_list, input_list), async_op
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
        return self._collective(
            "all_to_all_single",
            timeout,
            0,
            lambda ch: algorithms.all_to_all_single_steps(ch, output, input, output_split_sizes, input_split_sizes),
            async_op,
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
        return self._collective(
            "gather",
            timeout,
            _arg(root=dst),
            lambda ch: algorithms.gather_steps(ch, tensor, gather_list, dst),
            async_op,
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
        return self._collective(
            "scatter",
            timeout,
            _arg(root=src),
            lambda ch: algorithms.scatter_steps(ch, tensor, scatter_list, src),
            async_op,
        )

    def barrier(self, *, timeout: float, async_op: bool = False) -> Work | None:
        """The core's dissemination barrier with an empty token instead of a one-byte one: a
        frame that is only a header completes on the read that finds it. Medians against
        the default token on this transport (200 barriers x 15 interleaved batches, two
        runs): 2 ranks 53 vs 84 and 47 vs 63 us, 3 ranks 248 vs 334 and 192 vs 229 us,
        4 ranks 281 vs 377 and 241 vs 276 us."""
        return self._collective("barrier", timeout, 0, lambda ch: algorithms.barrier_steps(ch, token=_EMPTY), async_op)

    # -- life ------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Finish queued sends (bounded by the group timeout), say goodbye, release everything."""
        self._transport.shutdown(self.ctx.timeout)
        super().shutdown()

    def abort(self) -> None:
        """Fail every pending and blocked operation with GroupClosedError and close now."""
        self._transport.abort()
        super().abort()

    @property
    def closed(self) -> bool:
        return self._transport.closed


def _pair_all_reduce(ch: TCPChannel, tensor: torch.Tensor, op: ReduceOp, scratch: torch.Tensor) -> algorithms.Steps:
    """Two ranks, small tensor: swap contributions in one round and fold ``x0 (op) x1``.

    The same fold as :func:`pg_core.algorithms.all_reduce`'s direct path, without its
    temporary allocations: at this size the Python overhead is the latency. ``scratch``
    receives the peer's contribution. Measured against the core's direct path
    (``pg-core bench``, 2 ranks, two runs): 4 B 85 vs 93 us and 106 vs 104 us (within
    noise), 64 KiB 75 vs 112 us and 111 vs 180 us (0.6-0.7x).
    """
    kind = op.type
    if kind is RedOpType.PREMUL_SUM:
        tensor.mul_(op.factor_value())
    peer = 1 - ch.rank
    received = ch.irecv(scratch, peer)
    yield ch.isend(tensor, peer)
    yield received
    first, second = (tensor, scratch) if ch.rank == 0 else (scratch, tensor)
    _FOLD[kind](first, second, out=tensor)
    if kind is RedOpType.AVG:
        tensor.div_(2)  # AVG is declared for floating point and complex only


#: ``fn(a, b, out=c)`` computes ``a (op) b``: the core's table, so pg-tcp reduces exactly as the algorithms do.
_FOLD = algorithms.BINARY_OPS


def _ring_all_reduce(ch: TCPChannel, flat: torch.Tensor, op: ReduceOp, tuning: algorithms.Tuning) -> algorithms.Steps:
    """Large all_reduce: a lock-step pipelined ring (reduce-scatter, then all-gather).

    Kept because it beats the core's ring on this transport: medians against
    ``pg_core.algorithms.all_reduce`` (``pg-core bench``, one run each): 2 ranks
    1 MiB 453 vs 588 us, 64 MiB 28.4 vs 34.9 ms (and 36.0 vs 52.8 ms); 3 ranks 1 MiB
    1.42 vs 1.85 ms, 64 MiB 78 vs 109 ms. It posts the next segment's receive and
    send before folding the current one, with two receive buffers in lock step,
    where the core's keeps ``Tuning.pipeline`` receives in flight through ``Work``
    objects.

    ``flat`` is cut into ``size`` blocks, each block into segments of about
    ``segment_bytes``. In reduce-scatter step ``s`` a rank folds the left
    neighbour's partial of block ``rank-s-1`` into its own copy, segment by
    segment, while it sends the partial it finished in step ``s-1`` to the right;
    the next segment's receive and send are posted before the current one is
    folded, so the wire stays busy during the reduction. After ``size-1`` steps a
    rank holds block ``rank+1`` fully reduced: each element is reduced once, by
    one rank, so every rank ends with the same bits. The all-gather then passes
    the finished blocks around the ring, received in place. Temporary memory:
    two segments.

    Every send reads memory that this rank does not write again before the peer
    has received it: a block is received in place only after its reduction went
    around the ring, which needed this rank's send of it.
    """
    size, rank = ch.size, ch.rank
    right, left = (rank + 1) % size, (rank - 1) % size
    kind = op.type
    fold = _FOLD[kind]
    serial, segment_bytes = tuning.serial_elems, tuning.segment_bytes
    if kind is RedOpType.PREMUL_SUM:
        algorithms.scale_(flat, op.factor_value(), serial)
    base, extra = divmod(flat.numel(), size)
    bounds = [b * base + min(b, extra) for b in range(size + 1)]
    longest = base + (extra > 0)
    seg = max(1, segment_bytes // flat.element_size())
    nseg = max(1, -(-longest // seg))

    def segments(block: int) -> list[torch.Tensor]:  # the same cut on every rank, empty tails included
        lo, hi = bounds[block], bounds[block + 1]
        return [flat[min(lo + j * seg, hi) : min(lo + (j + 1) * seg, hi)] for j in range(nseg)]

    bufs = flat.new_empty((2, min(seg, longest)))
    sends: list[Work] = []
    outgoing = segments(rank)
    for step in range(size - 1):  # reduce-scatter
        pieces = segments((rank - step - 1) % size)
        final = step == size - 2
        received = ch.irecv(bufs[0][: pieces[0].numel()], left)
        sends.append(ch.isend(outgoing[0], right))
        for j, piece in enumerate(pieces):
            yield received
            incoming = bufs[j % 2][: piece.numel()]
            if j + 1 < nseg:
                received = ch.irecv(bufs[(j + 1) % 2][: pieces[j + 1].numel()], left)
                sends.append(ch.isend(outgoing[j + 1], right))
            algorithms.elementwise(fold, piece, piece, incoming, serial)
            if final and kind is RedOpType.AVG:
                algorithms.divide_(piece, size, serial)
        outgoing = pieces
    for step in range(size - 1):  # all-gather
        pieces = segments((rank - step) % size)
        received = ch.irecv(pieces[0], left)
        sends.append(ch.isend(outgoing[0], right))
        for j in range(nseg):
            yield received
            if j + 1 < nseg:
                received = ch.irecv(pieces[j + 1], left)
                sends.append(ch.isend(outgoing[j + 1], right))
        outgoing = pieces
    yield from sends
