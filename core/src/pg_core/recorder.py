"""The flight recorder: each group's last operations, who is where after a failure, and dumps.

**What it keeps.** Every group keeps its last ``N`` operations (``PG_CORE_TRACE_BUFFER``,
default 2000; ``0`` turns recording off) in a ring of preallocated slots: the record number,
the collective's sequence number (or the point to point number of a ``send``/``recv``), the
op, the shapes and dtypes of its inputs and outputs, the device type, the root or peer, its
state (``started``; ``scheduled`` for a launched collective the backend has not finished yet;
``completed``; ``failed`` with the error's class) and its start and end times
(``time.monotonic_ns``; the recorder notes once how that clock maps to the wall clock).
Recording writes references into a slot: nothing is formatted until someone asks
(:meth:`FlightRecorder.entries`, a dump).

**Who is where.** When a collective fails with :class:`~pg_core.errors.CollectiveTimeout` or
:class:`~pg_core.errors.CollectiveMismatchError`, the rank publishes its *head* (the collective
it is in, the last one it completed, a point to point operation it is blocked in) under the
group's own store prefix, ``trace/<rank>``, waits a little (at most ``min(2 s, half the
timeout)``) for the other ranks' heads, and the error's message ends with what they say:
``rank 2 is in all_reduce #57; rank 3 is in broadcast #57; rank 1 never started #57 (last
completed all_reduce #56); rank 4 not heard from (dead or stuck outside pg-core)``. A rank
publishes its head on a peer failure and on a failed blocking ``send``/``recv`` too, so a rank
blocked elsewhere in the group is heard from once its own operation gives up. This goes
through the store alone, so it works on every backend.

**Dumps.** With ``PG_CORE_TRACE_DIR`` set, a rank whose operation fails that way writes
its state (:meth:`Tracer.state`, what ``group.debug_state()`` returns) to that folder in
torch's flight-recorder format: :mod:`pg_core.traces`, which also merges a job's dumps for
``pg-core trace DIR``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import torch

from .dtypes import dtype_name
from .errors import CollectiveMismatchError, CollectiveTimeout, PeerFailureError
from .store import Store

__all__ = [
    "DEFAULT_BUFFER",
    "ENV_BUFFER",
    "ENV_DIR",
    "FlightRecorder",
    "Tracer",
    "buffer_size",
    "head_of",
    "shape_of",
    "trace_dir",
    "where",
]

#: the environment variable that sizes every group's ring (``0``: off)
ENV_BUFFER: Final = "PG_CORE_TRACE_BUFFER"
#: the environment variable naming the folder dumps go to on a failure
ENV_DIR: Final = "PG_CORE_TRACE_DIR"
DEFAULT_BUFFER: Final = 2000

STARTED: Final = "started"
SCHEDULED: Final = "scheduled"
COMPLETED: Final = "completed"
FAILED: Final = "failed"

#: the clock of every recorded time (bound once: the per-call paths read one name)
_now: Final = time.monotonic_ns

#: the longest a rank waits for the others' heads after a failure, in seconds
REPORT_WAIT_MAX: Final = 2.0


# -- settings ------------------------------------------------------------------------------------
def buffer_size(env: Mapping[str, str]) -> int:
    """How many operations a group keeps: :data:`ENV_BUFFER` of ``env`` (default
    :data:`DEFAULT_BUFFER`; ``0`` is off). Anything but a non-negative integer is a
    ``ValueError`` naming the variable."""
    value = env.get(ENV_BUFFER, "").strip()
    if not value:
        return DEFAULT_BUFFER
    try:
        size = int(value)
    except ValueError:
        size = -1
    if size < 0:
        raise ValueError(
            f"{ENV_BUFFER}={env[ENV_BUFFER]!r} is not a number of operations to keep; give a non-negative integer "
            f"(0 turns the flight recorder off; unset keeps {DEFAULT_BUFFER})"
        )
    return size


def trace_dir(env: Mapping[str, str]) -> Path | None:
    """The folder of :data:`ENV_DIR` in ``env``, or ``None`` when unset or empty."""
    value = env.get(ENV_DIR, "").strip()
    return Path(value) if value else None


# -- what an operation is --------------------------------------------------------------------------
_Meta = tuple[tuple[Any, Any], ...]  # ((shape, dtype), ...): torch.Size and torch.dtype, formatted on demand

#: per collective (the backend's argument order), the positions of its outputs (the rest are inputs),
#: and of its root; in-place collectives (all_reduce, broadcast, reduce) have their tensor as both
_OUTPUTS: Final[dict[str, tuple[int, ...]]] = {
    "all_gather": (0,),
    "all_gather_into_tensor": (0,),
    "reduce_scatter": (0,),
    "reduce_scatter_tensor": (0,),
    "all_to_all": (0,),
    "all_to_all_single": (0,),
    "gather": (1,),
    "scatter": (0,),
}
_ROOT: Final[dict[str, int]] = {"broadcast": 1, "reduce": 1, "gather": 2, "scatter": 2}
_IN_PLACE: Final = frozenset({"all_reduce", "broadcast", "reduce"})


def _meta(items: Iterable[Any]) -> _Meta:
    out: list[tuple[Any, Any]] = []
    for item in items:
        if isinstance(item, torch.Tensor):
            out.append((item.shape, item.dtype))
        elif isinstance(item, (list, tuple)):
            out.extend((t.shape, t.dtype) for t in item if isinstance(t, torch.Tensor))
    return tuple(out)


def shape_of(tensor: torch.Tensor) -> torch.Size | None:
    """``tensor``'s shape, or ``None`` where it has no one shape (a nested tensor)."""
    try:
        return tensor.shape
    except RuntimeError:
        return None


