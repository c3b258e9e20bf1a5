"""Planted bugs: pg-tcp with one realistic mistake each, for proving the conformance suite catches them.

Every buggy backend is a small subclass of the reference :class:`~pg_tcp.backend.TCPBackend` that
overrides one operation (two where the mistake needs it), wrapped in a :class:`~pg_core.backend.BackendSpec`
that the suite loads by path (``"tests/conformance/planted.py:BROADCAST_WRONG_ROOT"``), so nothing needs
installing. Some specs declare a narrower set of capabilities than pg-tcp: what a bug needs (say, AVG on
floating point) is then drawn in most examples instead of one in eighty, and the suite finds it in a few
examples. Each narrowed declaration has a ``CONTROL_*`` twin on the unmodified ``TCPBackend``: the same
examples must pass there, so a planted bug is never "caught" by a harness that fails everything.

The bugs, one line each (the test file says which conformance test and check catch each):

1.  BROADCAST_WRONG_ROOT: broadcast from ``(src + 1) % size`` instead of ``src``.
2.  ALL_GATHER_RING_BLOCK: a ring all_gather_into_tensor receiving into block ``rank + step + 1`` instead of
    ``rank - step - 1`` (the same block modulo 2, so only world sizes above 2 go wrong).
3.  AVG_WRONG_COUNT: AVG divides the sum by ``size - 1``.
4.  FLOAT64_AS_FLOAT32: float64 all_reduce computed in float32 (silent precision loss).
5.  TAGS_IGNORED: send and recv drop the tag (every message travels as tag 0).
6.  BARRIER_NO_WAIT: barrier returns at once.
7.  RANK_ORDER_SUM: all_reduce SUM folds the contributions starting from the rank's own (results differ in
    the last bits between ranks from world size 3).
8.  COMPLEX128_P2P_RAISES: send/recv raise TypeError for complex128, which the spec declares.
9.  IRECV_EARLY: irecv's Work says ``is_completed()`` as soon as the receive is posted (its ``wait()`` is
    honest).
10. SCATTER_REVERSED: the root of scatter hands out its list in reverse order.
11. A2A_SINGLE_EVEN_SPLITS: all_to_all_single ignores the split sizes and cuts the tensors evenly.
12. STALE_ACCUMULATOR: all_reduce accumulates into a grow-only scratch buffer it never clears between calls.
13. PREMUL_FACTOR_IGNORED: PREMUL_SUM reduces as a plain SUM.
14. INT_MIN_MAX_SWAPPED: MIN and MAX swapped for integer dtypes.
15. LEAKED_THREAD: a keep-alive thread started at construction that shutdown() never stops.
16. ALL_GATHER_ZEROES_INPUT: all_gather zeroes its input once it has been sent.
17. BARRIER_HANGS_AT_3: barrier at world size 3 waits for a release message nobody sends, with an hour's
    timeout instead of the call's.
18. RECV_SWALLOWS_TIMEOUT: recv returns normally when its timeout passes (the buffer left as it was).
19. BARRIER_HIDES_PEER_FAILURE: barrier re-raises a peer's failure (or its timeout) as a plain RuntimeError.
20. REDUCE_SCATTER_NEXT_BLOCK: reduce_scatter_tensor gives each rank block ``(rank + 1) % size`` when the
    size is above 2.

Bugs that only the value operations (objects, tensors of unknown shape, tensor dicts, subgroups) meet:

21. SEND_BYTES_FIRST_PART_ONLY: send_bytes of a list of buffers sends only the first one (written for API 1.0,
    where a message came as one ``bytes`` object).
22. RECV_BYTES_SHORT_READ: recv_bytes keeps only what one 64 KiB socket read returned; the rest of a larger
    message stays zero (the classic missing loop around ``recv``).
23. BYTES_TAGS_IGNORED: send_bytes and recv_bytes drop the tag (every message travels as tag 0).
24. SEND_BYTES_SCRUBS_PARTS: send_bytes zeroes every writable buffer it was given once it has sent it
    ("don't leave data behind"), and those are views of the caller's tensors.
25. EMULATED_RECV_SHORT_READ: pg-tcp without send_bytes/recv_bytes (pg-core emulates messages on uint8
    sends), whose recv keeps only the first 64 KiB of a larger tensor.
26. PROCESS_WIDE_SEQUENCE: the collective sequence number is one counter for the whole process instead of
    one per group, so ranks whose other groups ran different numbers of collectives disagree.

Bugs that a full declaration hides from a few drawn examples, each declared with pg-tcp's full capabilities
(every op, dtype and reduce op) and caught by the coverage test (every declared combination with values,
the whole range of every dtype, sizes across thresholds, every root, every odd one out):

27. BFLOAT16_VIA_FLOAT16: all_reduce of bfloat16 runs in float16 ("the same 16 bits, more mantissa"), which
    overflows where bfloat16 does not.
28. INT64_VIA_FLOAT64: all_reduce SUM of int64 accumulates in float64, exact only up to 2**53.
29. UINT8_AS_INT8: all_reduce MIN/MAX of uint8 compares the bytes as signed, so 128-255 sort below 0.
30. SATURATING_INT_SUM: integer all_reduce SUM clamps at the dtype's limits instead of wrapping around as
    torch's CPU ops do.
31. ZERO_START_SUM: floating all_reduce SUM accumulates into zeros, so a sum of -0.0 comes out +0.0.
32. NAN_AS_ZERO_SUM: floating all_reduce SUM treats NaN as 0 ("skip missing values").
33. COMPLEX_PRODUCT_ELEMENTWISE: complex all_reduce PRODUCT multiplies real and imaginary parts separately.
34. BROADCAST_LAST_CHUNK_DROPPED: broadcast past 4 MiB goes in 4 MiB chunks, and the loop drops the last,
    partial one.
35. ODD_BYTES_DROPPED: send/isend copy whole 4-byte words, so the last 1-3 bytes of a message whose size is
    not a multiple of 4 arrive as zeros.
36. LAST_ROOT_REDUCE: reduce to the last rank of a group of 4 or more goes to rank 0 (the last rank is the
    tree's "no parent" sentinel).
37. A2A_QUIET_RANK_SKIPS: all_to_all on a rank with nothing to send returns at once, without receiving.

Errors and resources, also declared with pg-tcp's full capabilities:

38. TIMEOUT_FROM_GROUP: every blocking operation waits for the group's default timeout, not the call's.
39. CACHED_WAKEUP_PIPE: a wake-up pipe kept in a module-level cache per group name "for the next formation",
    which shutdown() never closes.
40. HELPER_PROCESS_LEFT: a helper process started at construction that shutdown() never stops.
40a. ABORT_LEAVES_RECEIVES: abort() fails the queued sends, collectives and async work and closes the
    connections, but the receives that blocked ``recv`` calls posted are dropped from the queues unanswered:
    such a thread waits out its own timeout, then raises ``CollectiveTimeout`` instead of ``GroupClosedError``.
40b. CACHED_SHARED_MEMORY: a shared memory staging area (a ``/dev/shm`` segment, mapped) kept in a
    module-level cache per group name "for the next formation", which shutdown() never unmaps.

Buffer lifetime, order and tags, with the full declaration:

41. ISEND_COMPLETES_EARLY: isend's Work is complete at once and the data goes out a moment later, from the
    caller's buffer ("handed to the transport" taken for "sent").
42. IRECV_FILLS_LATE: irecv's Work completes when the message has arrived, and the data is copied into the
    caller's tensor a moment after.
43. TAGS_TRUNCATED_32: the wire header keeps 32 bits of the tag while the spec declares 63, so tags that
    differ above bit 31 meet.
44. RECV_BYTES_SHARED_BUFFER: recv_bytes returns a view of one receive buffer per peer, reused for the next
    message, so a value received earlier changes under the receiver.
45. RECV_BYTES_READ_ONLY: recv_bytes returns an immutable ``bytes`` ("a copy is safer"), so received tensors
    would be views of memory nobody may write.

Coalescing (backend API 1.3), on pg-tcp given the hook (``COALESCING``, its control, runs a batch honestly):

46. COALESCED_SKIPS_LAST: ``coalesced`` runs every call of the batch but the last (an off-by-one slice).

Receiving from any source (the optional ``recv_anysource``, declared by pg-tcp's full capabilities):

47. ANY_SOURCE_PEER_INDEX: an any-source receive reports the sender's index in the list of the other ranks
    (this rank left out) instead of its group rank: right for senders below the receiver, one too low above.
48. ANY_SOURCE_IRECV_PER_PEER: an any-source receive posts one irecv per peer and keeps the first that
    completes; the others stay posted and take those peers' next messages, which the receives after it
    never see (lost, or a later message in their place).
49. ANY_SOURCE_STALE_SENDER: an any-source receive reports the sender of the receive before it (the field is
    read before it is updated): a rank of the group, just not the one whose message it holds.

Layouts users pass and values at every size (issue 32), with the full declaration:

L1. BUCKET_WHOLE_STORAGE: all_reduce of a contiguous tensor runs over its whole storage ("contiguous, so the
    storage is the tensor"), so a gradient that is a slice of a flat bucket rewrites its neighbours.
L2. SEND_FROM_STORAGE_START: sends read the tensor's bytes from the start of its storage instead of its
    storage offset (``untyped_storage().data_ptr()`` for ``data_ptr()``): right for fresh tensors, another
    parameter's bytes for a slice of a bucket.
L3. ONE_ELEMENT_VIA_FLOAT32: a fast path for one-element all_reduce (a loss, a gradient norm, a token count)
    reduces a float32 copy, so int32, int64 and float64 values lose their low bits.

A receive meeting a message it did not expect, and byte messages at their edges (the ``receives`` test), with
pg-tcp's full declaration:

50. RECV_ZERO_PADS: a recv whose message has another size than its tensor takes what fits and zero-pads the
    rest instead of raising CollectiveMismatchError ("be lenient in what you accept").
51. SEND_BYTES_DROPS_LAST_BYTE: send_bytes moves a message in 64 KiB chunks and counts them with an
    off-by-one (a last chunk of one byte is not counted), so lengths one above a multiple of 64 KiB lose
    their last byte.
52. SEND_BYTES_STOPS_AT_EMPTY_PART: send_bytes takes an empty part for the end of the list (as a C string's
    terminator), so the parts after an empty one are lost.

Both sides of the eager limit (the ``eager_limit`` test, backend API 1.10; the control, ``RENDEZVOUS``, is
pg-tcp whose sends above 64 KiB wait for their receivers' acknowledgement, declared so):

53. EAGER_LIMIT_OVERSTATED: declares ``eager_limit_bytes`` 64 KiB, but its sends wait for their receivers
    above 4 KiB (the limit read from the wrong constant).
54. ISEND_QUEUED_NO_COPY: isend does not copy (allowed), but its work completes once the send is queued, and
    the queue reads the caller's tensor a moment later, after the caller, told it may, has changed it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import mmap
import os
import subprocess
import sys
import threading
from collections.abc import Sequence

import torch
from pg_core.backend import DTYPES, Backend, BackendContext, BackendSpec, Call, Capabilities
from pg_core.errors import CollectiveMismatchError, CollectiveTimeout, PeerFailureError
from pg_core.ops import OPS, RedOpType, ReduceOp
from pg_core.work import Work, all_of, mapped
from pg_tcp.backend import TCPBackend, TCPChannel
from pg_tcp.plugin import CAPABILITIES
from pg_tcp.transport import Send

_FLOATS = (torch.float32, torch.float64)
_INTS = (torch.uint8, torch.int32, torch.int64)

#: Floating point reductions only: SUM, AVG, PREMUL_SUM on float32 and float64.
FLOAT_REDUCE_CAPS = Capabilities(
    ops=frozenset(OPS),
    dtypes=frozenset(_FLOATS),
    reduce_ops={d: frozenset({RedOpType.SUM, RedOpType.AVG, RedOpType.PREMUL_SUM}) for d in _FLOATS},
)
#: Integer MIN and MAX only.
INT_MIN_MAX_CAPS = Capabilities(
    ops=frozenset(OPS),
    dtypes=frozenset(_INTS),
    reduce_ops={d: frozenset({RedOpType.MIN, RedOpType.MAX}) for d in _INTS},
)
#: Point to point only, on float32 and complex128 (so every timeout probe is a recv).
P2P_CAPS = Capabilities(ops=frozenset({"send", "recv"}), dtypes=frozenset({torch.float32, torch.complex128}))
#: all_reduce SUM only (so a sequence is all_reduce after all_reduce).
ALL_REDUCE_SUM_CAPS = Capabilities(
    ops=frozenset({"all_reduce"}),
    dtypes=frozenset({torch.float32, torch.int64}),
    reduce_ops={torch.float32: frozenset({RedOpType.SUM}), torch.int64: frozenset({RedOpType.SUM})},
)
#: barrier only (so every timeout probe is a barrier).
BARRIER_CAPS = Capabilities(ops=frozenset({"barrier"}), dtypes=frozenset(DTYPES))
#: Point to point only (values ride on it), with uint8 for pg-core's emulation of messages.
MESSAGE_CAPS = Capabilities(
    ops=frozenset({"send", "recv"}), dtypes=frozenset({torch.uint8, torch.float32, torch.int64, torch.complex128})
)


def _spec(name: str, factory: type[TCPBackend], caps: Capabilities = CAPABILITIES) -> BackendSpec:
    return BackendSpec(name=f"planted-{name}", factory=factory, devices=("cpu",), capabilities=caps)


def _blocks(flat: torch.Tensor, size: int) -> list[torch.Tensor]:
    k = flat.numel() // size
    return [flat[i * k : (i + 1) * k] for i in range(size)]


def _gathered(backend: TCPBackend, tensor: torch.Tensor, timeout: float) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (flat), by pg-tcp's own all_gather."""
    flat = tensor.reshape(-1)
    parts = [torch.empty_like(flat) for _ in range(backend.size)]
    TCPBackend.all_gather(backend, parts, flat, timeout=timeout)
    return parts


