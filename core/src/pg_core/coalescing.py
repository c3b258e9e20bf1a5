"""Coalescing: the operations one thread calls on a group inside ``with group.coalescing():``,
validated at each call and issued together when the block exits.

What a user sees (``ProcessGroup.coalescing`` has the rules): every call is checked as it is
made and recorded, nothing is sent before the block exits, and a block that raises sends
nothing. At the exit the batch goes to its device's backend as one launch where the backend
coalesces (``Backend.coalesced``, API 1.3: NCCL's group calls), otherwise one call after
another in the same order, which is what the calls would have done after the block.

Order: a batch that holds a collective is one entry in the group's collective order and
takes a sequence number per collective, the numbers the same collectives would have had one
by one, so ranks stay numbered alike whether or not their backend coalesces. A batch of point
to point only goes straight to the backend, as point to point always does (never behind the
group's queued collectives).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch

from .backend import Call
from .timeouts import seconds
from .work import Work, all_of, unwrap

if TYPE_CHECKING:
    from datetime import timedelta

    from .check import Checker
    from .dispatch import Dispatcher
    from .executor import Executor
    from .instance import Instance
    from .validation import Staging

__all__ = ["Batch", "OpenBlocks", "Recorder"]

#: what a batch is called in errors, sequence numbers and works
_OP = "coalesced"


class OpenBlocks(dict[int, "Batch"]):
    """The coalescing blocks open on one group: at most one per thread, by thread ident. The
    group makes one; its batches enter and leave through :meth:`enter` and :meth:`leave`, and
    everyone else asks :meth:`current`, :meth:`inside` or the refusals.

    Its truth is the hot paths' cheap empty test (``if blocks:``: false unless some thread is
    inside a block of the group), a dict's own length, with no Python call; only when it is
    true do they ask whether the block is this thread's."""

    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        super().__init__()
        self._name = name  # the group's, for errors

    def current(self) -> Batch | None:
        """This thread's open block on the group, or ``None``."""
        return self.get(threading.get_ident())

    def inside(self) -> bool:
        """Whether this thread is inside a block of the group."""
        return threading.get_ident() in self

    def enter(self, batch: Batch) -> int:
        """``batch`` becomes this thread's open block (refused if one is open already, see
        :meth:`refuse_nested`); returns the thread's ident, for :meth:`leave`."""
        self.refuse_nested()
        ident = threading.get_ident()
        self[ident] = batch
        return ident

    def leave(self, ident: int) -> None:
        """The block thread ``ident`` entered is closed."""
        self.pop(ident, None)

    def refuse_nested(self) -> None:
        """Raise if this thread is inside a coalescing block of the group already."""
        if threading.get_ident() in self:
            raise RuntimeError(
                f"group {self._name!r}: this thread is already inside a coalescing block of the group; blocks do "
                "not nest (the inner calls already join the open batch)"
            )

    def refuse_inside(self, op: str) -> None:
        """Raise if this thread is inside a coalescing block of the group: ``op`` (a barrier,
        an object or message operation) cannot be part of a batch, nor overtake it."""
        if self and threading.get_ident() in self:
            raise _refusal(op, self._name)


@dataclass(slots=True)
class _Op:
    """One recorded call: what the backend gets, and what the core needs around it."""

    call: Call
    #: a collective's staging (outputs copied back after the batch); ``None`` for point to point
    staging: Staging | None
    #: point to point: the instance and the user's tag, for :meth:`Instance.p2p`
    inst: Instance | None = None
    tag: int = 0