def describe_args(op: str, args: Sequence[Any]) -> tuple[_Meta, _Meta | None, int]:
    """``(inputs, outputs, root)`` of collective ``op`` called with the backend's ``args``:
    shapes and dtypes (``outputs`` ``None``: the inputs, written in place) and the root
    (``-1``: none)."""
    if op in _IN_PLACE:  # the common case, without a loop: (tensor, ...) written in place
        t = args[0]
        root = args[1] if op != "all_reduce" else -1
        return ((t.shape, t.dtype),), None, root if type(root) is int else -1
    outs = _OUTPUTS.get(op)
    root_at = _ROOT.get(op)
    root = args[root_at] if root_at is not None and len(args) > root_at else -1
    if outs is None:
        return _meta(args), None, root if isinstance(root, int) else -1
    inputs = _meta(a for i, a in enumerate(args) if i not in outs)
    outputs = _meta(a for i, a in enumerate(args) if i in outs)
    return inputs, outputs, root if isinstance(root, int) else -1


class _Slot:
    """One operation in the ring (reused when the ring wraps)."""

    __slots__ = ("device", "end", "error", "id", "inputs", "op", "outputs", "p2p", "peer", "seq", "start", "state")

    def __init__(self) -> None:
        self.id = -1
        self.seq = 0
        self.p2p = 0  # the point to point number of a send/recv; 0 for a collective
        self.op = ""
        self.inputs: _Meta = ()
        self.outputs: _Meta | None = None
        self.peer = -1  # the root of a rooted collective, the peer of a send/recv
        self.device: str | torch.device = ""  # a point to point operation keeps the device (its .type costs more)
        self.state = ""
        self.error: str | None = None
        self.start = 0
        self.end = 0


