"""Objects: a group's value operations (objects, tensors of unknown shape, tensor dicts) over messages.

A layer over the backend contract, the way mpi4py's ``pkl5`` sits over a communicator:
:mod:`pg_core.messages` turns a value into one message and moves it; this module gives
each value operation its semantics on a group: point to point in (peer, tag) order,
asynchronous calls on the message backend's helper threads, and the object collectives run
by the group's executor, their messages stamped with the collective's op and sequence
number so mismatched calls raise instead of mixing.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from . import messages
from .errors import CollectiveMismatchError, CollectiveTimeout
from .tags import check_tag
from .timeouts import Deadline, retell
from .validation import check_peer, check_rank

if TYPE_CHECKING:
    from .coalescing import OpenBlocks
    from .dispatch import Dispatcher
    from .executor import Executor
    from .instance import Instance
    from .validation import Supported
    from .work import Work

__all__ = ["OBJECT_COLLECTIVES", "VALUE_COLLECTIVES", "Objects"]

#: The value collectives: the collectives of objects, then of tensor dicts, in the order their
#: messages number them (appended to, never renumbered). The one list; the conformance suite
#: draws from it.
VALUE_COLLECTIVES: tuple[str, ...] = (
    "broadcast_object",
    "all_gather_object",
    "gather_object",
    "scatter_object",
    "broadcast_tensor_dict",
)
#: The value collectives of pickled objects (the others carry tensor dicts).
OBJECT_COLLECTIVES: tuple[str, ...] = tuple(op for op in VALUE_COLLECTIVES if op.endswith("_object"))
#: Each value collective's number in its messages.
_OPS: dict[str, int] = {name: i + 1 for i, name in enumerate(VALUE_COLLECTIVES)}
_OP_NAMES = {code: name for name, code in _OPS.items()}


class Objects:
    """The value operations of one group (rank ``rank`` of ``size``): see the module docstring.

    Messages go to the backend of ``device`` (the group's cpu backend, else its first);
    tensors on the ``separate`` device types travel on their own backends, described by
    the message.
    """

    def __init__(
        self,
        *,
        rank: int,
        size: int,
        device: torch.device,
        separate: frozenset[str],
        dispatcher: Dispatcher,
        supported: Supported,
        executor: Executor,
        coalescing: OpenBlocks,
        name: str,
        loader: messages.Loader = messages.PICKLE,
    ) -> None:
        self.rank, self.size = rank, size
        self.device = device
        self.separate = separate
        self._dispatch = dispatcher
        self._supported = supported
        self._executor = executor
        self._coalescing = coalescing  # the group's open coalescing blocks, by thread: value ops refuse to run in one
        self._name = name
        self.loader = loader  # how received objects are loaded (pickle, or restricted)
        self._endpoint: messages.Endpoint | None = None
        self._endpoint_lock = threading.Lock()
        self._checked: set[str] = set()

    # -- the message endpoint -----------------------------------------------------------
    def endpoint(self, op: str | None = None) -> messages.Endpoint:
        """The message device's backend as an endpoint (created on first use, for ``op``)."""
        ep = self._endpoint
        if ep is None:
            with self._endpoint_lock:
                ep = self._endpoint
                if ep is None:
                    ep = self._endpoint = messages.Endpoint(self._dispatch.instance(self.device, op))
        return ep

    def _checked_endpoint(self, op: str, *directions: str) -> messages.Endpoint:
        """Messages need the message backend's ``send``/``recv`` (of ``uint8`` where they
        are emulated on tensors). Creates that backend if this is its first use."""
        if self._coalescing:
            self._coalescing.refuse_inside(op)
        ep = self.endpoint(op)
        for direction in directions:
            if direction not in self._checked:
                self._supported.check(direction, ep.device, None if ep.native else torch.uint8)
                self._checked.add(direction)
        return ep

    def _check_separate(self, out: messages.Encoded, op: str) -> None:
        for t in out.separate:
            self._supported.check(op, t.device, t.dtype)

    def _instance(self, device: torch.device) -> Instance:
        return self._dispatch.instance(device)

    # -- point to point -------------------------------------------------------------------
    def send(
        self, op: str, kind: int, value: Any, *, dst: int, tag: int, async_op: bool, timeout: float
    ) -> Work | None:
        """Send ``value`` as one message of ``kind`` to ``dst``; with ``async_op``, a Work."""
        self._executor.check_open()
        check_peer(dst, self.size, self.rank, "dst", op)
        check_tag(tag)
        ep = self._checked_endpoint(op, "send")
        wire = ep.instance.tags.message(tag)
        out = messages.encode(kind, value, separate_devices=self.separate)
        self._check_separate(out, "send")

        def run() -> None:
            self._executor.check_open()
            try:
                if ep.native and not out.separate:  # one send_bytes: atomic, needs no stream lock
                    ep.send_one(out.parts(), dst, wire, timeout, op)
                    return
                deadline = Deadline(op, timeout)
                with ep.stream("send", dst, wire, op) as progress:
                    ep.send(out.parts(), dst, wire, deadline, progress)
                    for t in out.separate:
                        inst = self._instance(t.device)
                        inst.backend.send(t, dst, inst.tags.message(tag), timeout=deadline.left())
            except CollectiveTimeout as exc:
                retell(exc, op, f" to rank {dst} (tag {tag})", timeout)  # the user's op, not send_bytes

        result = ep.instance.ordered("send", dst, wire, op, run, async_op=async_op)
        return result if async_op else None

    def recv(
        self,
        op: str,
        kind: int | None,
        *,
        src: int,
        tag: int,
        device: torch.device | None,
        async_op: bool,
        timeout: float,
    ) -> Any:
        """Receive the next message from ``src`` with ``tag``; ``kind`` (if given) is what it
        must be. With ``async_op``, a Work whose ``result()`` is the value."""
        self._executor.check_open()
        check_peer(src, self.size, self.rank, "src", op)
        check_tag(tag)
        ep = self._checked_endpoint(op, "recv")
        wire = ep.instance.tags.message(tag)

        def run() -> Any:
            self._executor.check_open()
            try:
                if ep.native and not self.separate:  # every message is one recv_bytes
                    data = ep.recv_one(src, wire, timeout, op)
                    if kind == messages.TENSOR and (tensor := messages.parse_tensor(data)) is not None:
                        return tensor if device is None or device == tensor.device else tensor.to(device)
                    incoming, separate = messages.parse(data, src=src), {}
                else:
                    deadline = Deadline(op, timeout)
                    with ep.stream("recv", src, wire, op) as progress:
                        data = ep.recv(src, wire, deadline, progress)
                        incoming = messages.parse(data, src=src)
                        separate = self._recv_separate(incoming, src, tag, deadline)
            except CollectiveTimeout as exc:
                retell(exc, op, f" from rank {src} (tag {tag})", timeout)  # the user's op, not recv_bytes
            if kind is not None and incoming.kind != kind:
                raise CollectiveMismatchError(
                    f"{op}: rank {src} sent {messages.KIND_NAMES.get(incoming.kind, 'an unknown message')} with "
                    f"tag {tag}, where this rank expected {messages.KIND_NAMES[kind]}",
                    peers=(src,),
                )
            return incoming.value(separate, device, self.loader)

        return ep.instance.ordered("recv", src, wire, op, run, async_op=async_op)

    def _recv_separate(
        self, incoming: messages.Incoming, src: int, tag: int, deadline: Deadline
    ) -> dict[int, torch.Tensor]:
        """Receive the tensors that followed a message on their own device backends."""
        separate = {}
        for index, spec in incoming.separate_specs():
            device = self._dispatch.device(spec.device)
            tensor = torch.empty(spec.shape, dtype=spec.dtype, device=device)
            inst = self._instance(device)
            inst.backend.recv(tensor, src, inst.tags.message(tag), timeout=deadline.left())
            separate[index] = tensor
        return separate

    # -- collectives ------------------------------------------------------------------------
    def run(
        self, op: str, call: Callable[[Deadline, messages.Endpoint, int], Any], timeout: float, async_op: bool
    ) -> Any:
        """Run message collective ``op`` in the executor's order: ``call(deadline, endpoint, seq)``."""
        ep = self._checked_endpoint(op, "send", "recv")

        def told(seq: int) -> Any:
            try:
                return call(Deadline(op, timeout), ep, seq)
            except CollectiveTimeout as exc:
                retell(exc, op, f" #{seq}", timeout, seq)  # the user's op, not its messages' recv_bytes

        return self._executor.run(op, told, async_op=async_op)

    def _stamp(self, out: messages.Encoded | None, op: str, seq: int) -> list[messages.Buffer]:
        return [] if out is None else out.parts(op=_OPS[op], seq=seq)

    def _value(self, op: str, seq: int, data: messages.Received, src: int) -> Any:
        incoming = messages.parse(data, src=src)
        messages.check_collective(incoming, op=_OPS[op], seq=seq, src=src, what=op, names=_OP_NAMES)
        return incoming.value({}, None, self.loader)

    def broadcast(
        self,
        op: str,
        value: Any,
        kind: int,
        *,
        src: int,
        device: torch.device | None,
        timeout: float,
        async_op: bool,
    ) -> Any:
        """Every rank returns ``src``'s ``value`` (``src`` its own, the others a copy decoded
        from one message sent down a binomial tree); tensors on separate devices follow as
        their backends' ``broadcast``."""
        check_rank(src, self.size, "src")
        out = None
        if self.rank == src:
            out = messages.encode(kind, value, separate_devices=self.separate)
            self._check_separate(out, "broadcast")

        def call(deadline: Deadline, ep: messages.Endpoint, seq: int) -> Any:
            tag = ep.instance.tags.object_collective
            got = messages.tree_broadcast(
                self._stamp(out, op, seq) if self.rank == src else None,
                rank=self.rank,
                size=self.size,
                src=src,
                send=lambda p, peer: ep.send(p, peer, tag, deadline),
                recv=lambda peer: ep.recv(peer, tag, deadline),
            )
            if out is not None:  # the source: its tensors on other devices follow, broadcast by their backends
                for t in out.separate:
                    self._instance(t.device).backend.broadcast(t, src, timeout=deadline.left())
                return value
            data = got[0]
            assert not isinstance(data, (bytes, memoryview))  # received, not this rank's own parts
            incoming = messages.parse(data, src=src)
            messages.check_collective(incoming, op=_OPS[op], seq=seq, src=src, what=op, names=_OP_NAMES)
            separate = {}
            for index, spec in incoming.separate_specs():
                target = self._dispatch.device(spec.device)
                self._supported.check("broadcast", target, spec.dtype)
                tensor = torch.empty(spec.shape, dtype=spec.dtype, device=target)
                self._instance(target).backend.broadcast(tensor, src, timeout=deadline.left())
                separate[index] = tensor
            return incoming.value(separate, device, self.loader)

        return self.run(op, call, timeout, async_op)

    def all_gather(self, obj: Any, *, timeout: float, async_op: bool) -> Any:
        out = messages.encode(messages.OBJECT, obj)
        op = "all_gather_object"

        def call(deadline: Deadline, ep: messages.Endpoint, seq: int) -> list[Any]:
            tag = ep.instance.tags.object_collective
            parts = self._stamp(out, op, seq)
            n, me = self.size, self.rank
            values: list[Any] = [None] * n

            def receive(i: int) -> None:
                peer = (me - i) % n
                values[peer] = self._value(op, seq, ep.recv(peer, tag, deadline), peer)

            if not ep.may_wait(sum(memoryview(p).nbytes for p in parts)):
                # every send returns at once: all of them, then the receives
                for i in range(1, n):
                    ep.send(parts, (me + i) % n, tag, deadline)
                for i in range(1, n):
                    receive(i)
            else:
                # a send may wait for its receiver (above the backend's eager limit): step i sends
                # to me + i and receives from me - i, which splits the ranks into cycles of the
                # ranks congruent modulo gcd(n, i); in each, its lowest rank sends first and the
                # others receive first, so no cycle of ranks waits on itself (a rank whose sends
                # do not wait sent everything before its receives)
                for i in range(1, n):
                    if me < math.gcd(n, i):
                        ep.send(parts, (me + i) % n, tag, deadline)
                        receive(i)
                    else:
                        receive(i)
                        ep.send(parts, (me + i) % n, tag, deadline)
            values[me] = _copy(parts, me)
            return values

        return self.run(op, call, timeout, async_op)

    def gather(self, obj: Any, *, dst: int, timeout: float, async_op: bool) -> Any:
        check_rank(dst, self.size, "dst")
        out = messages.encode(messages.OBJECT, obj)
        op = "gather_object"

        def call(deadline: Deadline, ep: messages.Endpoint, seq: int) -> list[Any] | None:
            tag = ep.instance.tags.object_collective
            parts = self._stamp(out, op, seq)
            if self.rank != dst:
                ep.send(parts, dst, tag, deadline)
                return None
            values: list[Any] = [None] * self.size
            for peer in range(self.size):
                if peer != dst:
                    values[peer] = self._value(op, seq, ep.recv(peer, tag, deadline), peer)
            values[dst] = _copy(parts, dst)
            return values

        return self.run(op, call, timeout, async_op)

    def scatter(self, objs: Sequence[Any] | None, *, src: int, timeout: float, async_op: bool) -> Any:
        check_rank(src, self.size, "src")
        outs: list[messages.Encoded] = []
        if self.rank == src:
            if not isinstance(objs, (list, tuple)):
                raise TypeError(f"scatter_object: objs must be a list on the source rank, got {type(objs).__name__}")
            if len(objs) != self.size:
                raise ValueError(f"scatter_object: objs must have one object per rank ({self.size}), got {len(objs)}")
            outs = [messages.encode(messages.OBJECT, o) for o in objs]
        elif objs is not None:
            raise ValueError(f"scatter_object: objs is only passed on the source rank ({src})")
        op = "scatter_object"

        def call(deadline: Deadline, ep: messages.Endpoint, seq: int) -> Any:
            tag = ep.instance.tags.object_collective
            if self.rank != src:
                return self._value(op, seq, ep.recv(src, tag, deadline), src)
            for peer in range(self.size):
                if peer != src:
                    ep.send(self._stamp(outs[peer], op, seq), peer, tag, deadline)
            return _copy(self._stamp(outs[src], op, seq), src)

        return self.run(op, call, timeout, async_op)


def _copy(parts: Sequence[messages.Buffer], rank: int) -> Any:
    """What this rank's own message decodes to: the copy its peers get."""
    return messages.parse(bytearray().join(parts), src=rank).value({}, None)