class Batch:
    """The batch of one ``with group.coalescing() as batch:`` block (made by the group).

    After the block: :attr:`work` completes when every operation of the batch has (their
    outputs copied back), and :meth:`wait` waits for it. With ``async_op=False`` the block's
    exit has already waited.
    """

    def __init__(
        self,
        *,
        name: str,
        executor: Executor,
        dispatch: Dispatcher,
        blocks: OpenBlocks,
        async_op: bool,
        timeout: float,
        default_timeout: float,
        check: Checker | None = None,
    ) -> None:
        self._name = name
        self._executor = executor
        self._dispatch = dispatch
        self._blocks = blocks
        self._async = async_op
        self._timeout = timeout  # for the calls that give none
        self._default = default_timeout  # the group's, for seconds()
        self._check = check  # the group's check mode, where on: the batch's collectives are compared first
        self._ops: list[_Op] = []
        self._device: torch.device | None = None
        self._members: list[Work] = []  # the works handed out for calls made with async_op=True
        self._thread: int | None = None
        self._inner: Work | None = None  # what the batch launched, once issued
        self._work: Work | None = None
        self._issued = threading.Event()  # set once issued or discarded

    # -- the block -----------------------------------------------------------------------
    def __enter__(self) -> Batch:
        if self._thread is not None:
            raise RuntimeError("a coalescing block is entered once; call group.coalescing() for the next one")
        self._blocks.refuse_nested()
        self._executor.check_open()
        self._thread = self._blocks.enter(self)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._thread is not None  # (entered)
        self._blocks.leave(self._thread)
        if exc is not None:
            self._discard(exc)
            return  # the block's exception goes on
        work = self._issue()
        if not self._async:
            work.wait()

    @property
    def work(self) -> Work:
        """The batch's work: completes when all of its operations have. Exists once the block has exited."""
        if self._work is None:
            raise RuntimeError(f"group {self._name!r}: a coalesced batch has a work once its block has exited")
        return self._work

    def wait(self, timeout: float | timedelta | None = None) -> bool:
        """Wait for every operation of the batch (``timeout`` bounds this wait only, as
        :meth:`Work.wait`); re-raises the first error. Returns ``True``."""
        return self.work.wait(timeout)

    def __repr__(self) -> str:
        state = "open" if self._work is None else repr(self._work)
        return f"<coalesced batch of group {self._name!r}: {len(self._ops)} ops, {state}>"

    # -- recording (the group's calls, validated, land here) ---------------------------------
    def collective(
        self,
        op: str,
        device: torch.device,
        staging: Staging | None,
        args: tuple[Any, ...],
        *,
        timeout: float | timedelta | None,
        async_op: bool,
    ) -> Work | None:
        """Record collective ``op`` (validated and capability-checked by the group)."""
        if staging is None:  # barrier
            raise _refusal(op, self._name)
        self._same_device(op, device)
        self._ops.append(_Op(Call(op, args, self._seconds(timeout)), staging))
        return self._member(op) if async_op else None

    def p2p(
        self,
        inst: Instance,
        kind: str,
        tensor: torch.Tensor,
        peer: int,
        tag: int,
        *,
        timeout: float | timedelta | None,
        async_op: bool,
    ) -> Work:
        """Record ``isend`` (``kind`` ``"send"``) or ``irecv`` (validated by the group)."""
        if not async_op:
            raise RuntimeError(
                f"{kind} inside a coalescing block of group {self._name!r}: it would have to return before the "
                f"message moved, which happens when the block exits; use i{kind}, whose Work completes with the batch"
            )
        self._same_device(f"i{kind}", tensor.device)
        call = Call(kind, (tensor, peer, inst.tags.user(tag)), self._seconds(timeout))
        self._ops.append(_Op(call, None, inst, tag))
        return self._member(f"i{kind}")

    def capture(self, inst: Instance, timeout: float | timedelta | None) -> Recorder:
        """What the group's point to point uses in place of ``inst`` inside this block."""
        return Recorder(self, inst, timeout)

    def _seconds(self, timeout: float | timedelta | None) -> float:
        return self._timeout if timeout is None else seconds(timeout, self._default)

    def _same_device(self, op: str, device: torch.device) -> None:
        first = self._device
        if first is None:
            self._device = device
        elif device.type != first.type:
            raise ValueError(
                f"{op}: a coalesced batch is on one device type, and this one's is {first.type} (its first call's); "
                f"this call's tensors are on {device}: coalesce them in a block of their own"
            )

    def _member(self, op: str) -> Work:
        """The work of one call made with ``async_op=True``: completes with the batch."""

        def drive(_: Work, timeout: float) -> None:
            if not self._issued.is_set():
                if timeout <= 0:
                    return
                if threading.get_ident() == self._thread and self._work is None:
                    raise RuntimeError(
                        f"{op}: waited for inside its coalescing block; the batch is issued when the block exits"
                    )
                if not self._issued.wait(timeout):
                    return
            inner = self._inner
            if inner is not None:
                inner.is_completed() if timeout <= 0 else inner.wait_until_done(timeout)

        work = Work(op, driver=drive)
        self._members.append(work)
        return work

    # -- issuing ------------------------------------------------------------------------------
    def _issue(self) -> Work:
        """Issue the batch (the block's exit does); returns :attr:`work`. A failure to issue
        (a closed group, a failed backend) is raised here and fails every work of the batch."""
        try:
            inner = self._launch() if self._ops else Work.completed(_OP)
        except BaseException as exc:
            failed = Work(_OP)
            failed.set_exception(exc)
            self._settle(failed)
            raise
        self._settle(inner)
        return self.work

    def _launch(self) -> Work:
        collectives = sum(op.staging is not None for op in self._ops)
        device = self._device
        assert device is not None
        if not collectives:  # point to point only: straight to the backend, as point to point goes
            inst = self._ops[0].inst
            assert inst is not None
            return self._native(inst) if _coalesces(inst) else self._one_by_one(inst, None)

        def run(seq: int) -> Work:
            if self._check is not None:
                self._verify(seq, device)
            inst = self._dispatch.instance(device, _OP)
            if not _coalesces(inst):
                return self._one_by_one(inst, seq)
            self._executor.take(_OP, collectives - 1)
            work = self._native(inst)
            work.add_done_callback(_latching(self._executor, _OP, seq))
            return work

        # launched here where the backend launches (or the caller waits anyway); else on the
        # progress thread, as an asynchronous collective would be (in check mode too: the check
        # waits for every rank, which an asynchronous batch must not)
        inline = not self._async or (
            self._check is None
            and all(self._dispatch.launches(device, op.call.op) for op in self._ops if op.staging is not None)
        )
        result: Work = self._executor.run(_OP, run, async_op=not inline)
        return result if inline else unwrap(result)

    def _verify(self, seq: int, device: torch.device) -> None:
        """Check mode: every rank's batch holds the same collectives (one alone is compared as
        itself, so a batch of one matches the same call made outside a block)."""
        assert self._check is not None
        calls = [(op.call.op, op.call.args) for op in self._ops if op.staging is not None]
        if len(calls) == 1:
            self._check.verify(calls[0][0], seq, device.type, calls[0][1], self._timeout)
        else:
            self._check.verify_batch(seq, device.type, calls, self._timeout)

    def _native(self, inst: Instance) -> Work:
        """The whole batch as one launch: the backend's ``coalesced``."""
        for op in self._ops:
            if op.inst is not None:  # behind the stream's earlier isend/irecv on the core's helper threads
                _, peer, wire = op.call.args
                inst.ordered(op.call.op, peer, wire, _OP, _nothing, async_op=False)
        return inst.backend.coalesced([op.call for op in self._ops])

    def _one_by_one(self, inst: Instance, seq: int | None) -> Work:
        """The calls one after another, as they would run after the block: collectives in the
        executor's entry (``seq``, the entry's number, is the first's; each later one takes the
        next), point to point started as ``isend``/``irecv``."""
        executor = self._executor
        backend = inst.backend
        works: list[Work] = []
        for op in self._ops:
            call = op.call
            if op.inst is not None:
                tensor, peer, _ = call.args
                works.append(op.inst.p2p(call.op, tensor, peer, op.tag, call.timeout, async_op=True))
                continue
            number = executor.take(call.op) if seq is None else seq
            seq = None
            if call.op in inst.launching:
                work: Work = getattr(backend, call.op)(*call.args, timeout=call.timeout, async_op=True)
                work.add_done_callback(_latching(executor, call.op, number))
                works.append(work)
                continue
            try:
                getattr(backend, call.op)(*call.args, timeout=call.timeout)
            except BaseException as exc:  # the batch fails with it; what follows is not issued
                executor.latch(call.op, number, exc)
                failed = Work(call.op)
                failed.set_exception(exc)
                works.append(failed)
                break
        return all_of(_OP, works)

    def _settle(self, inner: Work) -> None:
        """When ``inner`` completes: staged outputs copied back, then the calls' works, then the batch's."""
        self._inner = inner
        ops, members = self._ops, self._members

        def drive(_: Work, timeout: float) -> None:
            inner.is_completed() if timeout <= 0 else inner.wait_until_done(timeout)

        work = self._work = Work(_OP, driver=drive)

        def done(w: Work) -> None:
            exc = w.exception(0)
            if exc is None:
                try:
                    for op in ops:
                        if op.staging is not None and op.staging.back:
                            op.staging.finish()
                except BaseException as e:
                    exc = e
            for member in members:  # before the batch's own: a member's copies are done when the batch is
                member.set_result(None) if exc is None else member.set_exception(exc)
            work.set_result(None) if exc is None else work.set_exception(exc)

        inner.add_done_callback(done)
        self._issued.set()

    def _discard(self, exc: BaseException) -> None:
        """The block raised: nothing is sent, and every work handed out fails saying so."""
        error = RuntimeError(
            f"not sent: the coalescing block of group {self._name!r} raised {type(exc).__name__}: {exc}"
        )
        error.__cause__ = exc
        self._ops.clear()
        for member in self._members:
            member.set_exception(error)
        self._work = Work(_OP)
        self._work.set_exception(error)
        self._issued.set()


