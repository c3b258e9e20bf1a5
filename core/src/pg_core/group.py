"""``ProcessGroup``: one object per group, owning one backend per device type.

There is no default group and no global rank: a ``ProcessGroup`` is an ordinary
object, a process may hold any number of them, and every rank it speaks of is a
rank *in that group*. Each operation goes to the backend of its tensors' device
type, after local validation (so bad input raises here, before any byte is sent).

Ordering: collectives of one group run one at a time, in the order they were
called, on every rank — blocking ones in the caller's thread when nothing is
queued (no thread handoff), asynchronous ones on the group's progress thread.
Point-to-point operations go straight to the backend, which matches them by
(peer, tag) in call order, so ``irecv`` then ``send`` on two ranks cannot
deadlock behind each other.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import socket
import threading
import uuid
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch

from . import dispatch as _d
from .dispatch import BackendsArg, Dispatcher
from .errors import CollectiveMismatchError, CollectiveTimeout, GroupClosedError, PeerFailureError, PGError
from .ops import RedOpType, ReduceOp, as_reduce_op
from .store import PrefixStore, Store
from .work import Work

if TYPE_CHECKING:
    from .backend import Backend
    from .registry import Registry

__all__ = ["DEFAULT_TIMEOUT", "P2POp", "ProcessGroup"]

#: Default per-operation timeout in seconds.
DEFAULT_TIMEOUT = 300.0
_STORE_PREFIX = "pg-core"


def _seconds(timeout: float | timedelta | None, default: float) -> float:
    if timeout is None:
        return default
    if isinstance(timeout, timedelta):
        timeout = timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be seconds (a number) or a timedelta, got {timeout!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    return float(timeout)


def _dense(t: torch.Tensor) -> bool:
    """Laid out exactly as ``torch.empty(t.shape)`` would be. Stricter than
    ``is_contiguous()``, which ignores the strides of size-1 dimensions: a backend
    may ``view`` the tensor as bytes, and that needs the canonical strides."""
    if not t.is_contiguous():
        return False
    expected = 1
    for size, stride in zip(reversed(t.shape), reversed(t.stride()), strict=True):
        if stride != expected:
            return False
        expected *= size
    return True


class _Staging:
    """Contiguous stand-ins for non-contiguous tensors, and the copies back."""

    __slots__ = ("_back",)

    def __init__(self) -> None:
        self._back: list[tuple[torch.Tensor, torch.Tensor]] = []

    def input(self, t: torch.Tensor) -> torch.Tensor:
        return t if _dense(t) else t.clone(memory_format=torch.contiguous_format)

    def output(self, t: torch.Tensor) -> torch.Tensor:
        if _dense(t):
            return t
        staged = t.clone(memory_format=torch.contiguous_format)
        self._back.append((t, staged))
        return staged

    def finish(self) -> None:
        for original, staged in self._back:
            original.copy_(staged)


@dataclass(frozen=True)
class P2POp:
    """One send or receive for :meth:`ProcessGroup.batch_isend_irecv`.

    ``op`` is ``group.isend`` / ``group.irecv`` (or the strings ``"isend"`` /
    ``"irecv"``); ``peer`` is a rank of the group the batch runs on.
    """

    op: Callable[..., Any] | str
    tensor: torch.Tensor
    peer: int
    tag: int = 0

    @property
    def kind(self) -> str:
        name = self.op if isinstance(self.op, str) else getattr(self.op, "__name__", "")
        if name in ("isend", "send"):
            return "isend"
        if name in ("irecv", "recv"):
            return "irecv"
        raise ValueError(f"P2POp.op must be isend or irecv, got {self.op!r}")


class ProcessGroup:
    """A group of ``size`` processes, this one being ``rank``.

    ``store`` is any torch c10d store every member can reach; the group keeps to
    its own namespace in it (``pg-core/<name>/<generation>/``), so groups with
    different names never collide, and forming a name again (say, survivors
    re-forming ``"world"`` after a failure) starts a new generation.

    ``backends``: a dict ``{"cpu": "gloo", "cuda": "nccl"}``, the same as a string
    ``"cpu:gloo,cuda:nccl"``, one backend name for every device it declares,
    ``None`` for the highest-priority available backend per device type, or a
    ``Backend`` subclass / factory. ``timeout`` (seconds) bounds every operation
    unless the call gives its own. ``options`` maps a backend name to the options
    its ``BackendContext`` carries.
    """

    def __init__(
        self,
        store: Store,
        rank: int | None = None,
        size: int | None = None,
        *,
        backends: BackendsArg = None,
        name: str = "world",
        timeout: float | timedelta | None = None,
        options: Mapping[str, Mapping[str, Any]] | None = None,
        registry: Registry | None = None,
    ) -> None:
        rank, size = _rank_and_size(rank, size)
        if not isinstance(name, str) or not name or "/" in name:
            raise ValueError(f"group name must be a non-empty string without '/', got {name!r}")
        self._rank, self._size, self._name = rank, size, name
        self._timeout = _seconds(timeout, DEFAULT_TIMEOUT)
        self._closed: str | None = None
        self._closing = False  # shutdown() started: no new operations, queued ones drain
        self._broken: tuple[type[PGError], str] | None = None  # a collective failed: later ones refuse
        self._lock = threading.Lock()  # guards _queue/_pending/_worker/_closed
        self._exec_lock = threading.Lock()  # held while a collective runs
        self._pending = 0
        self._queue: queue.SimpleQueue[tuple[Work, Callable[[], Any]] | None] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._seq = itertools.count(1)
        self._generation = _join(store, name, rank, size)
        self._uid = f"{name}#{self._generation}"
        self._store = PrefixStore(f"{_STORE_PREFIX}/{name}/{self._generation}", store)
        self._dispatch = Dispatcher(
            backends,
            registry=registry,
            store=self._store,
            rank=rank,
            size=size,
            timeout=self._timeout,
            group_name=name,
            group_uid=self._uid,
            options=options or {},
        )
        # where barrier (an op without tensors) runs: the cpu backend, else the first configured one
        names = self._dispatch.names
        self._barrier_device = torch.device("cpu" if "cpu" in names or not names else next(iter(names)))

    # -- properties -------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def name(self) -> str:
        return self._name

    @property
    def timeout(self) -> float:
        """Default per-operation timeout in seconds."""
        return self._timeout

    @property
    def backends(self) -> dict[str, str]:
        """Device type -> backend name."""
        return self._dispatch.names

    def supports(
        self,
        op: str,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        reduce_op: ReduceOp | RedOpType | None = None,
    ) -> bool:
        """Whether ``op`` (e.g. ``"all_reduce"``, ``"isend"``) is declared for that device/dtype/reduce op."""
        device_type = device.type if isinstance(device, torch.device) else torch.device(device).type
        op = {"isend": "send", "irecv": "recv"}.get(op, op)
        try:
            caps = self._dispatch.capabilities(device_type)
        except Exception:
            return False
        return caps.supports(op, dtype, as_reduce_op(reduce_op) if reduce_op is not None else None)

    def __repr__(self) -> str:
        backends = ", ".join(f"{d}: {n}" for d, n in self.backends.items())
        state = f" {self._closed}" if self._closed else ""
        return f"<ProcessGroup {self._name!r} rank {self._rank}/{self._size} backends={{{backends}}}{state}>"

    # -- execution --------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed is not None or self._closing:
            state = self._closed or "shutting down"
            raise GroupClosedError(f"group {self._name!r} is {state}; create a new group to communicate again")

    def _collective(
        self,
        op: str,
        tensors: Sequence[torch.Tensor],
        call: Callable[[Backend, float], Any],
        *,
        reduce_op: ReduceOp | None,
        dtype_check: bool,
        async_op: bool,
        timeout: float | timedelta | None,
        staging: _Staging | None = None,
    ) -> Work | None:
        """Validate, check capabilities, then run ``call(backend, timeout)`` in order."""
        self._check_open()
        device = _d.one_device(tensors, op) if tensors else self._barrier_device
        dtype = _d.same_dtype(tensors, op) if tensors and dtype_check else (tensors[0].dtype if tensors else None)
        self._dispatch.check(op, device.type, dtype, reduce_op)
        seconds = _seconds(timeout, self._timeout)

        def invoke(backend: Backend, seq: int) -> Any:
            if self._broken is not None:
                kind, reason = self._broken
                raise kind(
                    f"{op}: collectives of group {self._name!r} stopped after {reason}; ranks may be out of step, "
                    "so form the group again (point to point still works)"
                )
            try:
                result = call(backend, seconds)
            except (CollectiveTimeout, PeerFailureError, CollectiveMismatchError) as exc:
                if isinstance(exc, CollectiveTimeout):  # the backend knows the peers; the group knows op and seq
                    exc.op, exc.seq = op, seq
                # A failed collective may leave messages in flight: later collectives would read them.
                self._broken = (type(exc), f"{op} (collective #{seq}) failed: {exc}")
                raise
            if staging is not None:
                staging.finish()
            return result

        def run() -> Any:
            backend = self._dispatch.backend(device)
            seq = next(self._seq)
            if torch.is_grad_enabled():  # communication is not differentiable; skip the context when off
                with torch.no_grad():
                    return invoke(backend, seq)
            return invoke(backend, seq)

        if not async_op:
            if threading.current_thread() is self._worker:
                raise RuntimeError(
                    f"{op}: a blocking operation cannot run on group {self._name!r}'s progress thread (from a Work "
                    "callback); pass async_op=True there"
                )
            with self._lock:
                inline = self._pending == 0
            if inline:
                with self._exec_lock:
                    self._check_open()
                    run()
                return None
        work = Work(op)
        with self._lock:
            self._check_open()
            self._pending += 1
            if self._worker is None:
                self._worker = threading.Thread(
                    target=_work_loop, args=(self._queue, weakref.ref(self)), name=f"pg-core-{self._name}", daemon=True
                )
                self._worker.start()
            self._queue.put((work, run))
        if async_op:
            return work
        work.wait()
        return None

    def _run_queued(self, work: Work, fn: Callable[[], Any]) -> None:
        """Run one queued operation on the progress thread and complete its work."""
        try:
            with self._exec_lock:
                if self._closed is not None:
                    raise GroupClosedError(f"group {self._name!r} was {self._closed} before this operation ran")
                result = fn()
        except BaseException as exc:
            with self._lock:
                self._pending -= 1
            work.set_exception(exc)
        else:
            with self._lock:
                self._pending -= 1
            work.set_result(result)

    # -- collectives ------------------------------------------------------------
    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOp | RedOpType = ReduceOp.SUM,
        *,
        async_op: bool = False,
        timeout: float | timedelta | None = None,
    ) -> Work | None:
        """Reduce ``tensor`` across the group, in place, on every rank."""
        tensor = _d.check_tensor(tensor)
        rop = as_reduce_op(op)
        st = _Staging()
        t = st.output(tensor)
        return self._collective(
            "all_reduce",
            [tensor],
            lambda b, s: b.all_reduce(t, rop, timeout=s),
            reduce_op=rop,
            dtype_check=True,
            async_op=async_op,
            timeout=timeout,
            staging=st,
        )

    def broadcast(
        self, tensor: torch.Tensor, src: int, *, async_op: bool = False, timeout: float | timedelta | None = None
    ) -> Work | None:
        """Copy ``tensor`` of group rank ``src`` into ``tensor`` on every rank."""
        tensor = _d.check_tensor(tensor)
        _d.check_rank(src, self._size, "src")
        st = _Staging()
        t = st.output(tensor) if self._rank != src else st.input(tensor)
        return self._collective(
            "broadcast",
            [tensor],
            lambda b, s: b.broadcast(t, src, timeout=s),
            reduce_op=None,
            dtype_check=True,
            async_op=async_op,
            timeout=timeout,
            staging=st,
        )

    def reduce(
        self,
        tensor: torch.Tensor,
        dst: int,
        op: ReduceOp | RedOpType = ReduceOp.SUM,
        *,
        async_op: bool = False,
        timeout: float | timedelta | None = None,
    ) -> Work | None:
        """Reduce ``tensor`` across the group into ``tensor`` on ``dst``; others' tensors are unchanged."""
        tensor = _d.check_tensor(tensor)
        _d.check_rank(dst, self._size, "dst")
        rop = as_reduce_op(op)
        st = _Staging()
        t = st.output(tensor) if self._rank == dst else st.input(tensor)
        return self._collective(
            "reduce",
            [tensor],
            lambda b, s: b.reduce(t, dst, rop, timeout=s),
            reduce_op=rop,
            dtype_check=True,
            async_op=async_op,
            timeout=timeout,
            staging=st,
        )

    def all_gather(
        self,
        tensor_list: list[torch.Tensor],
        tensor: torch.Tensor,
        *,
        async_op: bool = False,
        timeout: float | timedelta | None = None,
    ) -> Work | None:
        """``tensor_list[i]`` receives rank ``i``'s ``tensor``."""
        tensor = _d.check_tensor(tensor)
        outs = _d.check_tensor_list(tensor_list, "tensor_list", self._size)
        _same_numel(outs, tensor.numel(), "all_gather", "tensor_list")
        st = _Staging()
        staged = [st.output(o) for o in outs]
        t = st.input(tensor)
        return self._collective(
            "all_gather",
            [tensor, *outs],
            lambda b, s: b.all_gather(staged, t, timeout=s),
            reduce_op=None,
            dtype_check=True,
            async_op=async_op,
            timeout=timeout,
            staging=st,
        )

    def all_gather_into_tensor(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        *,
        async_op: bool = False,
        timeout: float | timedelta | None = None,
    ) -> Work | None:
        """``output_tensor`` (``size`` times ``input_tensor``'s elements) receives every rank's input in rank order."""
        out = _d.check_tensor(output_tensor, "output_tensor")
        inp = _d.check_tensor(input_tensor, "input_tensor")
        if out.numel() != inp.numel() * self._size:
            raise ValueError(
                f"all_gather_into_tensor: output_tensor has {out.numel()} elements, expected "
                f"{self._size} x {inp.numel()} = {self._size * inp.numel()}"
            )
        st = _Staging()
        o, i = st.output(out), st.input(inp)
        return self._collective(
            "all_gather_into_tensor",
            [out, inp],
            lambda b, s: b.all_gather_into_tensor(o, i, timeout=s),
            reduce_op=None,
            dtype_check=True,
            async_op=async_op,
            timeout=timeout,
            staging=st,
        )

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input_list: list[torch.Tensor],
        op: ReduceOp | RedOpType = ReduceOp.SUM,
        *,
        async_op: bool = False,
        timeout: float | timedelta | None = None,
    ) -> Work | None:
        """``output`` on rank ``i`` receives the reduction of every rank's ``input_list[i]``."""
        out = _d.check_tensor(output, "output")
        ins = _d.check_tensor_list(input_list, "input_list", self._size)
        _same_numel(ins, out.numel(), "reduce_scatter", "input_list")
        rop = as_reduce_op(op)
        st = _Staging()
        o = st.output(out)
        staged = [st.input(t) for t in ins]
        return self._collective(
            "reduce_scatter",
            [out, *ins],
            lambda b, s: b.reduce_scatter(o, staged, rop, timeout=s),
            reduce_op=rop,
            dtype_check=True,
            async_op=async_op,
            timeout=timeout,
            staging=st,
        )

    def reduce_scatter_tensor(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: ReduceOp | RedOpType = ReduceOp.SUM,
        *,
        async_op: bool = False,
        timeout: float | timedelta | None = None,
    ) -> Work | None:
        """``output`` on rank ``i`` receives the reduction of block ``i`` of every rank's ``input``."""
        out = _d.check_tensor(output, "output")
        inp = _d.check_tensor(input, "input")
        if inp.numel() != out.numel() * self._size:
            raise ValueError(
                f"reduce_scatter_tensor: input has {inp.numel()} elements, expected "
                f"{self._size} x {out.numel()} = {self._size * out.numel()}"
            )
        rop = as_reduce_op(op)
        st = _Staging()
        o, i = st.output(out), st.input(inp)
        return self._collective(
            "reduce_scatter_tensor",
            [out, inp],
            lambda b, s: b.reduce_scatter_tensor(o, i, rop, timeout=s),
            reduce_op=rop,
            dtype_check=True,
            async_op=async_op,
            timeout=timeout,
            staging=st,
        )

    def all_to_all(
        self,
        output_tensor_list: list[torch.Tensor],
        input_tensor_list: list[torch.Tensor],
        *,
        async_op: bool = False,
        timeout: float | timedelta | None = None,
    ) -> Work | None:
        """``output_tensor_list[i]`` receives rank ``i``'s ``input_tensor_list[rank]``; sizes may differ per peer."""
        outs = _d.check_tensor_list(output_tensor_list, "output_tensor_list", self._size)
        ins = _d.check_tensor_list(input_tensor_list, "input_tensor_list", self._size)
        if outs[self._rank].numel() != ins[self._rank].numel():
            raise ValueError(
                f"all_to_all: output_tensor_list[{self._rank}] has {outs[self._rank].numel()} elements but "
                f"input_tensor_list[{self._rank}] (what this rank sends itself) has {ins[self._rank].numel()}"
            )
        st = _Staging()
        o = [st.output(t) for t in outs]
        i = [st.input(t) for t in ins]
        return self._collective(
            "all_to_all",
            [*outs, *ins],
            lambda b, s: b.all_to_all(o, i, timeout=s),
            reduce_op=None,
            dtype_check=True,
            async_op=async_op,
            timeout=timeout,
            staging=st,
        )

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int] | None = None,
        input_split_sizes: Sequence[int] | None = None,
        *,
        async_op: bool = False,
        timeout: float | timedelta | None = None,
    ) -> Work | None:
        """Split ``input`` along dim 0 (evenly, or by ``input_split_sizes``), send piece ``i`` to rank ``i``,
        and concatenate what arrives into ``output`` (by ``output_split_sizes``)."""
        out = _d.check_tensor(output, "output")
        inp = _d.check_tensor(input, "input")
        if out.dim() == 0 or inp.dim() == 0:
            raise ValueError("all_to_all_single: input and output need at least one dimension (splits are along dim 0)")
        if out.shape[1:] != inp.shape[1:]:
            raise ValueError(
                f"all_to_all_single: output shape {tuple(out.shape)} and input shape {tuple(inp.shape)} "
                "must agree beyond dim 0"
            )
        in_splits = _splits(input_split_sizes, inp.shape[0], self._size, "input")
        out_splits = _splits(output_split_sizes, out.shape[0], self._size, "output")
        if in_splits[self._rank] != out_splits[self._rank]:
            raise ValueError(
                f"all_to_all_single: this rank sends itself {in_splits[self._rank]} rows but expects "
                f"{out_splits[self._rank]}"
            )
        st = _Staging()
        o, i = st.output(out), st.input(inp)
        return self._collective(
            "all_to_all_single",
            [out, inp],
            lambda b, s: b.all_to_all_single(o, i, out_splits, in_splits, timeout=s),
            reduce_op=None,
            dtype_check=True,
            async_op=async_op,
            timeout=timeout,
            staging=st,
        )

    def gather(
        self,
        tensor: torch.Tensor,
        gather_list: list[torch.Tensor] | None = None,
        dst: int = 0,
        *,
        async_op: bool = False,
        timeout: float | timedelta | None = None,
    ) -> Work | None:
        """``gather_list[i]`` on ``dst`` receives rank ``i``'s ``tensor``; other ranks pass no list."""
        st = _Staging()
        tensor, staged, tensors = self._rooted("gather", tensor, gather_list, dst, st)
        t = st.input(tensor)
        return self._collective(
            "gather",
            tensors,
            lambda b, s: b.gather(t, staged, dst, timeout=s),
            reduce_op=None,
            dtype_check=True,
            async_op=async_op,
            timeout=timeout,
            staging=st,
        )

    def scatter(
        self,
        tensor: torch.Tensor,
        scatter_list: list[torch.Tensor] | None = None,
        src: int = 0,
        *,
        async_op: bool = False,
        timeout: float | timedelta | None = None,
    ) -> Work | None:
        """``tensor`` on rank ``i`` receives ``scatter_list[i]`` of ``src``; other ranks pass no list."""
        st = _Staging()
        tensor, staged, tensors = self._rooted("scatter", tensor, scatter_list, src, st)
        t = st.output(tensor)
        return self._collective(
            "scatter",
            tensors,
            lambda b, s: b.scatter(t, staged, src, timeout=s),
            reduce_op=None,
            dtype_check=True,
            async_op=async_op,
            timeout=timeout,
            staging=st,
        )

    def _rooted(
        self, op: str, tensor: object, lst: list[torch.Tensor] | None, root: int, st: _Staging
    ) -> tuple[torch.Tensor, list[torch.Tensor] | None, list[torch.Tensor]]:
        """Validate gather/scatter: the list exists on the root only, one tensor per rank,
        each with ``tensor``'s element count; stage it (outputs for gather, inputs for scatter)."""
        tensor = _d.check_tensor(tensor)
        role, what = ("destination", "dst") if op == "gather" else ("source", "src")
        _d.check_rank(root, self._size, what)
        name = f"{op}_list"
        if self._rank != root:
            if lst:
                raise ValueError(f"{op}: {name} is only passed on the {role} rank ({root})")
            return tensor, None, [tensor]
        if lst is None:
            raise ValueError(f"{op}: the {role} rank {root} must pass {name}")
        items = _d.check_tensor_list(lst, name, self._size)
        _same_numel(items, tensor.numel(), op, name)
        staged = [st.output(i) if op == "gather" else st.input(i) for i in items]
        return tensor, staged, [tensor, *items]

    def barrier(self, *, async_op: bool = False, timeout: float | timedelta | None = None) -> Work | None:
        """Return once every rank has entered the barrier (on the cpu backend if the group has one)."""
        return self._collective(
            "barrier",
            [],
            lambda b, s: b.barrier(timeout=s),
            reduce_op=None,
            dtype_check=False,
            async_op=async_op,
            timeout=timeout,
        )

    # -- point to point -----------------------------------------------------------
    def _p2p(
        self, kind: str, tensor: torch.Tensor, peer: int, tag: int, timeout: float | timedelta | None
    ) -> tuple[Backend, torch.Tensor, _Staging, float]:
        self._check_open()
        tensor = _d.check_tensor(tensor)
        what = "dst" if kind == "send" else "src"
        _d.check_rank(peer, self._size, what)
        if peer == self._rank:
            raise ValueError(f"{kind}: {what}={peer} is this rank; a rank cannot {kind} to itself")
        _d.check_tag(tag)
        self._dispatch.check(kind, tensor.device.type, tensor.dtype)
        st = _Staging()
        staged = st.input(tensor) if kind == "send" else st.output(tensor)
        return self._dispatch.backend(tensor.device), staged, st, _seconds(timeout, self._timeout)

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0, *, timeout: float | timedelta | None = None) -> None:
        """Send ``tensor`` to group rank ``dst``; returns once ``tensor`` may be reused."""
        backend, t, _, seconds = self._p2p("send", tensor, dst, tag, timeout)
        backend.send(t.detach(), dst, tag, timeout=seconds)

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0, *, timeout: float | timedelta | None = None) -> None:
        """Receive the next message from group rank ``src`` with ``tag`` into ``tensor``."""
        backend, t, st, seconds = self._p2p("recv", tensor, src, tag, timeout)
        backend.recv(t.detach(), src, tag, timeout=seconds)
        if st._back:
            with torch.no_grad():
                st.finish()

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0, *, timeout: float | timedelta | None = None) -> Work:
        """Start sending ``tensor`` to ``dst``; do not modify it until the ``Work`` completes."""
        backend, t, _, seconds = self._p2p("send", tensor, dst, tag, timeout)
        return backend.isend(t.detach(), dst, tag, timeout=seconds)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0, *, timeout: float | timedelta | None = None) -> Work:
        """Start receiving from ``src`` into ``tensor``; read it after the ``Work`` completes."""
        backend, t, st, seconds = self._p2p("recv", tensor, src, tag, timeout)
        inner = backend.irecv(t.detach(), src, tag, timeout=seconds)
        if t is tensor:
            return inner

        def copy_back() -> None:
            with torch.no_grad():
                st.finish()

        return _then(inner, copy_back)

    def batch_isend_irecv(self, p2p_op_list: Sequence[P2POp]) -> list[Work]:
        """Start every send and receive of the list; returns one ``Work`` per op, in order."""
        if not isinstance(p2p_op_list, (list, tuple)) or not p2p_op_list:
            raise ValueError("batch_isend_irecv takes a non-empty list of P2POp")
        kinds = []
        for p in p2p_op_list:
            if not isinstance(p, P2POp):
                raise TypeError(f"batch_isend_irecv takes P2POp items, got {type(p).__name__}")
            bound = getattr(p.op, "__self__", self)
            if bound is not self:
                raise ValueError("a P2POp's op belongs to another group; build it from this group's isend/irecv")
            kinds.append(p.kind)
            # validate everything before starting anything
            self._p2p("send" if p.kind == "isend" else "recv", p.tensor, p.peer, p.tag, None)
        works = []
        for p, kind in zip(p2p_op_list, kinds, strict=False):
            start = self.isend if kind == "isend" else self.irecv
            works.append(start(p.tensor, p.peer, p.tag))
        return works

    # -- life ----------------------------------------------------------------------
    def shutdown(self) -> None:
        """Finish queued operations (bounded by the group timeout), then release every
        backend, thread and socket. Further use raises :class:`GroupClosedError`."""
        with self._lock:
            if self._closed is not None or self._closing:
                return
            self._closing = True
            worker, self._worker = self._worker, None
            if worker is not None:
                self._queue.put(None)
        if worker is not None and worker is not threading.current_thread():
            worker.join(timeout=self._timeout)
        with self._lock:
            self._closed = "shut down"
        with self._exec_lock:
            errors = _close_all(self._dispatch.close(), "shutdown")
        if self._broken is not None or errors:
            # Only a group that failed marks its generation closed. After a clean shutdown,
            # members still joining (slower than this one, which needed nothing from them)
            # must find the generation, not skip it and wait alone in the next one.
            self._mark_generation_closed()
        if errors:
            raise errors[0]

    def abort(self) -> None:
        """Stop now: operations blocked in other threads raise, queued ones fail, every
        backend releases its resources. Further use raises :class:`GroupClosedError`."""
        with self._lock:
            if self._closed == "aborted":
                return
            self._closed = "aborted"
            worker, self._worker = self._worker, None
        _close_all(self._dispatch.close(), "abort")
        if worker is not None:
            self._queue.put(None)
            if worker is not threading.current_thread():
                worker.join(timeout=10.0)
        if worker is None or not worker.is_alive():
            while True:  # fail what never ran (the worker is gone; nothing else reads the queue)
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[0].set_exception(GroupClosedError(f"group {self._name!r} was aborted"))
        self._mark_generation_closed()

    def _mark_generation_closed(self) -> None:
        # Best effort: lets a later formation of this name skip a generation that never filled up.
        with contextlib.suppress(Exception):
            self._store.set("closed", "1")

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.shutdown()
        else:
            self.abort()

    def __del__(self) -> None:
        # A group dropped without shutdown() must not keep sockets and threads alive.
        with contextlib.suppress(Exception):
            if getattr(self, "_closed", "x") is None:
                self.abort()


