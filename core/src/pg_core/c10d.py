"""``C10dBackend``: the base of backends that wrap a torch C++ backend (``ProcessGroupGloo``,
``ProcessGroupNCCL``, a vendor's ``c10d::Backend``).

Every collective is the torch backend's own call, with the call's timeout in its options,
waited for in the calling thread; torch's ``RuntimeError`` goes through the subclass's
:meth:`C10dBackend._error` into pg-core's errors. A subclass builds the torch object in its
constructor, after ``super().__init__(ctx)``, from :meth:`C10dBackend.rendezvous` (the
group's store as a torch backend must see it), and assigns it to ``self._pg``;
``shutdown``/``abort`` call the torch object's own. It overrides what its library does differently (pg-gloo: dtypes moved as
bytes, ``reduce`` off the root on a copy, uneven ``all_to_all``).

``c10d`` is also what ``ProcessGroup.to_torch()`` registers on a torch ``ProcessGroup``, so
torch-side calls (DDP's) reach that very object with no Python in between.

Coalescing (API 1.3) is the torch backend's own: :meth:`C10dBackend.coalesced` posts a batch's
calls between its ``_start_coalescing()`` and ``_end_coalescing()`` (ProcessGroupNCCL: one
``ncclGroupStart``/``ncclGroupEnd``), and ``coalesces`` is what the torch backend says of
itself (``supports_coalescing``): ProcessGroupGloo says no, so pg-gloo's batches run one call
after another.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Final

import torch
import torch._C._distributed_c10d as c10d
import torch.distributed as dist

from .backend import Backend, BackendContext, Call
from .errors import PeerFailureError
from .ops import RedOpType, ReduceOp
from .store import PolledStore, PrefixStore
from .work import Work, all_of

__all__ = ["REDUCE_OPS", "C10dBackend", "first_line", "flat_bytes", "timeout_delta", "torch_reduce_op"]

#: pg-core's reduce ops as torch's (``PREMUL_SUM`` carries a factor: see :func:`torch_reduce_op`).
REDUCE_OPS: Final[dict[RedOpType, Any]] = {
    RedOpType.SUM: dist.ReduceOp.SUM,
    RedOpType.PRODUCT: dist.ReduceOp.PRODUCT,
    RedOpType.MIN: dist.ReduceOp.MIN,
    RedOpType.MAX: dist.ReduceOp.MAX,
    RedOpType.AVG: dist.ReduceOp.AVG,
    RedOpType.BAND: dist.ReduceOp.BAND,
    RedOpType.BOR: dist.ReduceOp.BOR,
    RedOpType.BXOR: dist.ReduceOp.BXOR,
}


#: How long closing a backend lets go of the GIL. A torch worker thread (ProcessGroupGloo's
#: run loop) drops a finished work under its queue's mutex, and a work launched with Python
#: objects in its thread-local state (DDP's, from autograd hooks) needs the GIL for that; the
#: torch object's destructor joins those threads while holding the GIL. So if the last
#: reference goes (say, with a DDP reducer) while a worker is still waiting for the GIL, which
#: it does after a last collective when the caller then runs under 5 ms of Python without
#: letting go, the process deadlocks (seen in tests/integration/test_to_torch.py under load;
#: torch 2.13). Closing lets go of the GIL once, so such a worker finishes first.
_GIL_HANDOFF_S: Final[float] = 0.01


def torch_reduce_op(op: ReduceOp) -> Any:
    """``op`` as torch's ``ReduceOp`` (``PREMUL_SUM`` through torch's factory for it)."""
    if op.type is RedOpType.PREMUL_SUM:
        return dist._make_nccl_premul_sum(op.factor)  # type: ignore[arg-type]  # a complex factor too
    return REDUCE_OPS[op.type]


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A dense tensor's memory as a 1-D ``uint8`` view."""
    return t.reshape(-1).view(torch.uint8)