class Recorder:
    """Stands in for an instance in the group's ``isend``/``irecv`` inside a block: ``p2p``
    records the call in the batch instead of starting it."""

    __slots__ = ("_batch", "_inst", "_timeout")

    def __init__(self, batch: Batch, inst: Instance, timeout: float | timedelta | None) -> None:
        self._batch, self._inst, self._timeout = batch, inst, timeout

    def p2p(self, kind: str, tensor: torch.Tensor, peer: int, tag: int, _timeout: float, *, async_op: bool) -> Any:
        return self._batch.p2p(self._inst, kind, tensor, peer, tag, timeout=self._timeout, async_op=async_op)


def _refusal(op: str, name: str) -> RuntimeError:
    return RuntimeError(
        f"{op} cannot run inside a coalescing block of group {name!r}: only tensor collectives (barrier aside) "
        "and isend/irecv are coalesced, and it would run before the batch, which is issued when the block "
        "exits; call it before or after the block"
    )


def _latching(executor: Executor, op: str, seq: int) -> Callable[[Work], None]:
    """A done-callback that latches the failure of collective ``op`` number ``seq``."""
    return lambda done: executor.latch(op, seq, done.exception(0))


def _coalesces(inst: Instance) -> bool:
    return getattr(inst.backend, "coalesces", False) is True


def _nothing() -> None:
    return None
