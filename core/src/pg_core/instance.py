"""Instances: one live backend of a group as the core drives it (tags, helper threads, order, cleanup).

The plugin's object stays what the contract describes; everything the core needs around it
lives here, so a plugin reserves no name and needs no ``super().__init__``:

* the :class:`~pg_core.tags.TagMap` from the backend's declared tag range;
* the default ``isend``/``irecv`` (``send``/``recv`` on a helper thread per stream) for a
  backend that does not override them, and the helper threads of the group's asynchronous
  messages;
* the non-overtaking rule, written once (:meth:`Instance.ordered`): a blocking call on a
  stream whose helper thread still has work queues behind it, since messages keep their
  order per (peer, tag) (per peer on a backend without tags). The any-source receives of
  a tag are a stream of their own (:data:`ANY` for the peer): they keep their order among
  themselves, and the backend keeps each sender's order across every receive
  (:mod:`pg_core.backend`);
* cleanup: helper threads stopped and the backend's ``shutdown``/``abort`` called, whatever
  the backend's own methods do.
"""

from __future__ import annotations

import inspect
import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .backend import Backend, BackendContext, BackendSpec, parse_api_version
from .errors import GroupClosedError, PluginError
from .ops import COLLECTIVE_OPS
from .tags import TagMap
from .work import Work, mapped, stop_worker

if TYPE_CHECKING:
    from .recorder import FlightRecorder

__all__ = ["ANY", "Instance", "Lane"]

_Key = tuple[Any, ...]

#: The peer of the any-source receives' stream, in the place of a rank.
ANY = "any"