# -- 1 ---------------------------------------------------------------------------------------------------


class BroadcastWrongRoot(TCPBackend):
    def broadcast(self, tensor: torch.Tensor, src: int, *, timeout: float) -> None:
        super().broadcast(tensor, (src + 1) % self.size, timeout=timeout)


# -- 2 ---------------------------------------------------------------------------------------------------


class AllGatherRingBlock(TCPBackend):
    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor, *, timeout: float) -> None:
        ch = self._channel("all_gather_into_tensor", timeout)
        size, rank = self.size, self.rank
        blocks = _blocks(output.view(-1), size)
        blocks[rank].copy_(input.reshape(-1))
        right, left = (rank + 1) % size, (rank - 1) % size
        for step in range(size - 1):
            # bug: should be (rank - step - 1) % size; the two agree when size is 2
            ch.sendrecv(blocks[(rank - step) % size], right, blocks[(rank + step + 1) % size], left)


# -- 3, 4, 13, 14 ----------------------------------------------------------------------------------------


class AvgWrongCount(TCPBackend):
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, *, timeout: float) -> None:
        if op.type is not RedOpType.AVG:
            super().all_reduce(tensor, op, timeout=timeout)
            return
        super().all_reduce(tensor, ReduceOp(RedOpType.SUM), timeout=timeout)
        tensor.div_(max(self.size - 1, 1))  # bug: the group has `size` contributions