class FlightRecorder:
    """One group's ring of its last ``capacity`` operations (``capacity`` > 0).

    The executor calls :meth:`collective` when a collective takes its sequence number and
    :meth:`finished` when it ends: :meth:`collective` returns a record number, which
    :meth:`finished` takes, and which is ignored once the ring has reused its slot. A blocking
    ``send``/``recv`` is recorded around its call, start and end in one go
    (:meth:`point_to_point`). Collectives of a group record one at a time; point to point
    operations may record from several threads (record numbers come from an atomic counter)."""

    __slots__ = ("_ids", "_last", "_p2p_ids", "_slots", "capacity", "epoch_ns")

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"a flight recorder keeps at least one operation, got capacity={capacity}")
        self.capacity = capacity
        self._slots = [_Slot() for _ in range(capacity)]
        self._ids = itertools.count()
        self._p2p_ids = itertools.count(1)
        #: ``(shape, dtype, meta)`` of the last one-tensor operation noted: a call of the same shape and
        #: dtype shares its ``meta`` (a loop repeats them; each new tuple kept in the ring would cost its
        #: making and, once its slot is reused, its freeing). One tuple, read and replaced whole: safe
        #: from several threads.
        self._last: tuple[Any, Any, _Meta] = (None, None, ())
        #: wall-clock nanoseconds at ``time.monotonic_ns() == 0``: what turns the recorded times into dates
        self.epoch_ns = time.time_ns() - time.monotonic_ns()

    def collective(self, seq: int, op: str, described: tuple[_Meta, _Meta | None, int], device: str) -> int:
        """Collective ``op`` number ``seq`` starts: ``described`` is :func:`describe_args` of it."""
        inputs, outputs, root = described
        record = next(self._ids)
        s = self._slots[record % self.capacity]
        s.id, s.seq, s.p2p, s.op, s.inputs, s.outputs, s.peer, s.device = (
            record,
            seq,
            0,
            op,
            inputs,
            outputs,
            root,
            device,
        )
        s.state, s.error, s.end = STARTED, None, 0
        s.start = time.monotonic_ns()
        return record

    def _one(self, shape: torch.Size | None, dtype: torch.dtype) -> _Meta:
        """The meta of one tensor of ``shape`` (``None``: it has none, so none is shown) and
        ``dtype``: the last call's where they are the same (:attr:`_last`)."""
        last = self._last
        if shape == last[0] and dtype is last[1]:
            return last[2]
        if shape is None:
            return ()
        meta = ((shape, dtype),)
        self._last = (shape, dtype, meta)
        return meta

    def tensor_collective(self, seq: int, op: str, tensor: torch.Tensor, device: str) -> int:
        """:meth:`collective` of an in-place collective of one tensor without a root (the
        all_reduce's fast paths: blocking, and launched), filling the slot as :meth:`collective`
        does, directly (no ``described`` tuples to make and take apart on this path)."""
        inputs = self._one(tensor.shape, tensor.dtype)
        record = next(self._ids)
        s = self._slots[record % self.capacity]
        s.id, s.seq, s.p2p, s.op, s.inputs, s.outputs, s.peer, s.device = record, seq, 0, op, inputs, None, -1, device
        s.state, s.error, s.end = STARTED, None, 0
        s.start = _now()
        return record

    def point_to_point(  # noqa: PLR0917  (the lane's every call: positional arguments cost least)
        self,
        op: str,
        shape: torch.Size | None,
        dtype: torch.dtype,
        device: torch.device,
        peer: int,
        call: Callable[..., object],
        tensor: torch.Tensor,
        tag: int,
        timeout: Any,
    ) -> None:
        """A blocking ``send`` or ``recv`` (``op``) of a tensor of ``shape`` (``None``: it has
        none, so none is shown; :func:`shape_of`), ``dtype`` and ``device`` with ``peer``,
        recorded around its call, ``call(tensor, peer, tag, timeout=timeout)``: started, then
        completed, or failed with the call's error, which is re-raised. One frame: the
        point-to-point lane's every call comes here (:class:`pg_core.instance.Lane`)."""
        record = next(self._ids)
        s = self._slots[record % self.capacity]
        # what a point to point entry shows, and no more: a reused slot's seq and outputs are not
        # shown for one, its error and end only once this one has finished (see _entry)
        s.id = record
        s.p2p = next(self._p2p_ids)
        s.op = op
        s.peer = peer
        last = self._last  # (:meth:`_one`'s hit, inline: this is the hottest caller)
        s.inputs = last[2] if shape == last[0] and dtype is last[1] else self._one(shape, dtype)
        s.device = device  # (its .type when shown: reading it costs more than keeping the device)
        s.state = STARTED
        s.start = _now()
        try:
            call(tensor, peer, tag, timeout=timeout)
        except BaseException as exc:
            self.finished(record, exc)
            raise
        if s.id == record:  # (finished's, inline)
            s.end = _now()
            s.state = COMPLETED

    def finished(self, record: int, error: BaseException | None = None) -> None:
        """Operation ``record`` ended: completed, or failed with ``error``."""
        s = self._slots[record % self.capacity]
        if s.id == record:
            s.end = _now()
            if error is None:
                s.state = COMPLETED
            else:
                s.state, s.error = FAILED, type(error).__name__

    def launched(self, record: int) -> None:
        """Collective ``record`` was handed to its backend, which finishes it later (:meth:`finished`)."""
        s = self._slots[record % self.capacity]
        if s.id == record:
            s.state = SCHEDULED

    def _ordered(self) -> list[_Slot]:
        slots = [s for s in self._slots if s.id >= 0]
        slots.sort(key=lambda s: s.id)
        return slots

    def entries(self) -> list[dict[str, Any]]:
        """The operations kept, oldest first, as JSON-serialisable dicts (see :func:`_entry`)."""
        return [_entry(s, self.epoch_ns) for s in self._ordered()]

    def head(self) -> dict[str, Any]:
        """Where the group stands (:func:`head_of` its entries)."""
        return head_of(self.entries())