_OPTIONS: Final[dict[str, Any]] = {
    "allreduce": c10d.AllreduceOptions,
    "broadcast": c10d.BroadcastOptions,
    "reduce": c10d.ReduceOptions,
    "allgather": c10d.AllgatherOptions,
    "reduce_scatter": c10d.ReduceScatterOptions,
    "alltoall": c10d.AllToAllOptions,
    "gather": c10d.GatherOptions,
    "scatter": c10d.ScatterOptions,
    "barrier": c10d.BarrierOptions,
}


def timeout_delta(timeout: float) -> timedelta:
    """Seconds as the ``timedelta`` torch's options and waits take (at least 1 ms: torch reads
    zero as "no timeout")."""
    return timedelta(seconds=max(timeout, 0.001))


def first_line(exc: BaseException) -> str:
    """The first line of a torch error's message (the rest is C++ context), or its type's name."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class C10dBackend(Backend):
    """A pg-core backend whose operations are a torch C++ backend's (see the module docstring)."""

    #: collectives launch with ``async_op=True`` (API 1.2): torch's work becomes the user's
    launches = True
    #: torch's work completes on the host (Gloo); ``False`` for stream-ordered backends (NCCL)
    host_completion = True

    #: dtypes the torch backend cannot move: the copying collectives (broadcast, the gathers,
    #: scatters and all-to-alls) hand it their bytes instead, which is exact
    as_bytes: frozenset[torch.dtype] = frozenset()

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        #: the torch backend object, set by the subclass's constructor; None once closed
        self._pg: Any = None
        #: torch's options objects by (kind, timeout, reduce op, root): see :meth:`_opts`
        self._options_cache: dict[tuple[Any, ...], Any] = {}
        self._rendezvous: PolledStore | None = None
        #: the torch object's ``supports_coalescing``, once read (see :attr:`coalesces`)
        self._coalesces: bool | None = None
        #: held while a call is posted, and through a whole coalesced launch: torch's coalescing
        #: state belongs to the object, so another thread's call must not land inside a batch
        self._posting = threading.Lock()
        #: (thread, the batch's work) while that thread runs :meth:`coalesced`
        self._batch: tuple[int, Work] | None = None

    def rendezvous(self, what: str) -> PolledStore:
        """The store to build the torch object from: the group's, under this backend's name,
        seen through :class:`~pg_core.store.PolledStore` (its waits never block the client
        other groups share). The backend keeps it as long as itself: a C++ backend calls back
        into this Python object after construction (NCCL at its first collective, to share
        its unique id), and torch fails with ``PythonStore::set ... Not implemented`` once the
        Python object behind a store is gone."""
        ctx = self.ctx
        self._rendezvous = PolledStore(
            PrefixStore(ctx.backend_name, ctx.store), ctx.timeout, f"group {ctx.group_name!r}: {what}"
        )
        return self._rendezvous

    @property
    def coalesces(self) -> bool:  # type: ignore[override]  # read from the torch object, which subclasses build
        """Whether :meth:`coalesced` launches a batch as one: the torch backend's own
        ``supports_coalescing`` (ProcessGroupNCCL: yes; ProcessGroupGloo, torch 2.13: no, and
        its ``_start_coalescing`` raises). Read once from the torch object, not on every call."""
        known = self._coalesces
        if known is None:
            pg = self._pg
            if pg is None:
                return False
            known = self._coalesces = bool(pg.supports_coalescing)
        return known

    def coalesced(self, calls: Sequence[Call]) -> Work:
        """Post every call (each method's torch call, not waited for) between the torch
        backend's ``_start_coalescing()`` and ``_end_coalescing()``, which launches them as one
        (NCCL: one group call); torch's one work completes the batch. The works the methods
        return inside the batch complete with it."""
        pg = self._ready("coalesced")
        timeout = max(call.timeout for call in calls)
        launched: list[Work] = []

        def drive(_: Work, budget: float) -> None:
            if not launched:  # the batch is not launched yet
                return
            if budget <= 0:
                launched[0].is_completed()  # torch's one work: poll it
            else:
                launched[0].wait_until_done(budget)

        batch = Work("coalesced", driver=drive)
        with self._posting:
            self._batch = (threading.get_ident(), batch)
            try:
                pg._start_coalescing()
                try:
                    results = [getattr(self, call.op)(*call.args, timeout=call.timeout) for call in calls]
                finally:
                    torch_work = pg._end_coalescing()  # also after a failure: torch's state must close
            except RuntimeError as exc:
                raise self._error(exc, "coalesced", timeout) from exc
            finally:
                self._batch = None
        work = (
            Work.completed("coalesced") if torch_work is None else self._launched(torch_work, "coalesced", timeout, ())
        )
        launched.append(work)

        def finished(w: Work) -> None:
            exc = w.exception(0)
            if exc is None:
                batch.set_result(None)
            else:
                batch.set_exception(exc)

        work.add_done_callback(finished)
        return all_of("coalesced", [batch, *(r for r in results if isinstance(r, Work))])

    @property
    def c10d(self) -> Any:
        """The torch backend object (what ``ProcessGroup.to_torch()`` registers)."""
        pg = self._pg
        if pg is None:
            raise PeerFailureError(f"backend {self.ctx.backend_name!r} of group {self.ctx.group_name!r} is closed")
        return pg

    def shutdown(self) -> None:
        self._close("shutdown")

    def abort(self) -> None:
        self._close("abort")

    def _close(self, how: str) -> None:
        """The torch object's ``shutdown`` or ``abort``, once; then the GIL is let go for a
        moment (see :data:`_GIL_HANDOFF_S`)."""
        pg, self._pg = self._pg, None
        if pg is not None:
            getattr(pg, how)()
            time.sleep(_GIL_HANDOFF_S)

    def _ready(self, what: str, peers: Sequence[int] = ()) -> Any:
        """The torch object, or the error this backend's state calls for, before anything is sent."""
        return self.c10d

    def _error(self, exc: BaseException, what: str, timeout: float, peers: Sequence[int] = ()) -> BaseException:
        """Torch's error as pg-core's; the default returns it unchanged."""
        return exc

    def _movable(self, t: torch.Tensor) -> torch.Tensor:
        """What a copying collective hands the torch backend for ``t``: ``t`` itself, or for a
        dtype in :attr:`as_bytes` a view of its bytes with the same dim 0 (split sizes still
        count rows)."""
        if t.dtype not in self.as_bytes:
            return t
        if t.dim() == 0:
            t = t.reshape(1)
        return t.reshape(t.shape[0], math.prod(t.shape[1:])).view(torch.uint8)

    def _flat(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as one flat run of elements (of bytes for a dtype in :attr:`as_bytes`)."""
        return flat_bytes(t) if t.dtype in self.as_bytes else t.reshape(-1)

    def _wait(
        self,
        post: Callable[[], Any],
        what: str,
        timeout: float,
        peers: Sequence[int] = (),
        *,
        bounded: bool = False,
        async_op: bool = False,
    ) -> Work | None:
        """Post an operation (``post()`` returns the torch backend's work) and wait for it, in
        pg-core's errors; with ``async_op``, return a :class:`~pg_core.work.Work` for it instead
        (no thread: whoever waits on it, or polls it, drives torch's work). Inside this thread's
        :meth:`coalesced`, only posts it and returns the batch's work."""
        batch = self._batch
        if batch is not None and batch[0] == threading.get_ident():
            try:
                post()  # into torch's open batch; its one work covers this call
            except RuntimeError as exc:
                raise self._error(exc, what, timeout, peers) from exc
            return batch[1]
        try:
            if self.coalesces:  # a batch may be posting on another thread: keep out of it
                with self._posting:
                    work = post()
            else:
                work = post()
            if async_op:
                return self._launched(work, what, timeout, peers)
        except RuntimeError as exc:
            raise self._error(exc, what, timeout, peers) from exc
        self._await(work, what, timeout, peers, bounded=bounded)
        return None

    def _await(self, work: Any, what: str, timeout: float, peers: Sequence[int], *, bounded: bool) -> None:
        """Wait for the torch work of a blocking call that :meth:`_wait` posted, in pg-core's
        errors. A subclass that waits its own way overrides this alone (pg-gloo waits in slices)."""
        try:
            if bounded:  # point to point: the work's wait takes the bound (a collective carries it in its options)
                work.wait(timeout_delta(timeout))
            else:
                work.wait()
        except RuntimeError as exc:
            raise self._error(exc, what, timeout, peers) from exc

    def _launched(self, torch_work: Any, what: str, timeout: float, peers: Sequence[int]) -> Work:
        """Torch's work as ours, with no thread of our own. Where the operation completes on the
        host (:attr:`host_completion`: Gloo's worker threads), torch's future tells an event, and
        ``wait(timeout)`` waits for that event at most ``timeout``; otherwise (a CUDA backend)
        ``wait()`` is torch's ``Work.wait()``: the caller's current stream waits, the host does not."""
        done: threading.Event | None = None
        if self.host_completion:
            try:
                future = torch_work.get_future()
            except RuntimeError:  # a work without a future: is_completed(), and wait() in full (see pg-gloo)
                future = None
            if future is not None:
                done = threading.Event()
                future.add_done_callback(lambda _future: done.set())

        def drive(work: Work, budget: float) -> None:
            if done is not None:
                if not done.wait(max(budget, 0.0)):
                    return
            elif budget <= 0 and not torch_work.is_completed():
                return
            try:
                torch_work.wait()
            except RuntimeError as exc:
                work.set_exception(self._error(exc, what, timeout, peers))
            else:
                work.set_result(None)

        return Work(what, driver=drive)

    def _opts(self, kind: str, timeout: float, op: ReduceOp | None = None, root: int | None = None) -> Any:
        """Torch's options object for one call, made once per (kind, timeout, reduce op, root) and
        reused: the torch backend reads it when the call is posted (building one costs about
        1.5 us, a fifth of this wrapper's cost per call)."""
        key = (kind, timeout, None if op is None else op.type, root)
        cache = self._options_cache
        opts = cache.get(key)
        if opts is None:
            opts = _OPTIONS[kind]()
            if op is not None:
                opts.reduceOp = torch_reduce_op(op)
            if root is not None:
                opts.rootRank = root
                if kind in ("broadcast", "reduce"):
                    opts.rootTensor = 0
            opts.timeout = timeout_delta(timeout)
            if op is None or op.type is not RedOpType.PREMUL_SUM:  # a factor is not part of the key
                if len(cache) >= 512:
                    cache.clear()
                cache[key] = opts
        return opts

    # -- collectives: the torch backend's own ------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, *, timeout: float, async_op: bool = False) -> Work | None:
        pg = self._ready("all_reduce")
        opts = self._opts("allreduce", timeout, op=op)
        return self._wait(lambda: pg.allreduce([tensor], opts), "all_reduce", timeout, async_op=async_op)

    def prepared_all_reduce(
        self, dtype: torch.dtype, op: ReduceOp, *, timeout: float
    ) -> Callable[[torch.Tensor], None] | None:
        """:meth:`all_reduce` for blocking calls, its options built once: the torch call, its wait
        and :meth:`_error`, nothing else (about a microsecond of Python over the raw torch call).
        ``None`` where that would skip something: a subclass's own ``all_reduce``, a backend that
        coalesces (its posts take a lock), ``PREMUL_SUM`` (a factor per call)."""
        if (
            type(self).all_reduce is not C10dBackend.all_reduce
            or self.coalesces
            or op.type is RedOpType.PREMUL_SUM
            or self._pg is None
        ):
            return None
        opts = self._opts("allreduce", timeout, op=op)
        ready, error = self._ready, self._error

        def run(tensor: torch.Tensor) -> None:
            pg = ready("all_reduce")
            try:
                pg.allreduce([tensor], opts).wait()
            except RuntimeError as exc:
                raise error(exc, "all_reduce", timeout) from exc

        return run

    def broadcast(self, tensor: torch.Tensor, src: int, *, timeout: float, async_op: bool = False) -> Work | None:
        pg = self._ready("broadcast")
        opts = self._opts("broadcast", timeout, root=src)
        return self._wait(lambda: pg.broadcast([self._movable(tensor)], opts), "broadcast", timeout, async_op=async_op)

    def reduce(
        self, tensor: torch.Tensor, dst: int, op: ReduceOp, *, timeout: float, async_op: bool = False
    ) -> Work | None:
        pg = self._ready("reduce")
        opts = self._opts("reduce", timeout, op=op, root=dst)
        return self._wait(lambda: pg.reduce([tensor], opts), "reduce", timeout, async_op=async_op)

    def all_gather(
        self, output_list: list[torch.Tensor], tensor: torch.Tensor, *, timeout: float, async_op: bool = False
    ) -> Work | None:
        pg = self._ready("all_gather")
        opts = self._opts("allgather", timeout)
        outs = [self._movable(t) for t in output_list]
        return self._wait(
            lambda: pg.allgather([outs], [self._movable(tensor)], opts), "all_gather", timeout, async_op=async_op
        )

    def all_gather_into_tensor(
        self, output: torch.Tensor, input: torch.Tensor, *, timeout: float, async_op: bool = False
    ) -> Work | None:
        pg = self._ready("all_gather_into_tensor")
        opts = self._opts("allgather", timeout)
        # flat: torch's backends want the output in rows shaped like the input, the core allows (size, *shape) too
        out, inp = self._flat(output), self._flat(input)
        return self._wait(
            lambda: pg._allgather_base(out, inp, opts), "all_gather_into_tensor", timeout, async_op=async_op
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
        pg = self._ready("reduce_scatter")
        opts = self._opts("reduce_scatter", timeout, op=op)
        return self._wait(
            lambda: pg.reduce_scatter([output], [input_list], opts), "reduce_scatter", timeout, async_op=async_op
        )

    def reduce_scatter_tensor(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp, *, timeout: float, async_op: bool = False
    ) -> Work | None:
        pg = self._ready("reduce_scatter_tensor")
        opts = self._opts("reduce_scatter", timeout, op=op)
        return self._wait(
            lambda: pg._reduce_scatter_base(output.reshape(-1), input.reshape(-1), opts),
            "reduce_scatter_tensor",
            timeout,
            async_op=async_op,
        )

    def all_to_all(
        self, output_list: list[torch.Tensor], input_list: list[torch.Tensor], *, timeout: float, async_op: bool = False
    ) -> Work | None:
        pg = self._ready("all_to_all")
        opts = self._opts("alltoall", timeout)
        outs = [self._flat(t) for t in output_list]
        ins = [self._flat(t) for t in input_list]
        return self._wait(lambda: pg.alltoall(outs, ins, opts), "all_to_all", timeout, async_op=async_op)

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
        pg = self._ready("all_to_all_single")
        opts = self._opts("alltoall", timeout)
        out, inp = self._movable(output), self._movable(input)
        out_splits, in_splits = list(output_split_sizes), list(input_split_sizes)
        return self._wait(
            lambda: pg.alltoall_base(out, inp, out_splits, in_splits, opts),
            "all_to_all_single",
            timeout,
            async_op=async_op,
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
        pg = self._ready("gather")
        opts = self._opts("gather", timeout, root=dst)
        outs = [[self._movable(t) for t in gather_list]] if gather_list is not None else []
        return self._wait(lambda: pg.gather(outs, [self._movable(tensor)], opts), "gather", timeout, async_op=async_op)

    def scatter(
        self,
        tensor: torch.Tensor,
        scatter_list: list[torch.Tensor] | None,
        src: int,
        *,
        timeout: float,
        async_op: bool = False,
    ) -> Work | None:
        pg = self._ready("scatter")
        opts = self._opts("scatter", timeout, root=src)
        ins = [[self._movable(t) for t in scatter_list]] if scatter_list is not None else []
        return self._wait(lambda: pg.scatter([self._movable(tensor)], ins, opts), "scatter", timeout, async_op=async_op)

    def barrier(self, *, timeout: float, async_op: bool = False) -> Work | None:
        pg = self._ready("barrier")
        opts = self._opts("barrier", timeout)
        return self._wait(lambda: pg.barrier(opts), "barrier", timeout, async_op=async_op)