def _work_loop(q: queue.SimpleQueue[tuple[Work, Callable[[], Any]] | None], ref: weakref.ref[ProcessGroup]) -> None:
    """The progress thread: runs queued operations in order. It holds the group only
    weakly between operations, so a group dropped without shutdown() is collected."""
    while True:
        item = q.get()
        if item is None:
            return
        work, fn = item
        del item  # nothing may keep the group (fn's closure) alive while waiting for the next item
        group = ref()
        if group is None:
            work.set_exception(GroupClosedError("the group was garbage-collected before this operation ran"))
        else:
            group._run_queued(work, fn)
        del group, work, fn


def _then(inner: Work, fn: Callable[[], None]) -> Work:
    def drive(_: Work, timeout: float) -> None:
        inner._wait_done(timeout)

    outer = Work(inner.op, driver=drive)

    def done(w: Work) -> None:
        exc = w._exc
        if exc is None:
            try:
                fn()
            except BaseException as e:
                exc = e
        if exc is None:
            outer.set_result(w._result)
        else:
            outer.set_exception(exc)

    inner.add_done_callback(done)
    return outer


def _close_all(backends: list[Backend], how: str) -> list[BaseException]:
    errors: list[BaseException] = []
    for backend in backends:
        try:
            getattr(backend, how)()
        except BaseException as exc:
            errors.append(exc)
        finally:
            backend._stop_helpers()
    return errors