class Float64AsFloat32(TCPBackend):
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, *, timeout: float) -> None:
        if tensor.dtype is not torch.float64:
            super().all_reduce(tensor, op, timeout=timeout)
            return
        narrow = tensor.to(torch.float32)  # bug: "float32 is precise enough"
        super().all_reduce(narrow, op, timeout=timeout)
        tensor.copy_(narrow)


class PremulFactorIgnored(TCPBackend):
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, *, timeout: float) -> None:
        if op.type is RedOpType.PREMUL_SUM:
            op = ReduceOp(RedOpType.SUM)  # bug: the factor is dropped
        super().all_reduce(tensor, op, timeout=timeout)


class IntMinMaxSwapped(TCPBackend):
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, *, timeout: float) -> None:
        integer = not (tensor.is_floating_point() or tensor.is_complex() or tensor.dtype is torch.bool)
        if integer and op.type in (RedOpType.MIN, RedOpType.MAX):
            # bug: a lookup table keyed the wrong way round for the integer path
            op = ReduceOp(RedOpType.MAX if op.type is RedOpType.MIN else RedOpType.MIN)
        super().all_reduce(tensor, op, timeout=timeout)


# -- 5 ---------------------------------------------------------------------------------------------------


class TagsIgnored(TCPBackend):
    def send(self, tensor: torch.Tensor, dst: int, tag: int, *, timeout: float) -> None:
        super().send(tensor, dst, 0, timeout=timeout)

    def recv(self, tensor: torch.Tensor, src: int, tag: int, *, timeout: float) -> None:
        super().recv(tensor, src, 0, timeout=timeout)

    def isend(self, tensor: torch.Tensor, dst: int, tag: int, *, timeout: float) -> Work:
        return super().isend(tensor, dst, 0, timeout=timeout)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int, *, timeout: float) -> Work:
        return super().irecv(tensor, src, 0, timeout=timeout)


# -- 6, 17, 19 -------------------------------------------------------------------------------------------


class BarrierNoWait(TCPBackend):
    def barrier(self, *, timeout: float) -> None:
        return  # bug: "nothing to exchange"


_RELEASE_TAG = 2**50 + 17  # a user tag no conformance example uses


class BarrierHangsAt3(TCPBackend):
    def barrier(self, *, timeout: float) -> None:
        super().barrier(timeout=timeout)
        if self.size == 3:
            # bug: an odd-size "release" round that waits for a message nobody sends, and with its own
            # hour-long timeout rather than the call's
            super().recv(torch.empty(1, dtype=torch.uint8), (self.rank + 1) % 3, _RELEASE_TAG, timeout=3600.0)


class BarrierHidesPeerFailure(TCPBackend):
    def barrier(self, *, timeout: float) -> None:
        try:
            super().barrier(timeout=timeout)
        except (PeerFailureError, CollectiveTimeout) as exc:
            raise RuntimeError(f"barrier failed: {exc}") from None  # bug: the contract's error types are lost


# -- 7, 12 -----------------------------------------------------------------------------------------------


class RankOrderSum(TCPBackend):
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, *, timeout: float) -> None:
        if op.type is not RedOpType.SUM or not tensor.is_floating_point():
            super().all_reduce(tensor, op, timeout=timeout)
            return
        parts = _gathered(self, tensor, timeout)
        acc = parts[self.rank].clone()
        for k in range(1, self.size):  # bug: the fold order depends on the rank
            acc.add_(parts[(self.rank + k) % self.size])
        tensor.view(-1).copy_(acc)


class StaleAccumulator(TCPBackend):
    _acc: torch.Tensor | None = None

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, *, timeout: float) -> None:
        if op.type is not RedOpType.SUM:
            super().all_reduce(tensor, op, timeout=timeout)
            return
        parts = _gathered(self, tensor, timeout)
        n = tensor.numel()
        fresh = self._acc is None or self._acc.dtype != tensor.dtype or self._acc.numel() < n
        if fresh:
            self._acc = torch.empty(n, dtype=tensor.dtype)
        assert self._acc is not None
        acc = self._acc[:n]  # bug: reused without zeroing, so it still holds the previous call's result
        if fresh and parts:  # a fresh one starts from the first rank's value, as an honest fold does (-0.0, NaN)
            acc.copy_(parts[0])
            parts = parts[1:]
        for part in parts:
            acc.add_(part)
        tensor.view(-1).copy_(acc)


# -- 8, 9, 18 --------------------------------------------------------------------------------------------


def _no_complex128(tensor: torch.Tensor) -> None:
    if tensor.dtype is torch.complex128:
        raise TypeError("complex128 is not supported by the wire format")  # bug: but the spec declares it


class Complex128P2PRaises(TCPBackend):
    def send(self, tensor: torch.Tensor, dst: int, tag: int, *, timeout: float) -> None:
        _no_complex128(tensor)
        super().send(tensor, dst, tag, timeout=timeout)

    def recv(self, tensor: torch.Tensor, src: int, tag: int, *, timeout: float) -> None:
        _no_complex128(tensor)
        super().recv(tensor, src, tag, timeout=timeout)

    def isend(self, tensor: torch.Tensor, dst: int, tag: int, *, timeout: float) -> Work:
        _no_complex128(tensor)
        return super().isend(tensor, dst, tag, timeout=timeout)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int, *, timeout: float) -> Work:
        _no_complex128(tensor)
        return super().irecv(tensor, src, tag, timeout=timeout)


class _PostedWork(Work):
    """A Work that answers ``is_completed()`` with "the request is posted"; ``wait()`` is honest."""

    __slots__ = ()

    def is_completed(self) -> bool:
        return True  # bug: posted is not completed


class IrecvEarly(TCPBackend):
    def irecv(self, tensor: torch.Tensor, src: int, tag: int, *, timeout: float) -> Work:
        inner = super().irecv(tensor, src, tag, timeout=timeout)
        outer = _PostedWork("irecv")

        def done(work: Work) -> None:
            error = work.exception(0)
            if error is None:
                outer.set_result(None)
            else:
                outer.set_exception(error)

        inner.add_done_callback(done)
        return outer