def _shapes(meta: _Meta) -> list[list[int]]:
    return [list(shape) for shape, _ in meta]


def _entry(s: _Slot, epoch_ns: int) -> dict[str, Any]:
    """One slot as pg-core shows it (``debug_state()``, dumps): times in wall-clock nanoseconds.
    (A point to point operation's slot keeps what an earlier occupant left in ``seq``,
    ``outputs``, ``error`` and ``end`` until it finishes: those are read only where they are its own.)"""
    outputs = s.inputs if s.outputs is None or s.p2p else s.outputs
    end = s.end if s.state in (COMPLETED, FAILED) else 0
    return {
        "record_id": s.id,
        "seq": s.seq if not s.p2p else None,
        "p2p_seq": s.p2p or None,
        "op": s.op,
        "input_sizes": _shapes(s.inputs),
        "input_dtypes": [dtype_name(d) for _, d in s.inputs],
        "output_sizes": _shapes(outputs),
        "output_dtypes": [dtype_name(d) for _, d in outputs],
        "root" if not s.p2p else "peer": s.peer if s.peer >= 0 else None,
        "device": s.device if isinstance(s.device, str) else s.device.type,
        "state": s.state,
        "error": s.error if s.state == FAILED else None,
        "start_ns": s.start + epoch_ns,
        "end_ns": end + epoch_ns if end else None,
        "duration_us": (end - s.start) / 1e3 if end else None,
    }


# -- who is where ----------------------------------------------------------------------------------
def head_of(entries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Where a rank stands, from its entries (oldest first): the newest collective newer than
    every completed one and not completed itself (``current``: ``[seq, op]``), the newest
    completed collective (``completed``), and the newest point to point operation still
    running or failed (``p2p``: op and peer), if that is its newest."""
    current = completed = p2p = None
    for e in reversed(entries):
        if e.get("p2p_seq"):
            if p2p is None:  # the newest one only: where it is (or gave up) now
                p2p = {"op": e["op"], "peer": e.get("peer")} if e["state"] in (STARTED, FAILED) else {}
        elif current is None and completed is None and e["state"] in (STARTED, SCHEDULED, FAILED):
            current = [e["seq"], e["op"]]
        elif completed is None and e["state"] == COMPLETED:
            completed = [e["seq"], e["op"]]
    return {"current": current, "completed": completed, "p2p": p2p or None}


def _ranks(ranks: Sequence[int]) -> tuple[str, str]:
    """``("rank 2", "is")`` or ``("ranks 0, 2", "are")``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}", "is"
    return f"ranks {', '.join(map(str, ranks))}", "are"


