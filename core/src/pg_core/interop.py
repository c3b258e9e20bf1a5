"""``ProcessGroup.to_torch()``: one of our groups as a ``torch.distributed.ProcessGroup``, for
``DistributedDataParallel(model, process_group=...)`` and the ``torch.distributed`` calls that
take ``group=``, with no ``init_process_group`` (``torch.distributed.is_initialized()`` stays
False) and nothing registered in torch's global tables (for that, see :mod:`pg_core.torch_world`).

Two shapes, chosen per group:

* **Native.** Where every backend of the group wraps a torch C++ backend
  (:class:`pg_core.c10d.C10dBackend`: pg-gloo, pg-nccl), torch's ``ProcessGroup`` gets those
  very objects registered per device type (``_register_backend``). Torch-side calls (DDP's
  bucketed all-reduces) then go straight to Gloo or NCCL with no Python in between, and share
  the group's connections and communicators.
* **Adapter.** Otherwise, a ``ProcessGroup`` subclass whose methods call the group's own
  (asynchronous where torch's ``opts.asyncOp`` asks, as DDP's calls do), so they keep the group's order, sequence numbers, validation and
  failure handling; a tensor on a device whose backend is native goes to that backend's torch
  object directly. Torch completes its futures without being asked (DDP waits on them, and
  chains ``then`` callbacks on them, but never waits on the work); a pg-core work that
  completes only while someone drives it (pg-mpi's: ``MPI_Test``) is driven by the adapter's
  own thread, which runs while any is pending (:class:`_Driver`), so its future completes, or
  fails with the operation's timeout, with nobody calling ``wait``.

Either shape is what torch expects of a process group:

* **A name.** ``tg.group_name`` is ``pg_core:<uid>``, the formation's uid (unique across
  jobs, hosts, re-formed subgroups and ``shrink()``), alike on every member: what torch's
  registry and its functional collectives resolve a group by. Torch keeps a group's name on
  its backends; the adapter has none, so it answers torch's C++ ``getGroupName`` itself.
* **Every collective** of torch's ``ProcessGroup`` (a test compares the adapter with torch's
  binding), ``allgather_coalesced`` and ``monitored_barrier`` included. Torch's C++ reaches
  the Python methods it has a trampoline for (``PyProcessGroup``); its Python layer, all.
* **Autograd.** The adapter hands the group its tensors detached (:func:`_d`): torch's
  functional collectives return the very tensor they post, and autograd gives it a
  ``grad_fn`` after the call returned, while the group may still be writing it.
* **Life.** Torch's ``destroy_process_group(tg)`` calls ``shutdown()`` on a group in its
  tables: the adapter's lets go of torch's view and leaves the pg-core group running (the
  user ends it with ``group.shutdown()``); on a group in none of torch's tables torch itself
  raises ``ValueError: Invalid process group specified`` before it touches anything. Torch's
  ``abort()`` (``_abort_process_group``) likewise leaves the group to ``group.abort()``.

What needs torch's global tables works once the group is in them, which this module never
does itself: ``group.to_torch(register=True)``, ``group.torch_registered()`` and
``group.as_torch_default()`` (:mod:`pg_core.torch_world`) put it there for as long as asked.
Unregistered, these fail: ``torch.distributed.get_rank(group)`` (use ``group.rank`` or
``torch_group.rank()``), the ``src=``/``dst=`` forms that take *global* ranks (use
``group_src=``/``group_dst=``, torch >= 2.6), functional collectives (they resolve groups by
registered name), and FSDP2 / DeviceMesh (``group.device_mesh()`` registers the group).

Torch's own errors for those come before any call reaches the group, from its global tables:
``dist.broadcast(t, src=0, group=g)`` raises ``ValueError: Group <g> is not registered, please
create group with torch.distributed.new_group API``, and ``dist.get_rank(g)`` ``Default process
group has not been initialized``. Of those, only the group's ``repr`` is pg-core's to write:
the adapter's says what to do (``group_src=``/``group_dst=``, or the group's own methods). A
native group is torch's ``ProcessGroup`` itself, whose ``repr`` torch writes; making it a
Python subclass would put a Python lookup, under the GIL, in front of every call DDP makes.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Final

import torch
import torch._C._distributed_c10d as c10d
import torch.distributed as dist

from .c10d import C10dBackend
from .ops import ReduceOp, as_reduce_op
from .work import Work, all_of

if TYPE_CHECKING:
    from .group import ProcessGroup

__all__ = ["to_torch"]

#: torch's backend types for the torch C++ backends pg-core's plugins wrap
_TYPES = {"gloo": "GLOO", "nccl": "NCCL", "mpi": "MPI", "ucc": "UCC", "xccl": "XCCL"}


def to_torch(group: ProcessGroup) -> dist.ProcessGroup:
    """``group`` as a torch ``ProcessGroup`` (see the module docstring). Collective for a group
    with native backends: their instances are created now, on every rank. A device type whose
    backend cannot run here (nccl on a machine without a GPU) is left out, as the group leaves
    it out until its first use."""
    natives = {}
    usable = [device_type for device_type in group.backends if group.supports_device(device_type)]
    for device_type in usable:
        backend = group.form_backend(device_type, "to_torch")
        if isinstance(backend, C10dBackend):
            natives[device_type] = backend
    if len(natives) == len(usable):
        pg = dist.ProcessGroup(group.rank, group.size)  # type: ignore[call-arg]
        for device_type, backend in natives.items():
            kind = getattr(dist.ProcessGroup.BackendType, _TYPES.get(backend.ctx.backend_name, "CUSTOM"))
            pg._register_backend(torch.device(device_type), kind, backend.c10d)
        first = natives.get("cpu") or next(iter(natives.values()))
        pg._set_default_backend(getattr(dist.ProcessGroup.BackendType, _TYPES.get(first.ctx.backend_name, "CUSTOM")))
    else:
        pg = _Adapter(group, {d: b.c10d for d, b in natives.items()})
    pg._set_group_name(f"pg_core:{group.uid}")  # type: ignore[arg-type]
    return pg


def _timeout(opts: Any) -> float | None:
    """The call's timeout from torch's options, if it set one."""
    value = getattr(opts, "timeout", None)
    if isinstance(value, timedelta) and value.total_seconds() > 0:
        return value.total_seconds()
    return None


def _async(opts: Any) -> bool:
    """Whether torch asked for an asynchronous call (``opts.asyncOp``: ``torch.distributed``'s
    functions set it from their ``async_op``; DDP leaves it True). A blocking one runs in the
    caller's thread, as the group's blocking calls do, and returns a completed work."""
    return bool(getattr(opts, "asyncOp", True))


def _d(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` outside autograd, sharing its memory: what the adapter hands the group. Torch's
    functional collectives (``_c10d_functional.all_reduce``) post the very tensor they return,
    and autograd gives it a ``grad_fn`` after the call returned, while the group may still be
    writing it; the group would then see a tensor that requires grad (and refuse ``out=``).
    A sparse tensor is handed as it is: its sum is written by replacing its indices and values,
    which a detached alias would take for itself."""
    return tensor if tensor.layout is torch.sparse_coo else tensor.detach()