class RecvSwallowsTimeout(TCPBackend):
    def recv(self, tensor: torch.Tensor, src: int, tag: int, *, timeout: float) -> None:
        try:
            super().recv(tensor, src, tag, timeout=timeout)
        except CollectiveTimeout:
            return  # bug: "nothing arrived" is not an error


# -- 10, 11, 20 ------------------------------------------------------------------------------------------


class ScatterReversed(TCPBackend):
    def scatter(
        self, tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None, src: int, *, timeout: float
    ) -> None:
        if scatter_list is not None:
            scatter_list = scatter_list[::-1]  # bug
        super().scatter(tensor, scatter_list, src, timeout=timeout)


class A2ASingleEvenSplits(TCPBackend):
    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        *,
        timeout: float,
    ) -> None:
        # bug: the split sizes are assumed even
        out_even = [output.shape[0] // self.size] * self.size
        in_even = [input.shape[0] // self.size] * self.size
        super().all_to_all_single(output, input, out_even, in_even, timeout=timeout)


class ReduceScatterNextBlock(TCPBackend):
    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp, *, timeout: float) -> None:
        if self.size <= 2:
            super().reduce_scatter_tensor(output, input, op, timeout=timeout)
            return
        # bug: an "optimised" path for bigger groups rotates the blocks by one
        blocks = _blocks(input.view(-1), self.size)
        rotated = torch.cat(blocks[1:] + blocks[:1])
        super().reduce_scatter_tensor(output, rotated, op, timeout=timeout)


# -- 15, 16 ----------------------------------------------------------------------------------------------


class LeakedThread(TCPBackend):
    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        self._stop = threading.Event()
        # bug: shutdown() never sets the event, so the thread outlives the backend
        threading.Thread(target=self._stop.wait, name=f"planted keep-alive rank {self.rank}", daemon=True).start()


class AllGatherZeroesInput(TCPBackend):
    def all_gather(self, output_list: list[torch.Tensor], tensor: torch.Tensor, *, timeout: float) -> None:
        super().all_gather(output_list, tensor, timeout=timeout)
        tensor.zero_()  # bug: "scrub the send buffer"


# -- 21, 22, 23, 24: variable-size messages -----------------------------------------------------------

_Bytes = bytes | bytearray | memoryview
_WINDOW = 64 * 1024


class SendBytesFirstPartOnly(TCPBackend):
    def send_bytes(self, data: _Bytes | Sequence[_Bytes], dst: int, tag: int, *, timeout: float) -> None:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            data = data[0]  # bug: "the message is data[0]", as in API 1.0 days
        super().send_bytes(data, dst, tag, timeout=timeout)


class RecvBytesShortRead(TCPBackend):
    def recv_bytes(self, src: int, tag: int, *, timeout: float) -> bytearray:
        data = super().recv_bytes(src, tag, timeout=timeout)
        if len(data) > _WINDOW:
            data[_WINDOW:] = bytes(len(data) - _WINDOW)  # bug: one read of at most 64 KiB, and no loop
        return data


class BytesTagsIgnored(TCPBackend):
    def send_bytes(self, data: _Bytes | Sequence[_Bytes], dst: int, tag: int, *, timeout: float) -> None:
        super().send_bytes(data, dst, 0, timeout=timeout)

    def recv_bytes(self, src: int, tag: int, *, timeout: float) -> bytearray:
        return super().recv_bytes(src, 0, timeout=timeout)


class SendBytesScrubsParts(TCPBackend):
    def send_bytes(self, data: _Bytes | Sequence[_Bytes], dst: int, tag: int, *, timeout: float) -> None:
        super().send_bytes(data, dst, tag, timeout=timeout)
        parts = [data] if isinstance(data, (bytes, bytearray, memoryview)) else list(data)
        for part in parts:
            view = memoryview(part).cast("B")
            if not view.readonly:
                view[:] = bytes(view.nbytes)  # bug: the parts are the caller's memory, not a copy


# -- 25: pg-tcp without send_bytes: values emulated on uint8 sends ----------------------------------------


class Emulated(TCPBackend):
    """pg-tcp without its variable-size messages: pg-core emulates them on ``send``/``recv``."""

    send_bytes = Backend.send_bytes  # type: ignore[assignment]
    recv_bytes = Backend.recv_bytes  # type: ignore[assignment]


class EmulatedRecvShortRead(Emulated):
    def recv(self, tensor: torch.Tensor, src: int, tag: int, *, timeout: float) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes <= _WINDOW:
            super().recv(tensor, src, tag, timeout=timeout)
            return
        whole = torch.empty_like(tensor)
        super().recv(whole, src, tag, timeout=timeout)
        keep = _WINDOW // tensor.element_size()
        tensor.view(-1)[:keep].copy_(whole.view(-1)[:keep])  # bug: one read of at most 64 KiB, and no loop


# -- 26: subgroups ------------------------------------------------------------------------------------


class ProcessWideSequence(TCPBackend):
    _counter = itertools.count(1)  # bug: one counter for every group of the process

    def _channel(self, op: str, timeout: float, arg: int = 0) -> TCPChannel:
        self._seq = next(ProcessWideSequence._counter)
        self._transport.begin_collective(op, self._seq, arg)
        return TCPChannel(self._transport, op, self._seq, arg, timeout)


# -- 27-37: mistakes a full declaration hides from a few drawn examples ---------------------------------


def _integer(tensor: torch.Tensor) -> bool:
    return not (tensor.is_floating_point() or tensor.is_complex() or tensor.dtype is torch.bool)


class _Converted(TCPBackend):
    """all_reduce of ``source`` tensors through a copy in ``through`` (the bug), then back."""

    source: torch.dtype
    through: torch.dtype
    kinds: frozenset[RedOpType] = frozenset(RedOpType)

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, *, timeout: float) -> None:
        if tensor.dtype is not self.source or op.type not in self.kinds:
            super().all_reduce(tensor, op, timeout=timeout)
            return
        other = tensor.to(self.through)
        super().all_reduce(other, op, timeout=timeout)
        tensor.copy_(other)


class Bfloat16ViaFloat16(_Converted):
    source, through = torch.bfloat16, torch.float16


class Int64ViaFloat64(_Converted):
    source, through = torch.int64, torch.float64
    kinds = frozenset({RedOpType.SUM})


class Uint8AsInt8(TCPBackend):
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, *, timeout: float) -> None:
        if tensor.dtype is torch.uint8 and op.type in (RedOpType.MIN, RedOpType.MAX):
            tensor = tensor.view(torch.int8)  # bug: "a byte is a byte"
        super().all_reduce(tensor, op, timeout=timeout)


