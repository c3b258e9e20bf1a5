"""The hot collectives over shared slots: ``all_reduce``, ``broadcast``, ``barrier``,
``all_gather_into_tensor``, ``reduce_scatter_tensor``.

Every member has two slots (sequence parity) in its segment and a ``step`` counter it alone
writes. A collective is a sequence of *phases*, numbered alike on every member: in phase
``s`` a member may write its slot of parity ``s % 2``, then publishes ``step = s``; readers
wait until the writers' steps reach ``s``. A member publishes ``s`` only once it has read
everything of phase ``s - 1``, so before writing a slot again (phase ``s + 2``) a member waits
until every peer's step reached ``s + 1``: two slots let consecutive phases overlap with no
extra barrier, and every phase reads only its own parity's slots.

* ``all_reduce`` up to :data:`SMALL_BYTES`: one phase; every member folds every slot in rank
  order ``0 .. size-1`` itself, so every member's bits are identical. Larger: per piece of a
  slot, two phases: each member folds its share of the piece (rank order) and publishes it,
  then every member copies every share. Each element is reduced once, by one member.
* Each collective is written once as *steps* (a generator yielding each phase it waits for):
  :meth:`Shared.run` drives them blocking, :meth:`Shared.launch` launches them (API 1.2) and
  returns a work that its waiter, a later collective or the drainer drives, in launch order.
* ``AVG`` divides the sum by the size; ``PREMUL_SUM`` scales each contribution at its source,
  as :mod:`pg_core.algorithms` does; the folds are torch's own ops
  (:data:`pg_core.algorithms.BINARY_OPS`).
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Sequence
from typing import Final

import torch
from pg_core.algorithms import BINARY_OPS, divide_, scale_
from pg_core.errors import CollectiveTimeout
from pg_core.ops import RedOpType, ReduceOp
from pg_core.work import Work

from .layout import COLL_SLEEPS, STEP, Layout
from .segment import Segment, Word, futex_wake
from .waiting import SLICE, SPINS, Flag, Liveness, wait_until

__all__ = ["SMALL_BYTES", "Shared", "Steps"]

#: What a collective's steps wait for: every peer (of the list, or all where ``None``) to have
#: published the phase, and what that is, for errors.
Wait = tuple[int, Sequence[int] | None, str]
#: A collective written once as steps (a generator yielding each :data:`Wait` not met yet):
#: :meth:`Shared.run` drives it blocking, :meth:`Shared.launch` from its work's waiters.
Steps = Generator[Wait, None, None]

#: Largest all_reduce folded whole by every member (one phase).
SMALL_BYTES: Final = 64 << 10


def _width(dtype: torch.dtype) -> int:
    return dtype.itemsize


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.requires_grad:
        tensor = tensor.detach()
    return tensor.reshape(-1)


class Shared:
    """This member's view of every member's step counter and slots."""

    def __init__(
        self,
        rank: int,
        size: int,
        segments: Sequence[Segment],
        layout: Layout,
        live: Liveness,
        *,
        enter: Callable[[], None],
        leave: Callable[[], None],
    ) -> None:
        self.rank, self.size, self.live = rank, size, live
        self._enter, self._leave = enter, leave  # a driver's reference to the mappings
        #: held while a collective's steps run (blocking, or a launched one's driver)
        self._lock = threading.Lock()
        self._pending: deque[_Launched] = deque()  # launched, not ended: in launch order
        self.steps = [Word(s.address + STEP) for s in segments]
        self.sleeps = [Word(s.address + COLL_SLEEPS, 32) for s in segments]
        self._flag = Flag(self.sleeps[rank])
        self._peer_sleeps = [w.cell for p, w in enumerate(self.sleeps) if p != rank]
        self._my_step_address = self.steps[rank].address
        self.slot_bytes = layout.slot_bytes
        # byte tensors over each member's two slots, through ctypes arrays: they hold no export
        # of the mapping, so shutdown can unmap it (and nothing uses them afterwards)
        self._slots = [
            [
                torch.frombuffer((ctypes.c_uint8 * layout.slot_bytes).from_address(s.address + layout.slot(p)),
                                 dtype=torch.uint8)
                for p in (0, 1)
            ]
            for s in segments
        ]  # fmt: skip
        self._addresses = [segments[rank].address + layout.slot(p) for p in (0, 1)]  # this member's slots
        self._typed: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}
        self.step = 0
        self._written = [-2, -2]  # the phase that last wrote each parity

    def wake_words(self) -> list[int]:
        return [w.address for w in self.steps]

    def release(self) -> None:
        self._slots = []
        self._typed.clear()

    # -- phases --------------------------------------------------------------------------
    def _begin(self, writes: bool) -> Generator[Wait, None, tuple[int, int]]:
        """The next phase's number and parity; if this member ``writes`` its slot, first wait
        until every peer has read what that slot last held."""
        s = self.step + 1
        parity = s % 2
        if writes:
            last = self._written[parity] + 1
            if not self._reached(last, None):
                yield (last, None, "reading the previous use of this member's slot")
            self._written[parity] = s
        return s, parity

    def _publish(self, s: int) -> None:
        self.step = s
        self.steps[self.rank].value = s
        self._wake_sleepers()

    def _wake_sleepers(self) -> None:
        """Wake the peers asleep on this member's step (after it moved)."""
        for cell in self._peer_sleeps:
            if cell.value:
                futex_wake(self._my_step_address)
                return

    def _reached(self, s: int, among: Sequence[int] | None) -> bool:
        """Whether every peer (of ``among``) published phase ``s``."""
        me, steps = self.rank, self.steps
        for peer in range(self.size) if among is None else among:
            if peer != me and steps[peer].value < s:
                return False
        return True

    def _wait_all(self, s: int, deadline: float, op: str, doing: str, among: Sequence[int] | None = None) -> None:
        for peer in range(self.size) if among is None else among:
            if peer == self.rank:
                continue
            word = self.steps[peer]
            if word.value >= s:
                continue
            late = [p for p in range(self.size) if p != self.rank and self.steps[p].value < s]
            wait_until(
                lambda w=word: w.value >= s,  # type: ignore[misc]
                word,
                self._flag,
                self.live,
                late,
                deadline=deadline,
                doing=f"{op}: waiting for ranks {late} ({doing})",
                op=op,
            )

    # -- running the steps of a collective: blocking, or launched ----------------------------
    def run(self, op: str, steps: Steps, deadline: float) -> None:
        """Run a collective's ``steps`` here, blocking, after every launched one still pending."""
        with self._lock:
            if self._pending:
                self._progress(None, deadline, blocking=True)
            for s, among, doing in steps:
                self._wait_all(s, deadline, op, doing, among)

    def launch(self, op: str, steps: Steps, deadline: float) -> Work:
        """Launch a collective's ``steps``: run them here as far as they go without waiting for
        a peer (an error there raises here), and return a work that completes once they end
        (see :class:`_Launched`). Behind a launched collective still pending, nothing runs here:
        the steps start when those before them end."""
        with self._lock:
            job = _Launched(self, op, steps, deadline)
            if not self._pending:
                try:
                    done = job.advance()
                except BaseException:
                    steps.close()
                    raise
                if done:
                    return Work.completed(op)
            self._pending.append(job)
            return job.work

    def pending(self) -> bool:
        """Whether a launched collective has not ended yet."""
        return bool(self._pending)

    def drive(self, job: _Launched, budget: float) -> None:
        """``job``'s work's driver: the launched collectives up to ``job`` advanced, for at most
        ``budget`` seconds (``0``: only what is ready now). Never raises for their failure."""
        if job.work.done:
            return
        if not (self._lock.acquire(blocking=False) if budget <= 0 else self._lock.acquire(timeout=budget)):
            return  # another thread drives them (a waiter, a blocking collective, the drainer)
        try:
            try:
                self._enter()
            except BaseException as exc:  # closed: nothing may touch the segments any more
                self._fail(exc)
                return
            try:
                self._progress(job, time.monotonic() + budget, blocking=budget > 0)
            finally:
                self._leave()
        except BaseException:  # recorded on the works by _progress; never the driver's to raise
            pass
        finally:
            self._lock.release()

    def background(self) -> None:
        """The drainer's part (its reference held): advance the launched collectives that
        nobody drives, without waiting; past a slice since the last look, check the peers
        and the deadline, failing them as a wait would."""
        if not self._pending or not self._lock.acquire(blocking=False):
            return
        try:
            self._progress(None, 0.0, blocking=False)
            if self._pending:
                head = self._pending[0]
                now = time.monotonic()
                if now - head.looked >= SLICE:
                    head.looked = now
                    try:
                        self._check(head, now)
                    except BaseException as exc:
                        self._fail(exc)
        except BaseException:  # recorded on the works
            pass
        finally:
            self._lock.release()

    def fail_pending(self, exc: BaseException) -> None:
        """Fail every launched collective still pending with ``exc`` (this member closed): their
        waiters and callbacks hear of it now, whoever holds the lock."""
        for job in list(self._pending):
            job.work.set_exception(exc)

    def _check(self, job: _Launched, now: float) -> None:
        s, among, doing = job.waiting or (0, None, "")
        late = [p for p in (range(self.size) if among is None else among) if p != self.rank and self.steps[p].value < s]
        self.live.check(late, f"{job.op}: waiting for ranks {late} ({doing})")
        if now > job.deadline:
            raise CollectiveTimeout(
                f"Timed out in {job.op} (group {self.live.group!r}): waiting for ranks {late} ({doing})",
                op=job.op,
                peers=late,
            )

    def _progress(self, until: _Launched | None, end: float, *, blocking: bool) -> None:
        """Advance the pending launched collectives in order (under the lock): all of them, or
        up to ``until``; waiting for peers until ``end`` (``time.monotonic()``) where
        ``blocking``. A failure fails the first and every later one (the group latches it) and,
        with ``until=None`` (a blocking collective behind them), raises."""
        pending = self._pending
        while pending and not (until is not None and until.work.done):
            head = pending[0]
            try:
                if head.advance():
                    pending.popleft()
                    head.work.set_result(None)
                    continue
                if not blocking:
                    return
                s, among, doing = head.waiting  # type: ignore[misc]
                try:
                    self._wait_all(s, min(head.deadline, end), head.op, doing, among)
                except CollectiveTimeout:
                    if time.monotonic() < head.deadline:
                        return  # this driver's own budget ran out, not the collective's
                    raise
            except BaseException as exc:
                self._fail(exc)
                if until is None:
                    raise
                return

    def _fail(self, exc: BaseException) -> None:
        pending, self._pending = list(self._pending), deque()
        for job in pending:
            job.steps.close()
            job.work.set_exception(exc)

    def _slot(self, rank: int, parity: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        typed = self._typed.get((rank, parity, dtype))
        if typed is None:
            width = _width(dtype)
            typed = self._typed[(rank, parity, dtype)] = self._slots[rank][parity][
                : self.slot_bytes // width * width
            ].view(dtype)
        return typed[:numel]

    def _elements(self, dtype: torch.dtype) -> int:
        return self.slot_bytes // _width(dtype)

    # -- collectives -----------------------------------------------------------------------
    def barrier(self) -> Steps:
        s, _ = yield from self._begin(writes=False)
        self._publish(s)
        if not self._reached(s, None):
            yield (s, None, "arriving")

    def small_all_reduce(self, dtype: torch.dtype, op: ReduceOp) -> Callable[[torch.Tensor, float], bool]:
        """The one-phase all_reduce of ``dtype`` with ``op``, prepared: ``run(tensor, deadline)``
        reduces a contiguous ``tensor`` of at most :data:`SMALL_BYTES` (and returns ``True``), or
        returns ``False`` at once, untouched, for anything else (the caller takes
        :meth:`all_reduce`). Same phases, same words and same folds as :meth:`all_reduce`: the
        two interleave freely. What a call would look up is looked up here once (the slot views
        per element count, the counters' ctypes cells), so a call is a few Python lines."""
        go = self._small(dtype, op)
        return lambda tensor, deadline: go(tensor, deadline, False) is not None

    def small_launch(self, dtype: torch.dtype, op: ReduceOp) -> Callable[[torch.Tensor, float], Work | None]:
        """:meth:`small_all_reduce` launched: ``run(tensor, deadline)`` returns its work, done
        where the peers had contributed within a spin, else pending (the fold left to its
        driver, as :meth:`launch` leaves it); ``None`` for anything else, untouched (the caller
        takes :meth:`all_reduce` and :meth:`launch`), among which a slot still being read."""
        go = self._small(dtype, op)
        return lambda tensor, deadline: go(tensor, deadline, True)  # type: ignore[return-value]

    def _small(self, dtype: torch.dtype, op: ReduceOp) -> Callable[[torch.Tensor, float, bool], Work | bool | None]:
        """The one body of :meth:`small_all_reduce` (``launched=False``: ``True`` once done,
        ``None`` untouched) and :meth:`small_launch` (a work, or ``None`` untouched)."""
        kind = op.type
        if self.size == 1 or kind is RedOpType.PREMUL_SUM:
            return lambda tensor, deadline, launched: None
        fn = BINARY_OPS[kind]
        avg = kind is RedOpType.AVG
        limit = min(SMALL_BYTES, self.slot_bytes)
        me, size = self.rank, self.size
        cells = [self.steps[p].cell for p in range(size) if p != me]
        my_step = self.steps[me].cell
        written = self._written
        addresses = self._addresses
        views: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        memmove = ctypes.memmove

        def fold(tensor: torch.Tensor, mine: list[torch.Tensor]) -> None:
            flat = tensor.view(-1) if tensor.dim() != 1 else tensor
            fn(mine[0], mine[1], out=flat)
            for other in mine[2:]:
                fn(flat, other, out=flat)
            if avg:
                divide_(flat, size, 0)

        def rest(tensor: torch.Tensor, mine: list[torch.Tensor], s: int) -> Steps:
            yield (s, None, "contributing")
            fold(tensor, mine)

        def run(tensor: torch.Tensor, deadline: float, launched: bool) -> Work | bool | None:
            if self._pending:  # behind a launched collective: the general path drives it first
                return None
            nbytes = tensor.nbytes
            if not 0 < nbytes <= limit or tensor.dtype != dtype or tensor.requires_grad or not tensor.is_contiguous():
                return None
            n = tensor.numel()
            slots = views.get(n)
            if slots is None:
                slots = views[n] = ([self._slot(r, 0, dtype, n) for r in range(size)],
                                    [self._slot(r, 1, dtype, n) for r in range(size)])  # fmt: skip
            s = self.step + 1
            parity = s & 1
            last = written[parity] + 1  # every peer read this slot's last use once its step reached this
            for cell in cells:
                if cell.value < last:
                    if launched:
                        return None  # (the general path's steps wait for it)
                    self._wait_all(last, deadline, "all_reduce", "reading the previous use of this member's slot")
                    break
            written[parity] = s
            memmove(addresses[parity], tensor.data_ptr(), nbytes)
            self.step = s
            my_step.value = s
            self._wake_sleepers()
            mine = slots[parity]
            for cell in cells:
                if cell.value < s:
                    for _ in range(SPINS):  # the peer is usually a few microseconds behind: poll the bare cell
                        if cell.value >= s:
                            break
                    else:
                        if launched:
                            job = _Launched(self, "all_reduce", rest(tensor, mine, s), deadline)
                            with self._lock:
                                self._pending.append(job)
                            return job.work
                        self._wait_all(s, deadline, "all_reduce", "contributing")
                        break
            fold(tensor, mine)
            return Work.completed("all_reduce") if launched else True

        return run

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> Steps:
        flat = _flat(tensor)
        kind = op.type
        if kind is RedOpType.PREMUL_SUM:
            scale_(flat, op.factor_value(), 0)
        if self.size == 1 or flat.numel() == 0:
            return
        fn = BINARY_OPS[kind]
        if flat.nbytes <= min(SMALL_BYTES, self.slot_bytes):
            s, parity = yield from self._begin(writes=True)
            n = flat.numel()
            ctypes.memmove(self._addresses[parity], flat.data_ptr(), flat.nbytes)
            self._publish(s)
            if not self._reached(s, None):
                yield (s, None, "contributing")
            slots = [self._slot(r, parity, flat.dtype, n) for r in range(self.size)]
            fn(slots[0], slots[1], out=flat)
            for other in slots[2:]:
                fn(flat, other, out=flat)
        else:
            step = self._elements(flat.dtype)
            for start in range(0, flat.numel(), step):
                yield from self._all_reduce_piece(flat[start : start + step], fn)
        if kind is RedOpType.AVG:
            divide_(flat, self.size, 0)

    def _all_reduce_piece(self, piece: torch.Tensor, fn: object) -> Steps:
        """Phase ``s`` (slot A): contribute, then fold this member's share of every slot A.
        Phase ``s + 1`` (slot B): publish the share, then copy every member's share."""
        n, size, dtype, me = piece.numel(), self.size, piece.dtype, self.rank
        bounds = [n * r // size for r in range(size + 1)]
        lo, hi = bounds[me], bounds[me + 1]
        s, a = yield from self._begin(writes=True)
        mine = self._slot(me, a, dtype, n)
        # only the others read this member's slot outside its share; ranks 0 and 1 fold their share
        # from the tensor itself (it is the fold's first output), the others need theirs kept aside
        direct = me < 2
        if direct:
            mine[:lo].copy_(piece[:lo])
            mine[hi:].copy_(piece[hi:])
        else:
            mine.copy_(piece)
        self._publish(s)
        if not self._reached(s, None):
            yield (s, None, "contributing")
        out = piece[lo:hi]
        if hi > lo:
            slots = [out if direct and r == me else self._slot(r, a, dtype, n)[lo:hi] for r in range(size)]
            fn(slots[0], slots[1], out=out)  # type: ignore[operator]
            for other in slots[2:]:
                fn(out, other, out=out)  # type: ignore[operator]
        s2, b = yield from self._begin(writes=True)
        self._slot(me, b, dtype, n)[lo:hi].copy_(out)
        self._publish(s2)
        if not self._reached(s2, None):
            yield (s2, None, "reducing their shares")
        for r in range(size):
            if r != me and bounds[r + 1] > bounds[r]:
                piece[bounds[r] : bounds[r + 1]].copy_(self._slot(r, b, dtype, n)[bounds[r] : bounds[r + 1]])

    def broadcast(self, tensor: torch.Tensor, src: int) -> Steps:
        flat = _flat(tensor)
        if self.size == 1 or flat.numel() == 0:
            return
        step = self._elements(flat.dtype)
        for start in range(0, flat.numel(), step):
            piece = flat[start : start + step]
            s, parity = yield from self._begin(writes=self.rank == src)
            if self.rank == src:
                self._slot(src, parity, flat.dtype, piece.numel()).copy_(piece)
                self._publish(s)
            else:
                if not self._reached(s, [src]):
                    yield (s, [src], f"rank {src}'s data")
                piece.copy_(self._slot(src, parity, flat.dtype, piece.numel()))
                self._publish(s)

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor) -> Steps:
        src, out = _flat(input), _flat(output)
        m = src.numel()
        if m == 0:
            return
        blocks = [out[r * m : (r + 1) * m] for r in range(self.size)]
        if self.size == 1:
            blocks[0].copy_(src)
            return
        step = self._elements(src.dtype)
        for start in range(0, m, step):
            k = min(step, m - start)
            s, parity = yield from self._begin(writes=True)
            self._slot(self.rank, parity, src.dtype, k).copy_(src[start : start + k])
            self._publish(s)
            if not self._reached(s, None):
                yield (s, None, "contributing")
            for r in range(self.size):
                blocks[r][start : start + k].copy_(self._slot(r, parity, src.dtype, k))

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp) -> Steps:
        src, out = _flat(input), _flat(output)
        kind = op.type
        size, m = self.size, out.numel()
        if kind is RedOpType.PREMUL_SUM:
            src = src.clone()  # the input is not the output here: scale a copy, never the caller's input
            scale_(src, op.factor_value(), 0)
        if size == 1:
            out.copy_(src)
            if kind is RedOpType.AVG:
                divide_(out, size, 0)
            return
        if m == 0:
            return
        fn = BINARY_OPS[kind]
        step = max(1, self._elements(src.dtype) // size)
        for start in range(0, m, step):
            k = min(step, m - start)
            s, parity = yield from self._begin(writes=True)
            mine = self._slot(self.rank, parity, src.dtype, size * k).view(size, k)
            mine.copy_(src.view(size, m)[:, start : start + k])
            self._publish(s)
            if not self._reached(s, None):
                yield (s, None, "contributing")
            rows = [self._slot(r, parity, src.dtype, size * k).view(size, k)[self.rank] for r in range(size)]
            target = out[start : start + k]
            fn(rows[0], rows[1], out=target)
            for other in rows[2:]:
                fn(target, other, out=target)
        if kind is RedOpType.AVG:
            divide_(out, size, 0)


class _Launched:
    """One launched collective: its steps, where they wait, its deadline, and its work, which
    waiting on (or polling) drives (:meth:`Shared.drive`). The steps run only under the
    :class:`Shared`'s lock, one collective after another in launch order, so the phases are
    numbered as the blocking calls would number them."""

    __slots__ = ("_reached", "deadline", "looked", "op", "steps", "waiting", "work")

    def __init__(self, shared: Shared, op: str, steps: Steps, deadline: float) -> None:
        self.op, self.steps, self.deadline = op, steps, deadline
        self._reached = shared._reached
        self.waiting: Wait | None = None  # the phase the steps wait for; None: not started, or go on
        self.looked = time.monotonic()  # when the drainer last checked the peers for it
        self.work = Work(op, driver=lambda _work, budget: shared.drive(self, budget))

    def advance(self) -> bool:
        """Run the steps on while what they wait for has come; ``True`` once they ended."""
        waiting, reached = self.waiting, self._reached
        while waiting is None or reached(waiting[0], waiting[1]):
            try:
                waiting = self.waiting = next(self.steps)
            except StopIteration:
                self.waiting = None
                return True
        return False
