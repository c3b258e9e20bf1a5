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
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch

from . import dispatch as _d
from . import messages
from .backend import _Streams
from .dispatch import BackendsArg, Dispatcher
from .errors import CollectiveMismatchError, CollectiveTimeout, GroupClosedError, PeerFailureError, PGError
from .membership import ROOT_NAMESPACE, Membership, check_name, join, wait_until_full
from .ops import RedOpType, ReduceOp, as_reduce_op
from .store import PrefixStore, Store
from .work import Work

if TYPE_CHECKING:
    from .backend import Backend
    from .registry import Registry

__all__ = ["DEFAULT_TIMEOUT", "P2POp", "ProcessGroup"]

#: Default per-operation timeout in seconds.
DEFAULT_TIMEOUT = 300.0


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


class _Staging:
    """Contiguous stand-ins for non-contiguous tensors, and the copies back."""

    __slots__ = ("_back",)

    def __init__(self) -> None:
        self._back: list[tuple[torch.Tensor, torch.Tensor]] = []

    def input(self, t: torch.Tensor) -> torch.Tensor:
        return t if _d.dense(t) else t.clone(memory_format=torch.contiguous_format)

    def output(self, t: torch.Tensor) -> torch.Tensor:
        if _d.dense(t):
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
        check_name(name)
        seconds = _seconds(timeout, DEFAULT_TIMEOUT)
        membership = join(store, ROOT_NAMESPACE, name, rank, size)
        self._setup(
            store,
            membership,
            name=name,
            uid=f"{name}#{membership.generation}",
            backends=backends,
            timeout=seconds,
            options=options or {},
            registry=registry,
        )

    @classmethod
    def _formed(
        cls,
        store: Store,
        membership: Membership,
        *,
        name: str,
        uid: str,
        backends: BackendsArg,
        timeout: float,
        options: Mapping[str, Mapping[str, Any]],
        registry: Registry | None,
        parent_ranks: tuple[int, ...] | None = None,
    ) -> ProcessGroup:
        """A group for a place already taken in the store (rendezvous, subgroups)."""
        group = cls.__new__(cls)
        group._setup(
            store,
            membership,
            name=name,
            uid=uid,
            backends=backends,
            timeout=timeout,
            options=options,
            registry=registry,
            parent_ranks=parent_ranks,
        )
        return group

    def _setup(
        self,
        store: Store,
        membership: Membership,
        *,
        name: str,
        uid: str,
        backends: BackendsArg,
        timeout: float,
        options: Mapping[str, Mapping[str, Any]],
        registry: Registry | None,
        parent_ranks: tuple[int, ...] | None = None,
    ) -> None:
        self._rank, self._size, self._name = membership.rank, membership.size, name
        self._timeout = timeout
        self._closed: str | None = None
        self._closing = False  # shutdown() started: no new operations, queued ones drain
        self._broken: tuple[type[PGError], str] | None = None  # a collective failed: later ones refuse
        self._lock = threading.Lock()  # guards _queue/_pending/_worker/_closed/_subgroups
        self._exec_lock = threading.Lock()  # held while a collective runs
        self._pending = 0
        self._queue: queue.SimpleQueue[tuple[Work, Callable[[], Any]] | None] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._seq = itertools.count(1)
        self._current_seq = 0  # of the collective running now (collectives run one at a time)
        self._membership = membership
        self._uid = uid
        self._root_store = store
        self._store = PrefixStore(membership.prefix, store)
        self._options, self._registry = options, registry
        self._parent_ranks = parent_ranks
        self._subgroups: dict[tuple[int, ...], int] = {}  # new_group(ranks) calls so far, per ranks
        self._splits = 0
        self._endpoint: messages.Endpoint | None = None
        self._endpoint_lock = threading.Lock()
        self._helpers = _Streams(f"pg-core-{name}-msg", f"group {name!r}")  # asynchronous object/tensor messages
        self._dispatch = Dispatcher(
            backends,
            registry=registry,
            store=self._store,
            rank=self._rank,
            size=self._size,
            timeout=self._timeout,
            group_name=name,
            group_uid=self._uid,
            options=options,
        )
        # where barrier (an op without tensors) and messages go: the cpu backend, else the first configured one
        names = self._dispatch.names
        self._barrier_device = torch.device("cpu" if "cpu" in names or not names else next(iter(names)))
        # tensors on these device types travel on their own backend, after a message that describes them
        self._separate_devices = frozenset(d for d in names if d != "cpu")

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
    def parent_ranks(self) -> tuple[int, ...] | None:
        """For a subgroup (``new_group``, ``split``): ``parent_ranks[i]`` is the rank in the
        parent group of this group's rank ``i``. ``None`` for a group formed on its own."""
        return self._parent_ranks

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
        checked: bool = False,
    ) -> Any:
        """Validate, check capabilities (unless ``checked``), then run ``call(backend, timeout)``
        in order. Blocking: returns what ``call`` returned; ``async_op``: a ``Work`` whose
        ``result()`` it is."""
        self._check_open()
        device = _d.one_device(tensors, op) if tensors else self._barrier_device
        dtype = _d.same_dtype(tensors, op) if tensors and dtype_check else (tensors[0].dtype if tensors else None)
        if not checked:
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
            seq = self._current_seq = next(self._seq)
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
                    return run()
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
        return work.result()

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
        queued = backend._queued("send", dst, tag)
        if queued is not None:  # an isend to (dst, tag) is still queued: this send goes behind it
            queued.submit("send", lambda: backend.send(t.detach(), dst, tag, timeout=seconds)).wait()
            return
        backend.send(t.detach(), dst, tag, timeout=seconds)

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0, *, timeout: float | timedelta | None = None) -> None:
        """Receive the next message from group rank ``src`` with ``tag`` into ``tensor``."""
        backend, t, st, seconds = self._p2p("recv", tensor, src, tag, timeout)
        queued = backend._queued("recv", src, tag)
        if queued is not None:  # an irecv from (src, tag) is still queued: this recv matches after it
            queued.submit("recv", lambda: backend.recv(t.detach(), src, tag, timeout=seconds)).wait()
        else:
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

    # -- objects and tensors the receiver knows nothing about ------------------------------
    #
    # Layers over the backend contract, written once here (see pg_core.messages): one
    # message per value where the backend carries variable-size messages, the eager
    # emulation otherwise; tensors ride in the message without a copy.

    def send_object(
        self, obj: Any, dst: int, *, tag: int = 0, async_op: bool = False, timeout: float | timedelta | None = None
    ) -> Work | None:
        """Send a picklable ``obj`` to group rank ``dst`` (pickle protocol 5; tensors and
        buffers inside it travel out of band, not copied into the pickle stream).

        Trusted peers only: the receiver unpickles what arrives. Object messages have their
        own tags, apart from tensor ``send``/``recv``. With ``async_op`` the object is encoded
        now; its tensors are read as the message goes, so leave them alone until the ``Work``
        completes.
        """
        return self._send_value(
            "send_object", messages.OBJECT, obj, dst=dst, tag=tag, async_op=async_op, timeout=timeout
        )

    def recv_object(
        self, src: int, *, tag: int = 0, async_op: bool = False, timeout: float | timedelta | None = None
    ) -> Any:
        """Receive the next object (or tensor, or tensor dict) that ``src`` sent with ``tag``."""
        return self._recv_value("recv_object", None, src=src, tag=tag, device=None, async_op=async_op, timeout=timeout)

    def send_tensor(
        self,
        tensor: torch.Tensor,
        dst: int,
        *,
        tag: int = 0,
        async_op: bool = False,
        timeout: float | timedelta | None = None,
    ) -> Work | None:
        """Send ``tensor`` to a receiver that does not know its shape or dtype
        (:meth:`recv_tensor`). Shape, dtype and data travel in one message where the
        backend can carry one; see :mod:`pg_core.messages`."""
        tensor = _d.check_tensor(tensor)
        return self._send_value(
            "send_tensor", messages.TENSOR, tensor, dst=dst, tag=tag, async_op=async_op, timeout=timeout
        )

    def recv_tensor(
        self,
        src: int,
        device: str | torch.device | None = None,
        *,
        tag: int = 0,
        async_op: bool = False,
        timeout: float | timedelta | None = None,
    ) -> Any:
        """Receive a tensor sent with :meth:`send_tensor`, with the sender's shape and dtype,
        on ``device`` (default: the sender's device type; a CPU tensor is a view into the
        received message, not a copy)."""
        return self._recv_value(
            "recv_tensor", messages.TENSOR, src=src, tag=tag, device=device, async_op=async_op, timeout=timeout
        )

    def send_tensor_dict(
        self,
        tensor_dict: Mapping[Any, Any],
        dst: int,
        *,
        tag: int = 0,
        async_op: bool = False,
        timeout: float | timedelta | None = None,
    ) -> Work | None:
        """Send a dict of tensors and plain values, nested as deep as needed (a kv-cache
        transfer's metadata and blocks), in one message; tensors on a device with a backend
        of their own (``cuda``) follow on that backend, described by the message."""
        _check_dict(tensor_dict, "send_tensor_dict")
        return self._send_value(
            "send_tensor_dict", messages.TENSOR_DICT, tensor_dict, dst=dst, tag=tag, async_op=async_op, timeout=timeout
        )

    def recv_tensor_dict(
        self,
        src: int,
        device: str | torch.device | None = None,
        *,
        tag: int = 0,
        async_op: bool = False,
        timeout: float | timedelta | None = None,
    ) -> Any:
        """Receive a dict sent with :meth:`send_tensor_dict`; its tensors on ``device``
        (default: each tensor's sender device type)."""
        return self._recv_value(
            "recv_tensor_dict",
            messages.TENSOR_DICT,
            src=src,
            tag=tag,
            device=device,
            async_op=async_op,
            timeout=timeout,
        )

    def broadcast_object(
        self, obj: Any, src: int = 0, *, async_op: bool = False, timeout: float | timedelta | None = None
    ) -> Any:
        """Every rank returns ``src``'s ``obj`` (other ranks pass anything, usually ``None``).
        ``src`` gets its own object back; the others a copy, decoded from one message that
        travelled down a binomial tree."""
        _d.check_rank(src, self._size, "src")
        out = messages.encode(messages.OBJECT, obj) if self._rank == src else None
        return self._message_collective(
            "broadcast_object",
            lambda seconds: self._broadcast_value("broadcast_object", obj, out, src=src, device=None, seconds=seconds),
            async_op,
            timeout,
        )

    def broadcast_tensor_dict(
        self,
        tensor_dict: Mapping[Any, Any] | None = None,
        src: int = 0,
        *,
        device: str | torch.device | None = None,
        async_op: bool = False,
        timeout: float | timedelta | None = None,
    ) -> Any:
        """Every rank returns ``src``'s dict of tensors and plain values; other ranks pass
        ``None``. Where the message backend carries variable-size messages, CPU tensors ride
        in the one message; tensors on another device follow as that device backend's
        ``broadcast``."""
        _d.check_rank(src, self._size, "src")
        if self._rank == src:
            _check_dict(tensor_dict, "broadcast_tensor_dict")
            out = messages.encode(messages.TENSOR_DICT, tensor_dict, separate_devices=self._separate_devices)
            self._check_separate(out, "broadcast")
        elif tensor_dict is not None:
            raise ValueError(f"broadcast_tensor_dict: tensor_dict is only passed on the source rank ({src})")
        else:
            out = None
        where = _device_arg(device)
        return self._message_collective(
            "broadcast_tensor_dict",
            lambda seconds: self._broadcast_value(
                "broadcast_tensor_dict", tensor_dict, out, src=src, device=where, seconds=seconds
            ),
            async_op,
            timeout,
        )

    def all_gather_object(self, obj: Any, *, async_op: bool = False, timeout: float | timedelta | None = None) -> Any:
        """A list of every rank's ``obj``, in rank order (copies, this rank's included)."""
        out = messages.encode(messages.OBJECT, obj)

        def call(seconds: float) -> list[Any]:
            op, tag = "all_gather_object", messages.COLLECTIVE_MESSAGE_TAG
            deadline, ep, parts = self._collective_message(op, out, seconds)
            n, me = self._size, self._rank
            for i in range(1, n):
                ep.send(parts, (me + i) % n, tag, deadline)
            values: list[Any] = [None] * n
            for i in range(1, n):
                peer = (me - i) % n
                values[peer] = self._collective_value(op, ep.recv(peer, tag, deadline), peer)
            values[me] = _copy(parts, me)
            return values

        return self._message_collective("all_gather_object", call, async_op, timeout)

    def gather_object(
        self, obj: Any, dst: int = 0, *, async_op: bool = False, timeout: float | timedelta | None = None
    ) -> Any:
        """On ``dst``: a list of every rank's ``obj`` in rank order (copies); elsewhere ``None``."""
        _d.check_rank(dst, self._size, "dst")
        out = messages.encode(messages.OBJECT, obj)

        def call(seconds: float) -> list[Any] | None:
            op, tag = "gather_object", messages.COLLECTIVE_MESSAGE_TAG
            deadline, ep, parts = self._collective_message(op, out, seconds)
            if self._rank != dst:
                ep.send(parts, dst, tag, deadline)
                return None
            values: list[Any] = [None] * self._size
            for peer in range(self._size):
                if peer != dst:
                    values[peer] = self._collective_value(op, ep.recv(peer, tag, deadline), peer)
            values[dst] = _copy(parts, dst)
            return values

        return self._message_collective("gather_object", call, async_op, timeout)

    def scatter_object(
        self,
        objs: Sequence[Any] | None,
        src: int = 0,
        *,
        async_op: bool = False,
        timeout: float | timedelta | None = None,
    ) -> Any:
        """Rank ``i`` returns ``objs[i]`` of ``src`` (a copy); ``objs`` is a list of one
        object per rank on ``src`` and ``None`` elsewhere."""
        _d.check_rank(src, self._size, "src")
        outs: list[messages.Encoded] = []
        if self._rank == src:
            if not isinstance(objs, (list, tuple)):
                raise TypeError(f"scatter_object: objs must be a list on the source rank, got {type(objs).__name__}")
            if len(objs) != self._size:
                raise ValueError(f"scatter_object: objs must have one object per rank ({self._size}), got {len(objs)}")
            outs = [messages.encode(messages.OBJECT, o) for o in objs]
        elif objs is not None:
            raise ValueError(f"scatter_object: objs is only passed on the source rank ({src})")

        def call(seconds: float) -> Any:
            op, tag = "scatter_object", messages.COLLECTIVE_MESSAGE_TAG
            if self._rank != src:
                deadline, ep, _ = self._collective_message(op, None, seconds)
                return self._collective_value(op, ep.recv(src, tag, deadline), src)
            code, seq = _MESSAGE_OPS[op], self._current_seq
            deadline, ep, _ = self._collective_message(op, None, seconds)
            for peer in range(self._size):
                if peer != src:
                    ep.send(outs[peer].parts(op=code, seq=seq), peer, tag, deadline)
            return _copy(outs[src].parts(op=code, seq=seq), src)

        return self._message_collective("scatter_object", call, async_op, timeout)

    # -- how messages move -------------------------------------------------------------------
    def _message_endpoint(self) -> messages.Endpoint:
        """The group's message device backend, as a message endpoint (created on first use)."""
        ep = self._endpoint
        if ep is None:
            with self._endpoint_lock:
                ep = self._endpoint
                if ep is None:
                    backend = self._dispatch.backend(self._barrier_device)
                    api = self._dispatch.spec(self._barrier_device.type).api_version
                    ep = self._endpoint = messages.Endpoint(
                        backend, self._barrier_device, scatter_gather=_api_at_least(api, 1, 1)
                    )
        return ep

    def _check_messages(self, direction: str) -> messages.Endpoint:
        """Messages need the message device backend's ``send``/``recv`` (of ``uint8`` where
        they are emulated on tensors). Creates that backend if this is its first use."""
        ep = self._message_endpoint()
        if direction not in ep.checked:
            self._dispatch.check(direction, ep.device.type, None if ep.native else torch.uint8)
            ep.checked.add(direction)
        return ep

    def _check_separate(self, out: messages.Encoded, op: str) -> None:
        for t in out.separate:
            self._dispatch.check(op, t.device.type, t.dtype)

    def _send_value(
        self,
        op: str,
        kind: int,
        value: Any,
        *,
        dst: int,
        tag: int,
        async_op: bool,
        timeout: float | timedelta | None,
    ) -> Work | None:
        self._check_open()
        _d.check_rank(dst, self._size, "dst")
        if dst == self._rank:
            raise ValueError(f"{op}: dst={dst} is this rank; a rank cannot send to itself")
        _d.check_tag(tag)
        seconds = _seconds(timeout, self._timeout)
        ep = self._check_messages("send")
        out = messages.encode(kind, value, separate_devices=self._separate_devices)
        self._check_separate(out, "send")
        wire = messages.message_tag(tag)

        queued = None if async_op else self._helpers.queued("send", dst, tag)
        if async_op or queued is not None:  # queued: behind this stream's asynchronous messages
            work = (queued or self._helpers.get("send", dst, tag)).submit(
                op, lambda: self._send_now(op, ep, out, dst=dst, wire=wire, seconds=seconds)
            )
            return work if async_op else work.result()
        self._send_now(op, ep, out, dst=dst, wire=wire, seconds=seconds)
        return None

    def _send_now(
        self, op: str, ep: messages.Endpoint, out: messages.Encoded, *, dst: int, wire: int, seconds: float
    ) -> None:
        self._check_open()
        try:
            if ep.native and not out.separate:  # one send_bytes: atomic, needs no stream lock
                ep.send_one(out.parts(), dst, wire, seconds, op)
                return
            deadline = messages.Deadline(op, seconds)
            with ep.stream("send", dst, wire, op) as progress:
                ep.send(out.parts(), dst, wire, deadline, progress)
                for t in out.separate:
                    self._dispatch.backend(t.device).send(t, dst, wire, timeout=deadline.left())
        except CollectiveTimeout as exc:
            exc.op = op  # the user's operation, not the backend's send_bytes
            raise

    def _recv_value(
        self,
        op: str,
        kind: int | None,
        *,
        src: int,
        tag: int,
        device: str | torch.device | None,
        async_op: bool,
        timeout: float | timedelta | None,
    ) -> Any:
        self._check_open()
        _d.check_rank(src, self._size, "src")
        if src == self._rank:
            raise ValueError(f"{op}: src={src} is this rank; a rank cannot receive from itself")
        _d.check_tag(tag)
        where = _device_arg(device)
        seconds = _seconds(timeout, self._timeout)
        ep = self._check_messages("recv")
        wire = messages.message_tag(tag)

        def run() -> Any:
            self._check_open()
            try:
                if ep.native and not self._separate_devices:  # every message is one recv_bytes
                    data = ep.recv_one(src, wire, seconds, op)
                    if kind == messages.TENSOR and (tensor := messages.parse_tensor(data)) is not None:
                        return tensor if where is None or where == tensor.device else tensor.to(where)
                    incoming, separate = messages.parse(data, src=src), {}
                else:
                    deadline = messages.Deadline(op, seconds)
                    with ep.stream("recv", src, wire, op) as progress:
                        data = ep.recv(src, wire, deadline, progress)
                        incoming = messages.parse(data, src=src)
                        separate = self._recv_separate(incoming, src, wire, deadline)
            except CollectiveTimeout as exc:
                exc.op = op  # the user's operation, not the backend's recv_bytes
                raise
            if kind is not None and incoming.kind != kind:
                raise CollectiveMismatchError(
                    f"{op}: rank {src} sent {messages.KIND_NAMES.get(incoming.kind, 'an unknown message')} with "
                    f"tag {tag}, where this rank expected {messages.KIND_NAMES[kind]}",
                    peers=(src,),
                )
            return incoming.value(separate, where)

        if async_op:
            return self._helpers.get("recv", src, tag).submit(op, run)
        queued = self._helpers.queued("recv", src, tag)
        if queued is not None:  # behind this stream's asynchronous receives: they match first
            return queued.submit(op, run).result()
        return run()

    def _recv_separate(
        self, incoming: messages.Incoming, src: int, tag: int, deadline: messages.Deadline
    ) -> dict[int, torch.Tensor]:
        """Receive the tensors that followed a message on their own device backends."""
        separate = {}
        for index, spec in incoming.separate_specs():
            device = self._dispatch.device(spec.device)
            tensor = torch.empty(spec.shape, dtype=spec.dtype, device=device)
            self._dispatch.backend(device).recv(tensor, src, tag, timeout=deadline.left())
            separate[index] = tensor
        return separate

    def _message_collective(
        self, op: str, call: Callable[[float], Any], async_op: bool, timeout: float | timedelta | None
    ) -> Any:
        self._check_messages("send")
        self._check_messages("recv")
        return self._collective(
            op,
            [],
            lambda _backend, seconds: call(seconds),
            reduce_op=None,
            dtype_check=False,
            async_op=async_op,
            timeout=timeout,
            checked=True,
        )

    def _collective_message(
        self, op: str, out: messages.Encoded | None, seconds: float
    ) -> tuple[messages.Deadline, messages.Endpoint, list[messages.Buffer]]:
        """Inside a message collective: its deadline, the endpoint, and ``out`` stamped with
        the collective's op and sequence number (the receivers check them)."""
        parts = [] if out is None else out.parts(op=_MESSAGE_OPS[op], seq=self._current_seq)
        return messages.Deadline(op, seconds), self._message_endpoint(), parts

    def _collective_value(self, op: str, data: messages.Received, src: int) -> Any:
        incoming = messages.parse(data, src=src)
        messages.check_collective(
            incoming, op=_MESSAGE_OPS[op], seq=self._current_seq, src=src, what=op, names=_MESSAGE_OP_NAMES
        )
        return incoming.value({}, None)

    def _broadcast_value(
        self,
        op: str,
        value: Any,
        out: messages.Encoded | None,
        *,
        src: int,
        device: torch.device | None,
        seconds: float,
    ) -> Any:
        deadline, ep, parts = self._collective_message(op, out, seconds)
        tag = messages.COLLECTIVE_MESSAGE_TAG
        got = messages.tree_broadcast(
            parts if self._rank == src else None,
            rank=self._rank,
            size=self._size,
            src=src,
            send=lambda p, peer: ep.send(p, peer, tag, deadline),
            recv=lambda peer: ep.recv(peer, tag, deadline),
        )
        if out is not None:  # the source: its tensors on other devices follow, broadcast by their backends
            for t in out.separate:
                self._dispatch.backend(t.device).broadcast(t, src, timeout=deadline.left())
            return value
        data = got[0]
        assert not isinstance(data, (bytes, memoryview))  # received, not this rank's own parts
        incoming = messages.parse(data, src=src)
        messages.check_collective(
            incoming, op=_MESSAGE_OPS[op], seq=self._current_seq, src=src, what=op, names=_MESSAGE_OP_NAMES
        )
        separate = {}
        for index, spec in incoming.separate_specs():
            target = self._dispatch.device(spec.device)
            self._dispatch.check("broadcast", target.type, spec.dtype)
            tensor = torch.empty(spec.shape, dtype=spec.dtype, device=target)
            self._dispatch.backend(target).broadcast(tensor, src, timeout=deadline.left())
            separate[index] = tensor
        return incoming.value(separate, device)

    # -- subgroups ------------------------------------------------------------------------------
    def new_group(
        self,
        ranks: Sequence[int],
        name: str | None = None,
        backends: BackendsArg = None,
        *,
        timeout: float | timedelta | None = None,
        options: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> ProcessGroup:
        """A group of the ranks ``ranks`` of this group; called by those members only
        (the others never call it). This rank's rank in it is its index in ``ranks``.

        ``backends``, ``timeout`` and ``options`` default to this group's. The subgroup
        lives in this group's store namespace: the same ``ranks`` (or ``name``) formed
        again, while the first is alive or after it shut down, is a new formation.
        Members must call ``new_group`` for the same ``ranks`` in the same order.
        """
        self._check_open()
        members = _check_members(ranks, self._size)
        if self._rank not in members:
            raise ValueError(f"new_group: rank {self._rank} is not in ranks {members}; only the members call new_group")
        if name is None:
            with self._lock:
                count = self._subgroups.get(tuple(members), 0)
                self._subgroups[tuple(members)] = count + 1
            key = "[" + ",".join(map(str, members)) + "]" + (f"#{count}" if count else "")
            display = f"{self._name}{key}"
        else:
            key = display = check_name(name, "new_group name")
        return self._subgroup(key, display, members, backends=backends, timeout=timeout, options=options)

    def split(
        self,
        color: int | None,
        key: int = 0,
        *,
        name: str | None = None,
        backends: BackendsArg = None,
        timeout: float | timedelta | None = None,
        options: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> ProcessGroup | None:
        """Collective over this group, with ``MPI_Comm_split`` semantics: ranks passing the
        same ``color`` (an int ``>= 0``) form one subgroup, ranked by ``key`` and then by
        their rank here; ``color=None`` joins none and returns ``None``."""
        self._check_open()
        if color is not None and (isinstance(color, bool) or not isinstance(color, int) or color < 0):
            raise ValueError(f"split: color must be an int >= 0 or None, got {color!r}")
        if isinstance(key, bool) or not isinstance(key, int):
            raise TypeError(f"split: key must be an int, got {key!r}")
        if name is not None:
            check_name(name, "split name")
        with self._lock:
            number = self._splits
            self._splits += 1
        chosen = self.all_gather_object((color, key), timeout=timeout)
        if color is None:
            return None
        members = [r for _, r in sorted((k, r) for r, (c, k) in enumerate(chosen) if c == color)]
        store_key = f"split{number}.{color}"
        display = name or f"{self._name}.{store_key}"
        return self._subgroup(store_key, display, members, backends=backends, timeout=timeout, options=options)

    def _subgroup(
        self,
        key: str,
        display: str,
        members: list[int],
        *,
        backends: BackendsArg,
        timeout: float | timedelta | None,
        options: Mapping[str, Mapping[str, Any]] | None,
    ) -> ProcessGroup:
        seconds = _seconds(timeout, self._timeout)
        config: BackendsArg = self._dispatch.config() if backends is None else backends
        membership = join(
            self._root_store, f"{self._membership.prefix}/groups", key, members.index(self._rank), len(members)
        )
        return ProcessGroup._formed(
            self._root_store,
            membership,
            name=display,
            uid=f"{self._uid}/{key}#{membership.generation}",
            backends=config,
            timeout=seconds,
            options=self._options if options is None else options,
            registry=self._registry,
            parent_ranks=tuple(members),
        )

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
        self._helpers.stop()  # the threads of asynchronous messages (their backends are closed: nothing blocks)
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
        self._helpers.stop()
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


# -- module-level helpers of the message and subgroup methods ----------------------------------

#: The message collectives, as their messages name them (appended to, never renumbered).
_MESSAGE_OPS: dict[str, int] = {
    name: i + 1
    for i, name in enumerate(
        ("broadcast_object", "all_gather_object", "gather_object", "scatter_object", "broadcast_tensor_dict")
    )
}
_MESSAGE_OP_NAMES = {code: name for name, code in _MESSAGE_OPS.items()}


def _api_at_least(version: str, major: int, minor: int) -> bool:
    try:
        got = tuple(int(x) for x in version.split(".")[:2])
    except ValueError:
        return False
    return got >= (major, minor)


def _check_dict(value: object, op: str) -> None:
    if not isinstance(value, Mapping):
        raise TypeError(f"{op}: expected a dict of tensors and values, got {type(value).__name__}")


def _device_arg(device: str | torch.device | None) -> torch.device | None:
    if device is None:
        return None
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
    try:
        return torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"device={device!r} is not a device: {exc}") from None


def _copy(parts: Sequence[messages.Buffer], rank: int) -> Any:
    """What this rank's own message decodes to: the copy its peers get."""
    return messages.parse(bytearray().join(parts), src=rank).value({}, None)


def _check_members(ranks: object, size: int) -> list[int]:
    if not isinstance(ranks, (list, tuple, range)):
        raise TypeError(f"new_group: ranks must be a list of group ranks, got {type(ranks).__name__}")
    members = [_d.check_rank(r, size, "new_group rank") for r in ranks]
    if not members:
        raise ValueError("new_group: ranks is empty")
    if len(set(members)) != len(members):
        raise ValueError(f"new_group: ranks {members} lists a rank twice")
    return members


def rendezvous(
    store: Store,
    name: str,
    size: int,
    *,
    backends: BackendsArg = None,
    timeout: float | timedelta | None = None,
    options: Mapping[str, Mapping[str, Any]] | None = None,
    registry: Registry | None = None,
) -> ProcessGroup:
    """Form group ``name`` of ``size`` processes that know nothing of each other but the
    store; ranks are given in arrival order. Returns once all ``size`` have arrived and the
    group's message backend is connected, so any operation (point to point included) may
    come first.

    The processes need no common parent group: a decode worker started later joins by
    calling this with the name its peers use. A process that arrives after the group is
    full waits for the *next* formation of the name (its next ``size`` arrivals) and, if
    nobody comes, fails at ``timeout`` with :class:`~pg_core.errors.CollectiveTimeout` saying
    so; a rendezvous that times out closes its generation, so the others waiting in it
    fail at once with :class:`~pg_core.errors.PeerFailureError` instead of at their own
    timeouts. Do not mix ``rendezvous`` and ``ProcessGroup(store, rank, size, name=...)``
    on one name.
    """
    check_name(name)
    if isinstance(size, bool) or not isinstance(size, int):
        raise TypeError(f"size must be an int, got {size!r}")
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    seconds = _seconds(timeout, DEFAULT_TIMEOUT)
    # resolve the backends before taking a place: a wrong name fails here, not in the others' wait
    Dispatcher(
        backends,
        registry=registry,
        store=store,
        rank=0,
        size=size,
        timeout=seconds,
        group_name=name,
        group_uid="",
        options=options or {},
    )
    membership = join(store, ROOT_NAMESPACE, name, None, size)
    wait_until_full(store, membership, seconds, f"rendezvous {name!r}")
    group = ProcessGroup._formed(
        store,
        membership,
        name=name,
        uid=f"{name}#{membership.generation}",
        backends=backends,
        timeout=seconds,
        options=options or {},
        registry=registry,
    )
    try:
        group._message_endpoint()  # connect now: every member is here
    except BaseException:
        group.abort()
        raise
    return group