def _takes_async_op(method: object) -> bool:
    """Whether ``method`` can be called with ``async_op=`` (a parameter of that name, or ``**kwargs``)."""
    if not callable(method):
        return False
    try:
        parameters = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): take the declaration's word
        return True
    return any(p.name == "async_op" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


class Instance:
    """A backend of one group and device type, created by the dispatcher on first use."""

    __slots__ = (
        "_streams",
        "backend",
        "device",
        "launches",
        "launching",
        "native_bytes",
        "native_irecv",
        "native_irecv_any",
        "native_isend",
        "native_release",
        "native_split",
        "rank",
        "scatter_gather",
        "size",
        "spec",
        "tags",
    )

    def __init__(self, spec: BackendSpec, ctx: BackendContext) -> None:
        factory = spec.load_factory()
        if isinstance(factory, type) and issubclass(factory, Backend):
            _check_sends_can_wait(spec, ctx.device.type, factory)
        backend = factory(ctx)
        if not isinstance(backend, Backend):
            raise TypeError(f"backend {spec.name!r} factory returned {type(backend).__name__}, not a pg_core Backend")
        for attr, value in (("ctx", ctx), ("rank", ctx.rank), ("size", ctx.size)):
            if not hasattr(backend, attr):  # its constructor did not call Backend.__init__
                setattr(backend, attr, value)
        cls = type(backend)
        if not (isinstance(factory, type) and issubclass(factory, Backend)):
            try:
                _check_sends_can_wait(spec, ctx.device.type, cls)
            except PluginError:
                backend.abort()
                raise
        self.backend = backend
        self.spec = spec
        self.device: torch.device = ctx.device
        self.rank, self.size = ctx.rank, ctx.size  # the group's, for the senders any-source receives name
        self.tags = TagMap(spec.capabilities_for(ctx.device.type).max_tag, spec.name)
        #: collectives launch with ``async_op=True`` and return a Work (API 1.2)
        self.launches = getattr(backend, "launches", False) is True
        #: the collectives that do: those whose method takes ``async_op`` (a subclass of a backend
        #: that launches may override a collective the way a backend that does not writes it)
        self.launching: frozenset[str] = (
            frozenset(op for op in COLLECTIVE_OPS if _takes_async_op(getattr(backend, op, None)))
            if self.launches
            else frozenset()
        )
        self.native_isend = cls.isend is not Backend.isend
        self.native_irecv = cls.irecv is not Backend.irecv
        self.native_irecv_any = cls.irecv_anysource is not Backend.irecv_anysource
        self.native_bytes = cls.send_bytes is not Backend.send_bytes and cls.recv_bytes is not Backend.recv_bytes
        #: the backend splits its communicator itself (``Backend.split``, API 1.6)
        self.native_split = cls.split is not Backend.split
        #: it releases a split's handle that no subgroup took (``Backend.release_split``, API 1.7)
        self.native_release = cls.release_split is not Backend.release_split
        #: ``send_bytes`` takes a list of buffers (contract 1.1); else the parts are joined
        self.scatter_gather = (parse_api_version(spec.api_version) or (0, 0)) >= (1, 1)
        self._streams = _Streams(
            f"pg-core-{ctx.group_name}-{spec.name}", f"backend {spec.name!r} of group {ctx.group_name!r}"
        )

    def _key(self, kind: str, peer: int | str, wire: int) -> _Key:
        return (kind, peer) if self.tags.ordered_per_peer else (kind, peer, wire)

    def ordered(self, kind: str, peer: int | str, wire: int, op: str, fn: Callable[[], Any], *, async_op: bool) -> Any:
        """Run ``fn`` (one call on stream (``kind``, ``peer``, ``wire``)) in the stream's order:
        with ``async_op`` on the stream's helper thread, returning its :class:`Work`; else
        here, unless the helper still has work, behind which it queues. Returns ``fn()``."""
        key = self._key(kind, peer, wire)
        if async_op:
            return self._streams.get(key).submit(op, fn)
        queued = self._streams.queued(key)
        if queued is not None:
            return queued.submit(op, fn).result()
        return fn()

    # -- the user's point to point ----------------------------------------------------
    def p2p(self, kind: str, tensor: torch.Tensor, peer: int, tag: int, timeout: float, *, async_op: bool) -> Any:
        """The user's ``send``/``recv`` (``kind``) with user ``tag``: blocking, or with ``async_op``
        the backend's own ``isend``/``irecv`` where it has them, else the blocking call on the
        stream's helper thread (a :class:`Work`)."""
        wire = self.tags.user(tag)
        if not async_op:
            return self.blocking(kind, tensor, peer, wire, timeout)
        backend = self.backend
        sending = kind == "send"
        if self.native_isend if sending else self.native_irecv:
            return (backend.isend if sending else backend.irecv)(tensor, peer, wire, timeout=timeout)
        call = backend.send if sending else backend.recv
        return self.ordered(
            kind, peer, wire, f"i{kind}", lambda: call(tensor, peer, wire, timeout=timeout), async_op=True
        )

    def blocking(self, kind: str, tensor: torch.Tensor, peer: int, wire: int, timeout: float) -> None:
        """A blocking ``send``/``recv`` (``kind``) with wire tag ``wire``: here, unless the
        stream's helper still has work, behind which it queues (:meth:`ordered`)."""
        call = self.backend.send if kind == "send" else self.backend.recv
        if not self._streams.helpers:  # no helper thread yet, so none has work to queue behind
            call(tensor, peer, wire, timeout=timeout)
            return
        queued = self._streams.queued(self._key(kind, peer, wire))
        if queued is None:
            call(tensor, peer, wire, timeout=timeout)
        else:
            queued.submit(kind, lambda: call(tensor, peer, wire, timeout=timeout)).result()

    def recv_any(self, tensor: torch.Tensor, tag: int, timeout: float) -> int:
        """The user's blocking receive from any source with user ``tag`` (mapped as for
        ``recv``), in the order of the tag's any-source stream: the sender's group rank, as the
        backend's ``recv_anysource`` returns it, checked (:meth:`sender`)."""
        wire = self.tags.user(tag)
        backend = self.backend
        received = self.ordered(
            "recv", ANY, wire, "recv", lambda: backend.recv_anysource(tensor, wire, timeout=timeout), async_op=False
        )
        return self.sender(received)

    def irecv_any(self, tensor: torch.Tensor, tag: int, timeout: float) -> Work:
        """:meth:`recv_any` started: the backend's ``irecv_anysource`` where it has one, else
        ``recv_anysource`` on the helper thread of the tag's any-source stream; a :class:`Work`
        whose ``result()`` is the sender, checked (:meth:`sender`)."""
        wire = self.tags.user(tag)
        backend = self.backend
        if self.native_irecv_any:
            inner = backend.irecv_anysource(tensor, wire, timeout=timeout)
        else:
            inner = self.ordered(
                "recv", ANY, wire, "irecv", lambda: backend.recv_anysource(tensor, wire, timeout=timeout), async_op=True
            )
        return mapped(inner, self.sender)

    def sender(self, value: object) -> int:
        """``value``, what the backend's any-source receive returned, as the sender's group rank;
        a :class:`PluginError` naming the backend unless it is another rank of the group."""
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < self.size and value != self.rank:
            return value
        spec = self.spec
        raise PluginError(
            f"backend {spec.name!r} broke the contract: its any-source receive returned {value!r}, not the group "
            f"rank of the sender (another rank in 0..{self.size - 1} than this one, {self.rank})",
            distribution=spec.distribution,
        )

    # -- life -------------------------------------------------------------------------
    def close(self, how: str) -> BaseException | None:
        """``how`` is ``"shutdown"`` or ``"abort"``: the backend's, then the helper threads
        stopped. Returns the backend's error, if it raised one."""
        error = None
        try:
            getattr(self.backend, how)()
        except BaseException as exc:
            error = exc
        finally:
            self._streams.stop()
        return error


class Lane:
    """The blocking ``send`` or ``recv`` (``kind``) of one instance for tensors of one dtype:
    what its caller's full checks established once (the instance, the tag range, the wire
    tags), kept so that a later call of that kind with the group's timeout pays only the
    checks that can change from call to call. The group keeps one per (kind, device, dtype)
    and decides, per call, whether the call may take it (``ProcessGroup._p2p_lane``), making
    it for a caller that has checked one such call in full.

    :meth:`run` maps the user tag as :meth:`TagMap.user <pg_core.tags.TagMap.user>` does
    (the caller checked it is below :attr:`limit`) and calls the backend here, or, once the
    instance has helper threads, through :meth:`Instance.blocking`, which keeps the
    stream's order; with the group's flight recorder, recorded around that call
    (:meth:`FlightRecorder.point_to_point <pg_core.recorder.FlightRecorder.point_to_point>`),
    a failure told to ``failed`` (the group's tracer) before it is raised."""

    __slots__ = (
        "_call", "_failed", "_first", "_icall", "_instance", "_recorded", "_step", "_streams", "device", "dtype",
        "kind", "limit", "plain", "starts", "timeout",
    )  # fmt: skip

    def __init__(
        self,
        instance: Instance,
        kind: str,
        dtype: torch.dtype,
        *,
        timeout: float,
        recorder: FlightRecorder | None,
        failed: Callable[[BaseException], None],
    ) -> None:
        self._instance = instance
        self._streams = instance._streams
        self._call = instance.backend.send if kind == "send" else instance.backend.recv
        tags = instance.tags
        self._first, self._step = tags.user_first, tags.user_step
        self.kind = kind
        self.device = instance.device
        self.dtype = dtype
        #: the group's timeout, in seconds: the only one a call on the lane has
        self.timeout = timeout
        self._recorded = None if recorder is None else recorder.point_to_point
        self._failed = failed
        #: user tags below it are carried
        self.limit = tags.limit
        #: the dtype has no lazy conjugation to check (it is not complex)
        self.plain = not dtype.is_complex
        #: the backend has its own ``isend``/``irecv`` for ``kind`` (:meth:`start`); else an
        #: asynchronous call takes the full path, which hands the blocking call to a helper thread
        self.starts = instance.native_isend if kind == "send" else instance.native_irecv
        self._icall = instance.backend.isend if kind == "send" else instance.backend.irecv

    def run(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        """The blocking call with user ``tag`` (``0 <= tag <`` :attr:`limit`), recorded."""
        wire = self._first + self._step * tag
        call = self._queued if self._streams.helpers else self._call  # helper threads: the stream's order decides
        recorded = self._recorded
        if recorded is None:
            call(tensor, peer, wire, timeout=self.timeout)
            return
        try:
            recorded(self.kind, tensor.shape, self.dtype, self.device, peer, call, tensor, wire, self.timeout)
        except BaseException as exc:
            self._failed(exc)
            raise

    def _queued(self, tensor: torch.Tensor, peer: int, wire: int, *, timeout: float) -> None:
        self._instance.blocking(self.kind, tensor, peer, wire, timeout)

    def start(self, tensor: torch.Tensor, peer: int, tag: int) -> Work:
        """The backend's own ``isend``/``irecv`` with user ``tag``, where :attr:`starts`: called
        straight, as :meth:`Instance.p2p` calls it for ``async_op=True``."""
        return self._icall(tensor, peer, self._first + self._step * tag, timeout=self.timeout)  # type: ignore[no-any-return]


def _check_sends_can_wait(spec: BackendSpec, device: str, cls: type[Backend]) -> None:
    """A backend whose blocking ``send`` may wait for its receiver (a declared
    ``eager_limit_bytes``) and that leaves a collective to the core's defaults must have a
    truly asynchronous ``isend``: the defaults post a send, then receive, and with a send that
    waits in the posting thread the ranks of a ring would each wait for the next."""
    caps = spec.capabilities_for(device)
    limit = caps.eager_limit_bytes
    if limit is None or cls.isend is not Backend.isend:
        return
    inherited = sorted(
        op for op in COLLECTIVE_OPS if op in caps.ops and getattr(cls, op, None) is getattr(Backend, op, None)
    )
    if inherited:
        raise PluginError(
            f"backend {spec.name!r} declares eager_limit_bytes={limit} for {device} (a send above it may wait for "
            f"its receiver) but does not override isend, and leaves {', '.join(inherited)} to the core's default "
            "algorithms, which need a send that does not wait in the posting thread: implement a truly "
            "asynchronous isend (API 1.10), or implement those collectives, or declare no eager limit",
            distribution=spec.distribution,
        )


class _Streams:
    """Helper threads keyed by stream, created on first use: one FIFO of calls each.
    Closed once; ``get`` afterwards raises."""

    def __init__(self, prefix: str, owner: str) -> None:
        self._prefix, self._owner = prefix, owner
        #: the helper threads by stream (empty until the first is made: nothing can be queued then)
        self.helpers: dict[_Key, _Helper] = {}
        self._lock = threading.Lock()
        self._closed = False

    def get(self, key: _Key) -> _Helper:
        with self._lock:
            if self._closed:
                raise GroupClosedError(f"{self._owner} is closed")
            helper = self.helpers.get(key)
            if helper is None:
                helper = self.helpers[key] = _Helper(f"{self._prefix}-" + "-".join(map(str, key)))
            return helper

    def queued(self, key: _Key) -> _Helper | None:
        """The stream's helper while a submitted call has not returned (``None`` from the
        helper's own thread: a call it runs may make blocking calls on its stream)."""
        helper = self.helpers.get(key)
        if helper is None or not helper.busy or helper.thread is threading.current_thread():
            return None
        return helper

    def stop(self) -> None:
        with self._lock:
            self._closed = True
            helpers, self.helpers = list(self.helpers.values()), {}
        for helper in helpers:
            helper.stop()


class _Helper:
    """One daemon thread running submitted calls in order, each completing a Work with
    the call's return value (or its exception)."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Work, Callable[[], Any]] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._stopped = False
        self._pending = 0  # submitted calls not yet returned
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def submit(self, op: str, fn: Callable[[], Any]) -> Work:
        work = Work(op)
        with self._lock:
            if self._stopped:
                raise GroupClosedError(f"{op}: the backend is closed")
            self._pending += 1
            self._queue.put((work, fn))
        return work

    @property
    def busy(self) -> bool:
        """Whether a submitted call has not returned yet."""
        return self._pending > 0

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            work, fn = item
            try:
                result = fn()
            except BaseException as exc:
                self._done()
                work.set_exception(exc)
            else:
                self._done()  # before completing: whoever waited for it may go on inline
                work.set_result(result)

    def _done(self) -> None:
        with self._lock:
            self._pending -= 1

    def stop(self) -> None:
        """Refuse new calls, stop the thread and fail what was queued behind the stop (:func:`stop_worker`)."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        stop_worker(
            self._queue,
            self.thread,
            lambda work: GroupClosedError(f"{work.op}: the backend was closed before it ran"),
            join_s=5.0,
        )