def _place(head: Mapping[str, Any] | None, seq: int, left: bool) -> str:
    """Where one rank is, relative to collective ``seq``, as ``"{be} in all_reduce #57"``."""
    if head is None:
        if left:
            return "{be} not heard from: it left the group (shutdown or abort)"
        return "{be} not heard from (dead or stuck outside pg-core)"
    current, completed, p2p = head.get("current"), head.get("completed"), head.get("p2p")
    if current is not None and current[0] == seq:
        return f"{{be}} in {current[1]} #{current[0]}"
    if current is not None and current[0] > seq:
        return f"{{be}} past it, in {current[1]} #{current[0]}"
    last = f"last completed {completed[1]} #{completed[0]}" if completed else "completed no collective"
    more = [last]
    if current is not None:
        more.append(f"in {current[1]} #{current[0]}")
    if p2p is not None:
        more.append(f"in {p2p['op']} {'to' if p2p['op'] == 'send' else 'from'} rank {p2p['peer']}")
    return f"never started #{seq} ({'; '.join(more)})"


def where(seq: int, heads: Mapping[int, Mapping[str, Any] | None], left: Iterable[int] = ()) -> str:
    """Who is where at collective ``seq``: per rank of ``heads`` (``None``: not heard from;
    ``left``: ranks known to have left the group), ranks in the same place named together:
    ``ranks 0, 2 are in all_reduce #57; rank 1 never started #57 (last completed all_reduce #56)``."""
    gone = set(left)
    places: dict[str, list[int]] = {}
    for rank in sorted(heads):
        places.setdefault(_place(heads[rank], seq, rank in gone), []).append(rank)
    parts = []
    for place, ranks in places.items():
        who, be = _ranks(ranks)
        parts.append(f"{who} {place.format(be=be)}")
    return "; ".join(parts)


#: why a rank published its head, by the error that made it
def _why(exc: BaseException) -> str:
    if isinstance(exc, CollectiveTimeout):
        return "timeout"
    if isinstance(exc, CollectiveMismatchError):
        return "mismatch"
    if isinstance(exc, PeerFailureError):
        return "peer failure"
    return type(exc).__name__