def _same_numel(tensors: Sequence[torch.Tensor], numel: int, op: str, what: str) -> None:
    for i, t in enumerate(tensors):
        if t.numel() != numel:
            raise ValueError(f"{op}: {what}[{i}] has {t.numel()} elements, expected {numel}")


def _splits(sizes: Sequence[int] | None, rows: int, size: int, what: str) -> list[int]:
    if sizes is None or len(sizes) == 0:
        if rows % size:
            raise ValueError(
                f"all_to_all_single: {what} has {rows} rows, not divisible by the group size {size}; "
                f"pass {what}_split_sizes"
            )
        return [rows // size] * size
    out = list(sizes)
    if len(out) != size:
        raise ValueError(f"all_to_all_single: {what}_split_sizes has {len(out)} entries, expected {size}")
    for s in out:
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise ValueError(f"all_to_all_single: {what}_split_sizes must be non-negative ints, got {out}")
    if sum(out) != rows:
        raise ValueError(f"all_to_all_single: {what}_split_sizes sum to {sum(out)} but {what} has {rows} rows")
    return out


def _rank_and_size(rank: int | None, size: int | None) -> tuple[int, int]:
    if rank is None or size is None:
        env_rank = os.environ.get("PG_RANK", os.environ.get("RANK"))
        env_size = os.environ.get("PG_WORLD_SIZE", os.environ.get("WORLD_SIZE"))
        if env_rank is None or env_size is None:
            raise ValueError(
                "rank and size are required outside a launcher (pgrun/torchrun set PG_RANK/RANK and "
                "PG_WORLD_SIZE/WORLD_SIZE)"
            )
        rank = int(env_rank) if rank is None else rank
        size = int(env_size) if size is None else size
    for value, what in ((rank, "rank"), (size, "size")):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{what} must be an int, got {value!r}")
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    if not 0 <= rank < size:
        raise ValueError(f"rank={rank} is out of range for size={size}")
    return rank, size


def _join(store: Store, name: str, rank: int, size: int) -> int:
    """Claim ``rank`` in the current generation of group ``name``; return the generation.

    Each generation admits exactly ``size`` members (first come); the last one to
    join opens the next generation, so forming the same name again later (after
    a shutdown, or by survivors of a failure) never meets stale keys.
    """
    base = f"{_STORE_PREFIX}/{name}"
    generation = int(store.add(f"{base}/generation", 0))
    for _ in range(1 << 16):
        # a generation some member closed (it never filled: a member died before joining) is skipped
        if not store.check([f"{base}/{generation}/closed"]):
            joined = int(store.add(f"{base}/{generation}/joined", 1))
            if joined <= size:
                break
        generation += 1
    else:  # pragma: no cover - needs 65536 concurrent formations of one name
        raise RuntimeError(f"could not join group {name!r}")
    gen = f"{base}/{generation}"
    if joined == size:
        store.add(f"{base}/generation", 1)
    token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex}"
    claimed = store.compare_set(f"{gen}/rank/{rank}", "", token).decode()
    if claimed != token:
        raise ValueError(
            f"group {name!r} (generation {generation}) already has a rank {rank} ({claimed}); each member must "
            "pass a distinct rank, and two groups alive at once need distinct names"
        )
    sizes = store.compare_set(f"{gen}/size", "", str(size)).decode()
    if sizes != str(size):
        raise ValueError(f"group {name!r}: other members passed size={sizes}, this one size={size}")
    return generation