class _Folded(TCPBackend):
    """all_reduce SUM of the matching tensors folded by :meth:`fold` over every rank's contribution
    (in rank order, the same on every rank)."""

    def applies(self, tensor: torch.Tensor) -> bool:
        raise NotImplementedError

    def fold(self, parts: list[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, *, timeout: float) -> None:
        if op.type is not RedOpType.SUM or not self.applies(tensor):
            super().all_reduce(tensor, op, timeout=timeout)
            return
        tensor.view(-1).copy_(self.fold(_gathered(self, tensor, timeout)))


class SaturatingIntSum(_Folded):
    def applies(self, tensor: torch.Tensor) -> bool:
        return _integer(tensor) and tensor.dtype is not torch.int64

    def fold(self, parts: list[torch.Tensor]) -> torch.Tensor:
        info = torch.iinfo(parts[0].dtype)
        total = torch.stack([p.to(torch.int64) for p in parts]).sum(0)
        return total.clamp(info.min, info.max).to(parts[0].dtype)  # bug: saturates instead of wrapping


class ZeroStartSum(_Folded):
    def applies(self, tensor: torch.Tensor) -> bool:
        return tensor.is_floating_point()

    def fold(self, parts: list[torch.Tensor]) -> torch.Tensor:
        acc = torch.zeros_like(parts[0])  # bug: 0.0 + -0.0 is +0.0
        for part in parts:
            acc.add_(part)
        return acc


class NanAsZeroSum(_Folded):
    def applies(self, tensor: torch.Tensor) -> bool:
        return tensor.is_floating_point()

    def fold(self, parts: list[torch.Tensor]) -> torch.Tensor:
        acc = parts[0].clone()
        for part in parts[1:]:
            acc.add_(part)
        return torch.where(torch.isnan(acc), torch.zeros_like(acc), acc)  # bug: "skip missing values"


class ComplexProductElementwise(TCPBackend):
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, *, timeout: float) -> None:
        if not (tensor.is_complex() and op.type is RedOpType.PRODUCT):
            super().all_reduce(tensor, op, timeout=timeout)
            return
        pairs = torch.view_as_real(tensor)  # bug: (a+bi)(c+di) taken as (ac) + (bd)i
        super().all_reduce(pairs, op, timeout=timeout)


_CHUNK = 4 * 1024 * 1024