class Tracer:
    """What a group does with its recorder when an operation fails (see the module docstring).

    ``store`` is the group's own (prefixed) store; ``recorder`` its ring, or ``None`` when
    recording is off (a head then knows only the failing collective); ``joined`` the
    group's explanation of a timeout by members that never joined (it returns whether it
    explained); ``seq`` gives the executor's current sequence number; ``folder`` is where
    dumps go (``None``: none); ``describe`` gives ``debug_state()``'s fields beyond the
    recorder's."""

    def __init__(
        self,
        *,
        store: Store,
        rank: int,
        size: int,
        name: str,
        uid: str,
        timeout: float,
        recorder: FlightRecorder | None,
        joined: Callable[[CollectiveTimeout], bool] | None,
        folder: Path | None,
        describe: Callable[[], dict[str, Any]],
    ) -> None:
        self._store, self._rank, self._size, self._name, self._uid = store, rank, size, name, uid
        self._timeout = timeout
        self.recorder = recorder
        self._joined = joined
        self._folder = folder
        self._describe = describe
        self._reported = False
        #: the last desync report of this group (JSON-serialisable), or ``None``
        self.report: dict[str, Any] | None = None
        #: where the last dump went, or ``None``
        self.dumped: Path | None = None

    def explain(self, op: str, seq: int, exc: BaseException) -> None:
        """Collective ``op`` number ``seq`` failed with ``exc`` (a timeout, peer failure or
        mismatch): the first such failure of the group publishes this rank's head, gathers
        the others' (timeout, mismatch) into ``exc``'s message, and dumps. Never raises: the
        store may be the thing that failed."""
        never_joined = isinstance(exc, CollectiveTimeout) and self._joined is not None and self._joined(exc)
        if self._reported:
            return
        self._reported = True
        head = self._head(exc, current=[seq, op])
        try:
            self._publish(head)
            if isinstance(exc, (CollectiveTimeout, CollectiveMismatchError)) and not never_joined:
                self._gather(op, seq, exc, head)
        except Exception:  # the store is gone or failing: the error stands as the backend told it
            pass
        self._dump()

    def point_to_point_failed(self, exc: BaseException) -> None:
        """A blocking ``send``/``recv`` failed with ``exc``: where it can leave ranks out of
        step (a timeout, a peer failure), publish this rank's head, so ranks waiting in a
        collective hear where it is, and dump."""
        if not isinstance(exc, (CollectiveTimeout, PeerFailureError)):
            return
        if isinstance(exc, CollectiveTimeout) and self._joined is not None:
            self._joined(exc)  # the peer never joined (or a stranger holds its place): that is the cause
        with contextlib.suppress(Exception):
            self._publish(self._head(exc, current=None))
        self._dump()

    def _head(self, exc: BaseException, current: list[Any] | None) -> dict[str, Any]:
        head = head_of([] if self.recorder is None else self.recorder.entries())
        if current is not None:
            head["current"] = current
        head.update(rank=self._rank, why=_why(exc), error=type(exc).__name__, wall_ns=time.time_ns())
        return head

    def _publish(self, head: Mapping[str, Any]) -> None:
        self._store.set(f"trace/{self._rank}", json.dumps(head))

    def _read(self, rank: int) -> dict[str, Any] | None:
        key = f"trace/{rank}"
        if not self._store.check([key]):
            return None
        try:
            head = json.loads(self._store.get(key).decode())
        except (UnicodeDecodeError, ValueError):
            return None  # not a head pg-core wrote: as good as not heard from
        return head if isinstance(head, dict) else None

    def _gather(self, op: str, seq: int, exc: BaseException, mine: dict[str, Any]) -> None:
        """Wait (at most ``min(REPORT_WAIT_MAX, timeout / 2)``) for every rank's head, then
        append who is where to ``exc``'s message."""
        heads: dict[int, dict[str, Any] | None] = {r: None for r in range(self._size)}
        heads[self._rank] = mine
        deadline = time.monotonic() + min(REPORT_WAIT_MAX, self._timeout / 2)
        # a head published before this collective could have begun (an earlier failure's, after
        # which that rank went on) says nothing of where the rank is now: not heard from, yet
        since_ns = time.time_ns() - int((self._timeout + REPORT_WAIT_MAX) * 1e9)
        delay = 0.005
        while True:
            for r in range(self._size):
                if heads[r] is None:
                    head = self._read(r)
                    fresh = head is not None and isinstance(head.get("wall_ns"), int) and head["wall_ns"] >= since_ns
                    heads[r] = head if fresh else None
            left = deadline - time.monotonic()
            if all(h is not None for h in heads.values()) or left <= 0:
                break
            time.sleep(min(delay, left))  # a bounded poll of the store, not a synchronisation
            delay = min(delay * 2, 0.1)
        gone = [r for r, h in heads.items() if h is None and self._store.check([f"left/{r}"])]
        text = where(seq, heads, gone)
        self.report = {
            "group": self._name,
            "uid": self._uid,
            "rank": self._rank,
            "op": op,
            "seq": seq,
            "error": type(exc).__name__,
            "heads": {str(r): h for r, h in heads.items()},
            "left": gone,
            "text": text,
        }
        message = exc.args[0] if exc.args and isinstance(exc.args[0], str) else str(exc)
        exc.args = (f"{message}. Who is where in group {self._name!r} at collective #{seq}: {text}", *exc.args[1:])

    # -- the state shown and dumped ------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """``debug_state()``: the group's fields, the recorder's entries, the last report."""
        out = self._describe()
        rec = self.recorder
        out["recorder"] = {"capacity": 0 if rec is None else rec.capacity, "env": ENV_BUFFER}
        out["entries"] = [] if rec is None else rec.entries()
        out["report"] = self.report
        return out

    def _dump(self) -> None:
        if self._folder is None:
            return
        from .traces import write_dump  # (the dumps' module reads this one's entries: imported when first needed)

        try:
            self.dumped = write_dump(self._folder, self.state())
        except Exception as exc:  # a full disk or a missing folder must not replace the operation's error
            from .errors import warn_user

            warn_user(f"group {self._name!r}: could not write the flight recorder's dump to {self._folder}: {exc}")