def _ds(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """:func:`_d` of each."""
    return [t.detach() for t in tensors]


def _reduce_op(opts: Any) -> ReduceOp:
    """Torch's reduce op as ours (its factor of ``PREMUL_SUM`` is not readable from Python)."""
    kind = getattr(opts.reduceOp, "op", opts.reduceOp)  # torch's ReduceOp wraps its RedOpType
    if getattr(kind, "name", None) == "PREMUL_SUM":
        raise NotImplementedError("PREMUL_SUM through to_torch(): call group.all_reduce(t, ReduceOp.premul_sum(f))")
    return as_reduce_op(opts.reduceOp)


#: What torch's ``monitored_barrier(timedelta(0))`` waits: no time (pg-core's timeouts are positive)
_AT_ONCE_S: Final = 0.001
#: How long the adapter's driving thread drives its oldest pending work before it polls the
#: others once (a receive that waits on a later message must not hold up their futures).
_DRIVE_SLICE_S: Final = 0.05
#: How long the driving thread stays once nothing is pending, for the next step's works, before
#: it ends (a training loop posts its next works well within it; an idle group keeps no thread).
_DRIVER_IDLE_S: Final = 0.5


class _Driver:
    """Drives the pending works of one adapter that complete only while someone drives them
    (a :class:`~pg_core.work.Work` with a driver: pg-mpi's, which progress in ``MPI_Test``),
    from a thread of its own that runs while any is pending, so that their torch futures
    complete without anyone waiting on the work. The oldest is driven first, as a wait would
    (its backend's own polling and timeout), the others polled between its slices."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._cond = threading.Condition(threading.Lock())
        self._pending: list[Work] = []
        self._running = False

    def add(self, work: Work) -> None:
        """Drive ``work`` until it completes (its failures, timeouts included, complete it too)."""
        with self._cond:
            self._pending.append(work)
            if self._running:
                self._cond.notify()
                return
            self._running = True
        threading.Thread(target=self._run, name=f"pg-core driver of torch group {self._name!r}", daemon=True).start()

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._pending:
                    self._cond.wait(_DRIVER_IDLE_S)
                if not self._pending:
                    self._running = False
                    return
                pending = list(self._pending)
            for i, work in enumerate(pending):
                try:
                    if i == 0:
                        work.wait_until_done(_DRIVE_SLICE_S)
                    else:
                        work.is_completed()
                except BaseException as exc:  # a driver must not raise; if one does, its work fails with it
                    work.set_exception(exc)
            with self._cond:
                self._pending = [w for w in self._pending if not w.done]


class _TorchWork(c10d.Work):
    """Our :class:`~pg_core.work.Work` as torch's: ``wait`` re-raises its error, and
    ``get_future`` completes with ``value`` when it does (as torch's do for DDP's hooks), the
    work driven by ``driver`` where it completes only while driven."""

    def __init__(
        self, work: Work | None, value: Any, *, driver: _Driver | None = None, source: int | None = None
    ) -> None:
        super().__init__()
        self._work = work
        self._source = source  # a receive's sender, where it was named
        self._future: torch.futures.Future[Any] = torch.futures.Future()
        future = self._future

        def done(w: Work) -> None:
            exc = w.exception(0)
            if exc is None:
                future.set_result(value)
            else:
                future.set_exception(exc)

        if work is None:
            future.set_result(value)
        else:
            work.add_done_callback(done)
            if driver is not None and work.driven and not work.done:
                driver.add(work)

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self._work is not None:
            seconds = (
                timeout.total_seconds() if isinstance(timeout, timedelta) and timeout.total_seconds() > 0 else None
            )
            self._work.wait(seconds)
        return True

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()

    def is_success(self) -> bool:
        return self.is_completed() and (self._work is None or self._work.exception(0) is None)

    def exception(self) -> Any:
        return None if self._work is None else self._work.exception(0)

    def get_future(self) -> torch.futures.Future[Any]:
        return self._future

    def result(self) -> list[torch.Tensor]:
        self.wait()
        value = self._future.value()
        return value if isinstance(value, list) else []

    def _source_rank(self) -> int:
        """The sender's group rank, for a receive (``torch.distributed.irecv(t, group=...)``
        without ``src`` reads it here: the result of the group's receive from any source)."""
        sender = self._source if self._source is not None or self._work is None else self._work.result()
        if not isinstance(sender, int):
            raise RuntimeError(f"{self._work!r} is not a receive: it has no source rank")
        return sender


class _Adapter(dist.ProcessGroup):
    """A torch ``ProcessGroup`` whose operations are the pg-core group's (see the module
    docstring). Holds the group weakly: it never keeps a dropped group alive."""

    def __init__(self, group: ProcessGroup, natives: dict[str, Any]) -> None:
        super().__init__(group.rank, group.size)  # type: ignore[call-arg]
        self._group_ref = weakref.ref(group)
        self._natives = natives
        self._native_groups: dict[int, dist.ProcessGroup] = {}
        self._name = f"pg_core:{group.uid}"
        self._driver = _Driver(self._name)
        self._repr = (
            f"<pg-core group {group.name!r} (rank {group.rank} of {group.size}) as a torch ProcessGroup: for the "
            "global src=/dst= torch reads its global tables, where only group.to_torch(register=True) puts it; "
            "or give its ranks as group_src=/group_dst= (torch >= 2.6), or call the pg-core group's own method "
            "(group.broadcast(t, src), group.send(t, dst))>"
        )

    def __repr__(self) -> str:
        """Says what to do, where torch names this group in its errors: torch translates the global
        ranks of ``src=``/``dst=`` through its default group's tables, which hold no pg-core group,
        and raises ``Group <this> is not registered, please create group with ... new_group``."""
        return self._repr

    def _work(self, work: Work | None, value: Any, *, source: int | None = None) -> _TorchWork:
        """``work`` as torch's, its future completing with ``value``."""
        return _TorchWork(work, value, driver=self._driver, source=source)

    @property
    def _g(self) -> ProcessGroup:
        group = self._group_ref()
        if group is None:
            raise RuntimeError(f"the pg-core group behind torch group {self._name!r} is gone")
        return group

    def _native(self, tensors: list[torch.Tensor]) -> Any:
        return self._natives.get(tensors[0].device.type) if tensors else None

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return "pg_core"

    def getGroupName(self) -> str:  # noqa: N802 - torch's name
        """The name torch knows this group by (``tg.group_name``, its registry, functional
        collectives): torch's own ``ProcessGroup`` keeps it on its backends, and the adapter has
        none, so it answers torch's C++ ``getGroupName`` itself."""
        return self._name

    def setGroupName(self, name: str) -> None:  # noqa: N802 - torch's name
        self._name = name

    def shutdown(self) -> None:
        """What torch's ``destroy_process_group(tg)`` calls on a group in its tables: it lets go of
        torch's view, and the pg-core group goes on (its owner ends it with ``group.shutdown()``),
        so nothing of the user's stops by surprise."""

    def abort(self) -> None:
        """What torch's ``_abort_process_group(tg)`` calls, before it deletes the group from its
        tables: as :meth:`shutdown`, the pg-core group goes on (``group.abort()`` aborts it).
        Aborting it from here would also undo a registration under torch's feet, and torch's
        deletions that follow would fail on the entries already gone."""

    def size(self) -> int:
        return self._g.size

    def rank(self) -> int:
        return self._g.rank

    # -- collectives ----------------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> c10d.Work:  # type: ignore[override]
        opts = opts or c10d.AllreduceOptions()
        native = self._native(tensors)
        if native is not None:
            return native.allreduce(tensors, opts)
        op = _reduce_op(opts)
        works = [self._g.all_reduce(_d(t), op, async_op=_async(opts), timeout=_timeout(opts)) for t in tensors]
        return self._work(works[-1] if works else None, tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> c10d.Work:  # type: ignore[override]
        opts = opts or c10d.BroadcastOptions()
        native = self._native(tensors)
        if native is not None:
            return native.broadcast(tensors, opts)
        works = [
            self._g.broadcast(_d(t), opts.rootRank, async_op=_async(opts), timeout=_timeout(opts)) for t in tensors
        ]
        return self._work(works[-1] if works else None, tensors)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> c10d.Work:  # type: ignore[override]
        opts = opts or c10d.ReduceOptions()
        native = self._native(tensors)
        if native is not None:
            return native.reduce(tensors, opts)
        op = _reduce_op(opts)
        work = self._g.reduce(_d(tensors[0]), opts.rootRank, op, async_op=_async(opts), timeout=_timeout(opts))
        return self._work(work, tensors)

    def allgather(  # type: ignore[override]
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> c10d.Work:
        opts = opts or c10d.AllgatherOptions()
        native = self._native(input_tensors)
        if native is not None:
            return native.allgather(output_tensors, input_tensors, opts)
        work = self._g.all_gather(
            _ds(output_tensors[0]), _d(input_tensors[0]), async_op=_async(opts), timeout=_timeout(opts)
        )
        return self._work(work, output_tensors)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> c10d.Work:
        opts = opts or c10d.AllgatherOptions()
        native = self._native([input])
        if native is not None:
            return native._allgather_base(output, input, opts)
        work = self._g.all_gather_into_tensor(_d(output), _d(input), async_op=_async(opts), timeout=_timeout(opts))
        return self._work(work, [output])

    def reduce_scatter(  # type: ignore[override]
        self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any = None
    ) -> c10d.Work:
        opts = opts or c10d.ReduceScatterOptions()
        native = self._native(output_tensors)
        if native is not None:
            return native.reduce_scatter(output_tensors, input_tensors, opts)
        work = self._g.reduce_scatter(
            _d(output_tensors[0]),
            _ds(input_tensors[0]),
            _reduce_op(opts),
            async_op=_async(opts),
            timeout=_timeout(opts),
        )
        return self._work(work, output_tensors)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> c10d.Work:
        opts = opts or c10d.ReduceScatterOptions()
        native = self._native([input])
        if native is not None:
            return native._reduce_scatter_base(output, input, opts)
        work = self._g.reduce_scatter_tensor(
            _d(output), _d(input), _reduce_op(opts), async_op=_async(opts), timeout=_timeout(opts)
        )
        return self._work(work, [output])

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> c10d.Work:
        opts = opts or c10d.AllToAllOptions()
        native = self._native([input])
        if native is not None:
            return native.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)
        work = self._g.all_to_all_single(
            _d(output),
            _d(input),
            list(output_split_sizes) or None,
            list(input_split_sizes) or None,
            async_op=_async(opts),
            timeout=_timeout(opts),
        )
        return self._work(work, [output])

    def alltoall(
        self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> c10d.Work:
        opts = opts or c10d.AllToAllOptions()
        native = self._native(input_tensors)
        if native is not None:
            return native.alltoall(output_tensors, input_tensors, opts)
        work = self._g.all_to_all(
            _ds(output_tensors), _ds(input_tensors), async_op=_async(opts), timeout=_timeout(opts)
        )
        return self._work(work, output_tensors)

    def gather(  # type: ignore[override]
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> c10d.Work:
        opts = opts or c10d.GatherOptions()
        native = self._native(input_tensors)
        if native is not None:
            return native.gather(output_tensors, input_tensors, opts)
        outs = _ds(output_tensors[0]) if output_tensors else None
        work = self._g.gather(_d(input_tensors[0]), outs, opts.rootRank, async_op=_async(opts), timeout=_timeout(opts))
        return self._work(work, output_tensors)

    def scatter(  # type: ignore[override]
        self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any = None
    ) -> c10d.Work:
        opts = opts or c10d.ScatterOptions()
        native = self._native(output_tensors)
        if native is not None:
            return native.scatter(output_tensors, input_tensors, opts)
        ins = _ds(input_tensors[0]) if input_tensors else None
        work = self._g.scatter(_d(output_tensors[0]), ins, opts.rootRank, async_op=_async(opts), timeout=_timeout(opts))
        return self._work(work, output_tensors)

    def barrier(self, opts: Any = None) -> c10d.Work:
        opts = opts or c10d.BarrierOptions()
        return self._work(self._g.barrier(async_op=_async(opts), timeout=_timeout(opts)), [])

    def monitored_barrier(self, timeout: timedelta | None = None, wait_all_ranks: bool = False) -> None:
        """The group's :meth:`~pg_core.ProcessGroup.monitored_barrier`: a barrier whose timeout
        (``CollectiveTimeout``) names the ranks that did not arrive (all of them with
        ``wait_all_ranks``, else the first). ``torch.distributed.monitored_barrier`` refuses every
        backend not named gloo before it gets here: call this on the torch group, or the group's own."""
        # torch's zero timeout gives the others no time at all (its test expects an error at once)
        seconds = None if timeout is None else max(timeout.total_seconds(), _AT_ONCE_S)
        self._g.monitored_barrier(timeout=seconds, wait_all_ranks=wait_all_ranks)

    # torch 2.13 renamed three of them; both names are kept for torch >= 2.6
    all_gather_single = _allgather_base
    reduce_scatter_single = _reduce_scatter_base  # type: ignore[assignment]
    all_to_all_single = alltoall_base  # type: ignore[assignment]

    # -- coalescing (torch's _coalescing_manager) ------------------------------------------
    # With a device, torch's manager brackets the calls in its block with _start_coalescing and
    # _end_coalescing: a coalescing block of the group (its calls come back through the methods
    # above, which the open block records). Its all_reduce, all_gather_single and
    # reduce_scatter_single become one *_coalesced call at its exit: one batch of their own.
    def _start_coalescing(self, device: torch.device) -> None:
        native = self._natives.get(torch.device(device).type)
        if native is not None:
            self._native_group(native)._start_coalescing(device)
            return
        self._g.coalescing(async_op=True).__enter__()

    def _end_coalescing(self, device: torch.device) -> c10d.Work:
        native = self._natives.get(torch.device(device).type)
        if native is not None:
            return self._native_group(native)._end_coalescing(device)
        batch = self._g.open_batch
        if batch is None:
            raise RuntimeError(f"_end_coalescing on torch group {self._name!r} without _start_coalescing")
        batch.__exit__(None, None, None)
        return self._work(batch.work, [])

    def _batched(self, opts: Any, value: Any, calls: Callable[[ProcessGroup, bool], list[Work | None]]) -> c10d.Work:
        """``calls(group, async_op)`` as one batch: in this thread's open block (torch's
        ``_start_coalescing``), else in a block of their own, blocking as ``opts.asyncOp`` says."""
        group = self._g
        if group.open_batch is not None:
            return self._work(all_of("coalesced", [w for w in calls(group, True) if w is not None]), value)
        with group.coalescing(async_op=_async(opts)) as batch:
            calls(group, False)
        return self._work(batch.work, value)

    def _native_group(self, native: Any) -> dist.ProcessGroup:
        """A torch ``ProcessGroup`` on just the native backend ``native``, for what torch's
        ``Backend`` binding lacks (the coalesced collectives, and coalescing by device)."""
        group = self._native_groups.get(id(native))
        if group is None:
            group = dist.ProcessGroup(self._g.rank, self._g.size)  # type: ignore[call-arg]
            kind = dist.ProcessGroup.BackendType.CUSTOM
            for device_type, backend in self._natives.items():
                if backend is native:
                    group._register_backend(torch.device(device_type), kind, native)
            group._set_default_backend(kind)
            self._native_groups[id(native)] = group
        return group

    def allreduce_coalesced(  # type: ignore[override]
        self, tensors: list[torch.Tensor], opts: Any = None
    ) -> c10d.Work:
        opts = opts or c10d.AllreduceCoalescedOptions()
        native = self._native(tensors)
        if native is not None:
            return native.allreduce_coalesced(tensors, opts)
        op, seconds = _reduce_op(opts), _timeout(opts)
        return self._batched(
            opts, tensors, lambda g, a: [g.all_reduce(_d(t), op, async_op=a, timeout=seconds) for t in tensors]
        )

    def all_gather_single_coalesced(  # type: ignore[override]
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> c10d.Work:
        opts = opts or c10d.AllgatherOptions()
        native = self._native(inputs)
        if native is not None:
            return self._native_group(native).all_gather_single_coalesced(outputs, inputs, opts)
        seconds = _timeout(opts)
        return self._batched(
            opts,
            outputs,
            lambda g, a: [
                g.all_gather_into_tensor(_d(o), _d(i), async_op=a, timeout=seconds)
                for o, i in zip(outputs, inputs, strict=True)
            ],
        )

    def reduce_scatter_single_coalesced(  # type: ignore[override]
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> c10d.Work:
        opts = opts or c10d.ReduceScatterOptions()
        native = self._native(inputs)
        if native is not None:
            return self._native_group(native).reduce_scatter_single_coalesced(outputs, inputs, opts)
        op, seconds = _reduce_op(opts), _timeout(opts)
        return self._batched(
            opts,
            outputs,
            lambda g, a: [
                g.reduce_scatter_tensor(_d(o), _d(i), op, async_op=a, timeout=seconds)
                for o, i in zip(outputs, inputs, strict=True)
            ],
        )

    def allgather_coalesced(  # type: ignore[override]
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> c10d.Work:
        """Torch's ``all_gather_coalesced``: ``output_lists[r][i]`` receives rank ``r``'s
        ``inputs[i]``, all of them one batch of the group's ``all_gather``."""
        opts = opts or c10d.AllgatherOptions()
        native = self._native(inputs)
        if native is not None:
            return native.allgather_coalesced(output_lists, inputs, opts)
        size = self._g.size
        if len(output_lists) != size or any(len(row) != len(inputs) for row in output_lists):
            shape = [len(row) for row in output_lists]
            raise ValueError(
                f"all_gather_coalesced on torch group {self._name!r}: output_tensor_lists must hold one list per rank "
                f"({size}), each with one tensor per input ({len(inputs)}); got lists of lengths {shape}"
            )
        seconds = _timeout(opts)
        return self._batched(
            opts,
            output_lists,
            lambda g, a: [
                g.all_gather(_ds([row[i] for row in output_lists]), _d(t), async_op=a, timeout=seconds)
                for i, t in enumerate(inputs)
            ],
        )

    allgather_into_tensor_coalesced = all_gather_single_coalesced  # type: ignore[assignment]
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # type: ignore[assignment]

    # -- point to point -----------------------------------------------------------------
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> c10d.Work:
        native = self._native(tensors)
        if native is not None:
            return native.send(tensors, dst, tag)
        return self._work(self._g.isend(_d(tensors[0]), dst, tag), tensors)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> c10d.Work:
        native = self._native(tensors)
        if native is not None:
            return native.recv(tensors, src, tag)
        return self._work(self._g.irecv(_d(tensors[0]), src, tag), tensors, source=src)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> c10d.Work:
        """The group's receive from any source (where its backend declares it; else
        ``NotSupportedError``), whatever the device: a native torch backend would bypass the
        plugin's own message framing."""
        return self._work(self._g.irecv(_d(tensors[0]), None, tag), tensors)