class BroadcastLastChunkDropped(TCPBackend):
    def broadcast(self, tensor: torch.Tensor, src: int, *, timeout: float) -> None:
        flat = tensor.view(-1)
        chunk = _CHUNK // tensor.element_size()
        if flat.numel() <= chunk:
            super().broadcast(tensor, src, timeout=timeout)
            return
        for start in range(0, flat.numel() // chunk * chunk, chunk):  # bug: the partial last chunk is never sent
            super().broadcast(flat[start : start + chunk], src, timeout=timeout)


def _whole_words(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a word-aligned copy would carry it: its last ``nbytes % 4`` bytes zeroed."""
    raw = tensor.reshape(-1).view(torch.uint8) if tensor.numel() else tensor.reshape(-1)
    tail = raw.numel() % 4 if tensor.numel() else 0
    if not tail:
        return tensor
    copy = tensor.clone()
    copy.reshape(-1).view(torch.uint8)[raw.numel() - tail :] = 0  # bug: only whole words are copied
    return copy


class OddBytesDropped(TCPBackend):
    def send(self, tensor: torch.Tensor, dst: int, tag: int, *, timeout: float) -> None:
        super().send(_whole_words(tensor), dst, tag, timeout=timeout)

    def isend(self, tensor: torch.Tensor, dst: int, tag: int, *, timeout: float) -> Work:
        return super().isend(_whole_words(tensor), dst, tag, timeout=timeout)


class LastRootReduce(TCPBackend):
    def reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp, *, timeout: float) -> None:
        if self.size >= 4 and dst == self.size - 1:
            dst = 0  # bug: the last rank doubles as the tree's "no parent" sentinel
        super().reduce(tensor, dst, op, timeout=timeout)


class A2AQuietRankSkips(TCPBackend):
    def all_to_all(self, output_list: list[torch.Tensor], input_list: list[torch.Tensor], *, timeout: float) -> None:
        if all(t.numel() == 0 for t in input_list):
            return  # bug: "nothing to send, nothing to do"; what the others send is never received
        super().all_to_all(output_list, input_list, timeout=timeout)


# -- 38-40: errors and resources ---------------------------------------------------------------------


class TimeoutFromGroup(TCPBackend):
    """bug: the call's ``timeout`` is read, then the socket waits use the group's default"""

    def recv(self, tensor: torch.Tensor, src: int, tag: int, *, timeout: float) -> None:
        super().recv(tensor, src, tag, timeout=self.ctx.timeout)

    def barrier(self, *, timeout: float) -> None:
        super().barrier(timeout=self.ctx.timeout)

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, *, timeout: float) -> None:
        super().all_reduce(tensor, op, timeout=self.ctx.timeout)

    def all_gather(self, output_list: list[torch.Tensor], tensor: torch.Tensor, *, timeout: float) -> None:
        super().all_gather(output_list, tensor, timeout=self.ctx.timeout)

    def broadcast(self, tensor: torch.Tensor, src: int, *, timeout: float) -> None:
        super().broadcast(tensor, src, timeout=self.ctx.timeout)

    def recv_bytes(self, src: int, tag: int, *, timeout: float) -> bytearray:
        return super().recv_bytes(src, tag, timeout=self.ctx.timeout)  # type: ignore[return-value]


#: bug: a module-level cache of wake-up pipes, by group name, "for the next formation of that group"
_WAKEUP_PIPES: dict[str, tuple[int, int]] = {}


class CachedWakeupPipe(TCPBackend):
    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        if ctx.group_name not in _WAKEUP_PIPES:
            _WAKEUP_PIPES[ctx.group_name] = os.pipe()


class HelperProcessLeft(TCPBackend):
    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        # bug: shutdown() never terminates it. It reads its stdin to the end: the pipe closes when its
        # parent exits, so the test leaves no orphan.
        self._helper = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)


#: bug: shared memory staging areas (their addresses) kept per group name "for the next formation"
_STAGING: dict[str, int] = {}


class CachedSharedMemory(TCPBackend):
    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        if ctx.group_name not in _STAGING:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.mmap.restype = ctypes.c_void_p
            size, ints = ctypes.c_size_t, [ctypes.c_int] * 3
            libc.mmap.argtypes = [ctypes.c_void_p, size, *ints, ctypes.c_long]
            path = f"/dev/shm/pg-tcp-planted-{os.getpid()}-{len(_STAGING)}"
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, 4096)
                # mapped as a C library maps it: no descriptor is kept, only the mapping (shutdown() never unmaps it)
                prot = mmap.PROT_READ | mmap.PROT_WRITE
                _STAGING[ctx.group_name] = libc.mmap(None, 4096, prot, mmap.MAP_SHARED, fd, 0)
            finally:
                os.close(fd)
                os.unlink(path)  # (unlinked at once, so the test leaves no file behind; the memory stays mapped)


class AbortLeavesReceives(TCPBackend):
    def abort(self) -> None:
        # bug: "fail what is queued and close": a receive that a blocked recv posted is taken off the queues
        # first, so abort never completes it; the thread waits on until its own timeout
        transport = self._transport
        with transport._lock:
            transport._posted.clear()
        super().abort()


# -- 41-44: buffer lifetime, order and tags ---------------------------------------------------------------


class IsendCompletesEarly(TCPBackend):
    def isend(self, tensor: torch.Tensor, dst: int, tag: int, *, timeout: float) -> Work:
        work = Work("isend")
        work.set_result(None)  # bug: "handed to the transport" is not "the buffer may be reused"
        send = super().send
        threading.Timer(0.02, send, (tensor, dst, tag), {"timeout": timeout}).start()
        return work


class IrecvFillsLate(TCPBackend):
    def irecv(self, tensor: torch.Tensor, src: int, tag: int, *, timeout: float) -> Work:
        landing = torch.empty_like(tensor)
        inner = super().irecv(landing, src, tag, timeout=timeout)
        outer = Work("irecv")

        def arrived(work: Work) -> None:
            error = work.exception(0)
            if error is not None:
                outer.set_exception(error)
                return
            outer.set_result(None)  # bug: complete before the data is where the caller reads it
            threading.Timer(0.02, tensor.copy_, (landing,)).start()

        inner.add_done_callback(arrived)
        return outer


_TAG_BITS = 0xFFFFFFFF


class TagsTruncated32(TCPBackend):
    def send(self, tensor: torch.Tensor, dst: int, tag: int, *, timeout: float) -> None:
        super().send(tensor, dst, tag & _TAG_BITS, timeout=timeout)  # bug: a 32-bit tag field

    def recv(self, tensor: torch.Tensor, src: int, tag: int, *, timeout: float) -> None:
        super().recv(tensor, src, tag & _TAG_BITS, timeout=timeout)

    def isend(self, tensor: torch.Tensor, dst: int, tag: int, *, timeout: float) -> Work:
        return super().isend(tensor, dst, tag & _TAG_BITS, timeout=timeout)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int, *, timeout: float) -> Work:
        return super().irecv(tensor, src, tag & _TAG_BITS, timeout=timeout)


_SHARED_BYTES = 1024 * 1024


class RecvBytesSharedBuffer(TCPBackend):
    def recv_bytes(self, src: int, tag: int, *, timeout: float) -> bytearray:
        data = super().recv_bytes(src, tag, timeout=timeout)
        if len(data) > _SHARED_BYTES:
            return data  # type: ignore[return-value]
        shared = self.__dict__.setdefault("_shared", {}).setdefault(src, bytearray(_SHARED_BYTES))
        view = memoryview(shared)[: len(data)]
        view[:] = data  # bug: one receive buffer per peer, handed out again for the next message
        return view  # type: ignore[return-value]


class RecvBytesReadOnly(TCPBackend):
    def recv_bytes(self, src: int, tag: int, *, timeout: float) -> bytearray:
        return bytes(super().recv_bytes(src, tag, timeout=timeout))  # type: ignore[return-value]  # bug


# -- 46 -------------------------------------------------------------------------------------------------


class Coalescing(TCPBackend):
    """pg-tcp with the coalescing hook, honest: the batch's receives and sends posted as
    ``irecv``/``isend``, its collectives run in order, one work for all of it."""

    coalesces = True

    def coalesced(self, calls: Sequence[Call]) -> Work:
        works = []
        for call in calls:
            if call.op in ("send", "recv"):
                works.append(getattr(self, "i" + call.op)(*call.args, timeout=call.timeout))
            else:
                getattr(self, call.op)(*call.args, timeout=call.timeout)
        return all_of("coalesced", works)


class CoalescedSkipsLast(Coalescing):
    def coalesced(self, calls: Sequence[Call]) -> Work:
        return super().coalesced(calls[:-1])  # bug: an off-by-one slice


# -- 47, 48: receiving from any source ---------------------------------------------------------------------


def _peer_index(rank: int, me: int) -> int:
    return rank if rank < me else rank - 1  # bug: the index in [other ranks], not the group rank


class AnySourcePeerIndex(TCPBackend):
    def recv_anysource(self, tensor: torch.Tensor, tag: int, *, timeout: float) -> int:
        return _peer_index(super().recv_anysource(tensor, tag, timeout=timeout), self.rank)

    def irecv_anysource(self, tensor: torch.Tensor, tag: int, *, timeout: float) -> Work:
        return mapped(super().irecv_anysource(tensor, tag, timeout=timeout), lambda src: _peer_index(src, self.rank))


class AnySourceIrecvPerPeer(TCPBackend):
    def recv_anysource(self, tensor: torch.Tensor, tag: int, *, timeout: float) -> int:
        landing = {p: torch.empty_like(tensor) for p in range(self.size) if p != self.rank}
        works = {p: self.irecv(buf, p, tag, timeout=timeout) for p, buf in landing.items()}
        first = threading.Event()
        for work in works.values():
            work.add_done_callback(lambda _: first.set())
        if not first.wait(timeout):
            raise CollectiveTimeout(f"recv from any source timed out after {timeout} s", peers=list(works))
        peer = next(p for p, work in works.items() if work.is_completed())
        works[peer].wait()
        tensor.copy_(landing[peer])
        return peer  # bug: the receives from the other peers stay posted and take their next messages

    irecv_anysource = Backend.irecv_anysource  # the core's helper thread runs recv_anysource


class AnySourceStaleSender(TCPBackend):
    _last: int | None = None

    def recv_anysource(self, tensor: torch.Tensor, tag: int, *, timeout: float) -> int:
        source = super().recv_anysource(tensor, tag, timeout=timeout)
        reported = source if self._last is None else self._last  # bug: read before it is updated
        self._last = source
        return reported

    irecv_anysource = Backend.irecv_anysource


# -- 50, 51, 52: the receives test ------------------------------------------------------------------------


class RecvZeroPads(TCPBackend):
    def recv(self, tensor: torch.Tensor, src: int, tag: int, *, timeout: float) -> None:
        try:
            super().recv(tensor, src, tag, timeout=timeout)
        except CollectiveMismatchError:
            tensor.zero_()  # bug: a message of another size "received" as zeros, and no error

    irecv = Backend.irecv  # (the core's helper thread runs recv)


#: What send_bytes takes (``Backend.send_bytes``).
_Message = _Bytes | mmap.mmap | Sequence[_Bytes | mmap.mmap]


def _joined(data: _Message) -> bytes:
    parts = [data] if isinstance(data, (bytes, bytearray, memoryview, mmap.mmap)) else list(data)
    return b"".join(bytes(part) for part in parts)


class SendBytesDropsLastByte(TCPBackend):
    def send_bytes(self, data: _Message, dst: int, tag: int, *, timeout: float) -> None:
        joined = _joined(data)
        chunks = len(joined) // _WINDOW + (1 if len(joined) % _WINDOW > 1 else 0)  # bug: "> 1" for "> 0"
        kept = min(len(joined), chunks * _WINDOW) if len(joined) > _WINDOW else len(joined)
        super().send_bytes([joined[:kept]], dst, tag, timeout=timeout)


class SendBytesStopsAtEmptyPart(TCPBackend):
    def send_bytes(self, data: _Message, dst: int, tag: int, *, timeout: float) -> None:
        parts = [data] if isinstance(data, (bytes, bytearray, memoryview, mmap.mmap)) else list(data)
        kept = list(itertools.takewhile(lambda part: memoryview(part).nbytes > 0, parts))  # bug: "" ends the list
        super().send_bytes(kept, dst, tag, timeout=timeout)


# -- layouts users pass and values at every size ------------------------------------------------------------


def _whole_storage(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=tensor.dtype).set_(tensor.untyped_storage())  # bug: the storage, not the view


class BucketWholeStorage(TCPBackend):
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, *, timeout: float) -> None:
        super().all_reduce(_whole_storage(tensor), op, timeout=timeout)


class SendFromStorageStart(TCPBackend):
    def _send_request(self, name: str, tensor: torch.Tensor, dst: int, tag: int, timeout: float) -> Send:
        storage = tensor.untyped_storage()
        start = torch.empty(0, dtype=tensor.dtype).set_(storage, 0, tensor.shape, tensor.stride())  # bug: offset 0
        return super()._send_request(name, start, dst, tag, timeout)


_SCALAR_KINDS = frozenset({RedOpType.SUM, RedOpType.PRODUCT, RedOpType.MIN, RedOpType.MAX, RedOpType.AVG})


class OneElementViaFloat32(TCPBackend):
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, *, timeout: float) -> None:
        real = not (tensor.is_complex() or tensor.dtype is torch.bool)
        if tensor.numel() != 1 or not real or op.type not in _SCALAR_KINDS:
            super().all_reduce(tensor, op, timeout=timeout)
            return
        scalar = tensor.to(torch.float32)  # bug: "one number, float32 is plenty"
        super().all_reduce(scalar, op, timeout=timeout)
        tensor.copy_(scalar)


# -- 53-54: the eager limit (backend API 1.10) --------------------------------------------------------------

#: Rendezvous sends acknowledge on this tag bit, above the tags they declare (``max_tag`` below it).
_ACK_BIT = 1 << 62
_NO_BYTES = torch.empty(0, dtype=torch.uint8)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class Rendezvous(TCPBackend):
    """pg-tcp whose sends above :attr:`waits_above` bytes wait until the receiver has the message, as
    MPI's sends do above their eager size: the receiver acknowledges it (an empty message on the tag
    with :data:`_ACK_BIT` set) once its receive completed, and the blocking send, or the isend's work,
    completes with that acknowledgement. Honest when it declares ``eager_limit_bytes=waits_above``
    (:data:`RENDEZVOUS`); a receive from any source is not declared (it would not acknowledge).
    Test-only: an acknowledgement that fails is lost, and its sender waits out its timeout."""

    waits_above = 64 << 10

    def _acked(self, dst: int, tag: int, timeout: float) -> None:
        super().recv(_NO_BYTES, dst, tag | _ACK_BIT, timeout=timeout)

    def _ack(self, src: int, tag: int, timeout: float) -> None:
        super().send(_NO_BYTES, src, tag | _ACK_BIT, timeout=timeout)

    def send(self, tensor: torch.Tensor, dst: int, tag: int, *, timeout: float) -> None:
        super().send(tensor, dst, tag, timeout=timeout)
        if _nbytes(tensor) > self.waits_above:
            self._acked(dst, tag, timeout)

    def recv(self, tensor: torch.Tensor, src: int, tag: int, *, timeout: float) -> None:
        super().recv(tensor, src, tag, timeout=timeout)
        if _nbytes(tensor) > self.waits_above:
            self._ack(src, tag, timeout)

    def isend(self, tensor: torch.Tensor, dst: int, tag: int, *, timeout: float) -> Work:
        sent = super().isend(tensor, dst, tag, timeout=timeout)
        if _nbytes(tensor) <= self.waits_above:
            return sent
        return all_of("isend", [sent, super().irecv(_NO_BYTES, dst, tag | _ACK_BIT, timeout=timeout)])

    def irecv(self, tensor: torch.Tensor, src: int, tag: int, *, timeout: float) -> Work:
        work = super().irecv(tensor, src, tag, timeout=timeout)
        if _nbytes(tensor) > self.waits_above:
            # acknowledged as soon as the receive completes, whether or not anyone waits (MPI's
            # rendezvous completes the send once the receive matched it), from a thread of its own:
            # pg-tcp's progress thread, which completes the receive, must not block in a send
            def acknowledge(done: Work) -> None:
                if done.exception(0) is None:
                    threading.Thread(target=self._ack, args=(src, tag, timeout), daemon=True).start()

            work.add_done_callback(acknowledge)
        return work

    def send_bytes(self, data: Sequence[bytes | bytearray | memoryview], dst: int, tag: int, *, timeout: float) -> None:  # type: ignore[override]
        super().send_bytes(data, dst, tag, timeout=timeout)
        if sum(memoryview(part).nbytes for part in data) > self.waits_above:
            self._acked(dst, tag, timeout)

    def recv_bytes(self, src: int, tag: int, *, timeout: float) -> bytearray | mmap.mmap:
        data = super().recv_bytes(src, tag, timeout=timeout)
        if len(data) > self.waits_above:
            self._ack(src, tag, timeout)
        return data


class EagerLimitOverstated(Rendezvous):
    # bug: declares eager_limit_bytes=64 KiB, but its transport's eager buffers hold 4 KiB ("the
    # limit of the library it wraps", read from the wrong constant): sends above 4 KiB wait for
    # their receiver
    waits_above = 4 << 10


class IsendQueuedNoCopy(TCPBackend):
    def isend(self, tensor: torch.Tensor, dst: int, tag: int, *, timeout: float) -> Work:
        # zero copy (allowed: the caller leaves the tensor alone until the work completes), but the
        # work completes once the send is queued, and the queue's thread reads the tensor when it
        # gets to it (bug: queued is not sent)
        work = Work("isend")
        send = super().send
        threading.Timer(0.05, send, (tensor, dst, tag), {"timeout": timeout}).start()
        work.set_result(None)
        return work


# -- the specs -------------------------------------------------------------------------------------------

BROADCAST_WRONG_ROOT = _spec("broadcast-wrong-root", BroadcastWrongRoot)
ALL_GATHER_RING_BLOCK = _spec("all-gather-ring-block", AllGatherRingBlock)
AVG_WRONG_COUNT = _spec("avg-wrong-count", AvgWrongCount, FLOAT_REDUCE_CAPS)
FLOAT64_AS_FLOAT32 = _spec("float64-as-float32", Float64AsFloat32, FLOAT_REDUCE_CAPS)
TAGS_IGNORED = _spec("tags-ignored", TagsIgnored, P2P_CAPS)
BARRIER_NO_WAIT = _spec("barrier-no-wait", BarrierNoWait, BARRIER_CAPS)
RANK_ORDER_SUM = _spec("rank-order-sum", RankOrderSum, FLOAT_REDUCE_CAPS)
COMPLEX128_P2P_RAISES = _spec("complex128-p2p-raises", Complex128P2PRaises, P2P_CAPS)
IRECV_EARLY = _spec("irecv-early", IrecvEarly, P2P_CAPS)
SCATTER_REVERSED = _spec("scatter-reversed", ScatterReversed)
A2A_SINGLE_EVEN_SPLITS = _spec("a2a-single-even-splits", A2ASingleEvenSplits)
STALE_ACCUMULATOR = _spec("stale-accumulator", StaleAccumulator, ALL_REDUCE_SUM_CAPS)
PREMUL_FACTOR_IGNORED = _spec("premul-factor-ignored", PremulFactorIgnored, FLOAT_REDUCE_CAPS)
INT_MIN_MAX_SWAPPED = _spec("int-min-max-swapped", IntMinMaxSwapped, INT_MIN_MAX_CAPS)
LEAKED_THREAD = _spec("leaked-thread", LeakedThread)
ALL_GATHER_ZEROES_INPUT = _spec("all-gather-zeroes-input", AllGatherZeroesInput)
BARRIER_HANGS_AT_3 = _spec("barrier-hangs-at-3", BarrierHangsAt3)
RECV_SWALLOWS_TIMEOUT = _spec("recv-swallows-timeout", RecvSwallowsTimeout, P2P_CAPS)
BARRIER_HIDES_PEER_FAILURE = _spec("barrier-hides-peer-failure", BarrierHidesPeerFailure)
REDUCE_SCATTER_NEXT_BLOCK = _spec("reduce-scatter-next-block", ReduceScatterNextBlock)
SEND_BYTES_FIRST_PART_ONLY = _spec("send-bytes-first-part-only", SendBytesFirstPartOnly)
RECV_BYTES_SHORT_READ = _spec("recv-bytes-short-read", RecvBytesShortRead, MESSAGE_CAPS)
BYTES_TAGS_IGNORED = _spec("bytes-tags-ignored", BytesTagsIgnored, MESSAGE_CAPS)
SEND_BYTES_SCRUBS_PARTS = _spec("send-bytes-scrubs-parts", SendBytesScrubsParts, MESSAGE_CAPS)
EMULATED_RECV_SHORT_READ = _spec("emulated-recv-short-read", EmulatedRecvShortRead, MESSAGE_CAPS)
PROCESS_WIDE_SEQUENCE = _spec("process-wide-sequence", ProcessWideSequence)
BFLOAT16_VIA_FLOAT16 = _spec("bfloat16-via-float16", Bfloat16ViaFloat16)
INT64_VIA_FLOAT64 = _spec("int64-via-float64", Int64ViaFloat64)
UINT8_AS_INT8 = _spec("uint8-as-int8", Uint8AsInt8)
SATURATING_INT_SUM = _spec("saturating-int-sum", SaturatingIntSum)
ZERO_START_SUM = _spec("zero-start-sum", ZeroStartSum)
NAN_AS_ZERO_SUM = _spec("nan-as-zero-sum", NanAsZeroSum)
COMPLEX_PRODUCT_ELEMENTWISE = _spec("complex-product-elementwise", ComplexProductElementwise)
BROADCAST_LAST_CHUNK_DROPPED = _spec("broadcast-last-chunk-dropped", BroadcastLastChunkDropped)
ODD_BYTES_DROPPED = _spec("odd-bytes-dropped", OddBytesDropped)
LAST_ROOT_REDUCE = _spec("last-root-reduce", LastRootReduce)
A2A_QUIET_RANK_SKIPS = _spec("a2a-quiet-rank-skips", A2AQuietRankSkips)
TIMEOUT_FROM_GROUP = _spec("timeout-from-group", TimeoutFromGroup)
CACHED_WAKEUP_PIPE = _spec("cached-wakeup-pipe", CachedWakeupPipe)
HELPER_PROCESS_LEFT = _spec("helper-process-left", HelperProcessLeft)
ABORT_LEAVES_RECEIVES = _spec("abort-leaves-receives", AbortLeavesReceives)
CACHED_SHARED_MEMORY = _spec("cached-shared-memory", CachedSharedMemory)
ISEND_COMPLETES_EARLY = _spec("isend-completes-early", IsendCompletesEarly)
IRECV_FILLS_LATE = _spec("irecv-fills-late", IrecvFillsLate)
TAGS_TRUNCATED_32 = _spec("tags-truncated-32", TagsTruncated32)
RECV_BYTES_SHARED_BUFFER = _spec("recv-bytes-shared-buffer", RecvBytesSharedBuffer)
RECV_BYTES_READ_ONLY = _spec("recv-bytes-read-only", RecvBytesReadOnly)
COALESCED_SKIPS_LAST = _spec("coalesced-skips-last", CoalescedSkipsLast)

ANY_SOURCE_PEER_INDEX = _spec("any-source-peer-index", AnySourcePeerIndex)
ANY_SOURCE_IRECV_PER_PEER = _spec("any-source-irecv-per-peer", AnySourceIrecvPerPeer)
ANY_SOURCE_STALE_SENDER = _spec("any-source-stale-sender", AnySourceStaleSender)
BUCKET_WHOLE_STORAGE = _spec("bucket-whole-storage", BucketWholeStorage)
SEND_FROM_STORAGE_START = _spec("send-from-storage-start", SendFromStorageStart)
ONE_ELEMENT_VIA_FLOAT32 = _spec("one-element-via-float32", OneElementViaFloat32)
RECV_ZERO_PADS = _spec("recv-zero-pads", RecvZeroPads)
SEND_BYTES_DROPS_LAST_BYTE = _spec("send-bytes-drops-last-byte", SendBytesDropsLastByte)
SEND_BYTES_STOPS_AT_EMPTY_PART = _spec("send-bytes-stops-at-empty-part", SendBytesStopsAtEmptyPart)
#: Point to point and messages, every dtype, tags below the acknowledgements', and a 64 KiB eager limit.
RENDEZVOUS_CAPS = Capabilities(
    ops=frozenset({"send", "recv"}), dtypes=frozenset(DTYPES), max_tag=_ACK_BIT - 1, eager_limit_bytes=64 << 10
)
EAGER_LIMIT_OVERSTATED = _spec("eager-limit-overstated", EagerLimitOverstated, RENDEZVOUS_CAPS)
ISEND_QUEUED_NO_COPY = _spec("isend-queued-no-copy", IsendQueuedNoCopy)

# -- the unmodified backend under each declaration above ---------------------------------------------------

CONTROL = _spec("control", TCPBackend)
CONTROL_FLOAT_REDUCE = _spec("control-float-reduce", TCPBackend, FLOAT_REDUCE_CAPS)
CONTROL_INT_MIN_MAX = _spec("control-int-min-max", TCPBackend, INT_MIN_MAX_CAPS)
CONTROL_P2P = _spec("control-p2p", TCPBackend, P2P_CAPS)
CONTROL_ALL_REDUCE_SUM = _spec("control-all-reduce-sum", TCPBackend, ALL_REDUCE_SUM_CAPS)
CONTROL_BARRIER = _spec("control-barrier", TCPBackend, BARRIER_CAPS)
CONTROL_MESSAGES = _spec("control-messages", TCPBackend, MESSAGE_CAPS)
CONTROL_EMULATED = _spec("control-emulated", Emulated, MESSAGE_CAPS)
COALESCING = _spec("coalescing", Coalescing)
#: pg-tcp whose sends above 64 KiB wait for their receivers, declared so (the control of the eager limit's bugs).
RENDEZVOUS = _spec("rendezvous", Rendezvous, RENDEZVOUS_CAPS)


class Rendezvous1K(Rendezvous):
    waits_above = 1 << 10


#: pg-tcp whose sends above 1 KiB wait for their receivers, declared so: what the core's own layers
#: (object collectives, messages) must not deadlock on (tests/conformance/test_eager_limit.py).
RENDEZVOUS_1K = _spec("rendezvous-1k", Rendezvous1K, dataclasses.replace(RENDEZVOUS_CAPS, eager_limit_bytes=1 << 10))
