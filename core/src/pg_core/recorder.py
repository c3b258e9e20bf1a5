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
``<dir>/<group>-<uid>-rank<r>``: a pickle in torch's flight-recorder format (version
:data:`TORCH_FORMAT_VERSION`), which torch's analyser reads
(``python -m torch.distributed.flight_recorder.fr_trace DIR -p <group>-<uid>-rank``), holding
pg-core's own account under the key ``"pg_core"`` (:meth:`Tracer.state`, what
``group.debug_state()`` returns). ``pg-core trace DIR`` merges a job's dumps
(:func:`merge`, :func:`merged_text`); it reads them with an unpickler that loads no class at
all, so a file planted in the folder cannot run code.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import pickle
import re
import tempfile
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
    "TORCH_FORMAT_VERSION",
    "FlightRecorder",
    "Tracer",
    "buffer_size",
    "dump_name",
    "head_of",
    "load_dump",
    "merge",
    "merged_text",
    "trace_dir",
    "where",
]

#: the environment variable that sizes every group's ring (``0``: off)
ENV_BUFFER: Final = "PG_CORE_TRACE_BUFFER"
#: the environment variable naming the folder dumps go to on a failure
ENV_DIR: Final = "PG_CORE_TRACE_DIR"
DEFAULT_BUFFER: Final = 2000
#: the version of torch's flight-recorder dump format the dumps follow (torch 2.13 writes it)
TORCH_FORMAT_VERSION: Final = "2.10"

STARTED: Final = "started"
SCHEDULED: Final = "scheduled"
COMPLETED: Final = "completed"
FAILED: Final = "failed"

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


def dump_name(group: str, uid: str, rank: int) -> str:
    """The file a rank's dump of a group goes to: ``<group>-<uid>-rank<r>``, the group's name
    kept to letters, digits, ``_`` and ``-``, ``uid`` shortened to the formation's token. No
    extension: torch's analyser reads the rank from the digits the name ends with."""
    safe = re.sub(r"[^A-Za-z0-9_-]", "_", group)
    token = uid.rsplit("-", 1)[-1][:8]
    return f"{safe}-{token}-rank{rank}"


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
        self.device = ""
        self.state = ""
        self.error: str | None = None
        self.start = 0
        self.end = 0


class FlightRecorder:
    """One group's ring of its last ``capacity`` operations (``capacity`` > 0).

    The executor calls :meth:`collective` when a collective takes its sequence number and
    :meth:`finished` when it ends; the group does the same for a blocking ``send``/``recv``
    with :meth:`point_to_point`. Each returns a record number, which :meth:`finished` takes,
    and which is ignored once the ring has reused its slot. Collectives of a group record
    one at a time; point to point operations may record from several threads (record
    numbers come from an atomic counter)."""

    __slots__ = ("_ids", "_p2p_ids", "_slots", "capacity", "epoch_ns")

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"a flight recorder keeps at least one operation, got capacity={capacity}")
        self.capacity = capacity
        self._slots = [_Slot() for _ in range(capacity)]
        self._ids = itertools.count()
        self._p2p_ids = itertools.count(1)
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

    def tensor_collective(self, seq: int, op: str, tensor: torch.Tensor, device: str) -> int:
        """:meth:`collective` of an in-place collective of one tensor (the blocking all_reduce's fast path)."""
        return self.collective(seq, op, (((tensor.shape, tensor.dtype),), None, -1), device)

    def point_to_point(self, op: str, tensor: torch.Tensor, peer: int) -> int:
        """A ``send`` or ``recv`` (``op``) of ``tensor`` with ``peer`` starts."""
        record = next(self._ids)
        s = self._slots[record % self.capacity]
        s.id, s.seq, s.p2p, s.op, s.peer = record, 0, next(self._p2p_ids), op, peer
        s.inputs = ((tensor.shape, tensor.dtype),)
        s.outputs, s.device, s.state, s.error, s.end = None, tensor.device.type, STARTED, None, 0
        s.start = time.monotonic_ns()
        return record

    def finished(self, record: int, error: BaseException | None = None) -> None:
        """Operation ``record`` ended: completed, or failed with ``error``."""
        s = self._slots[record % self.capacity]
        if s.id == record:
            s.end = time.monotonic_ns()
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
    """One slot as pg-core shows it (``debug_state()``, dumps): times in wall-clock nanoseconds."""
    outputs = s.inputs if s.outputs is None else s.outputs
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
        "device": s.device,
        "state": s.state,
        "error": s.error,
        "start_ns": s.start + epoch_ns,
        "end_ns": s.end + epoch_ns if s.end else None,
        "duration_us": (s.end - s.start) / 1e3 if s.end else None,
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
        try:
            self.dumped = write_dump(self._folder, self.state())
        except Exception as exc:  # a full disk or a missing folder must not replace the operation's error
            from .errors import warn_user

            warn_user(f"group {self._name!r}: could not write the flight recorder's dump to {self._folder}: {exc}")


# -- dumps: torch's format -------------------------------------------------------------------------
_TORCH_DTYPE: Final[dict[str, str]] = {
    "float16": "Half",
    "bfloat16": "BFloat16",
    "float32": "Float",
    "float64": "Double",
    "complex64": "ComplexFloat",
    "complex128": "ComplexDouble",
    "bool": "Bool",
    "uint8": "Byte",
    "int8": "Char",
    "int16": "Short",
    "int32": "Int",
    "int64": "Long",
}

#: torch's analyser knows these communication libraries before the colon of an entry's name
_TORCH_LIBS: Final = frozenset({"nccl", "gloo"})


def _torch_lib(backend: str | None, device: str) -> str:
    """The library name an entry gives torch's analyser, which accepts only its own
    (``nccl``, ``gloo``, ...): the backend's name where torch knows it, else by device
    (``nccl`` for cuda, ``gloo`` for the rest); the real backend is in ``pg_core``."""
    if backend in _TORCH_LIBS:
        return backend
    return "nccl" if device == "cuda" else "gloo"


def torch_dump(state: Mapping[str, Any]) -> dict[str, Any]:
    """A group's :meth:`Tracer.state` in torch's flight-recorder dump format (a dict of plain
    values, as torch pickles it), with ``state`` itself under ``"pg_core"``."""
    group, desc = str(state["uid"]), str(state["group"])
    backends: Mapping[str, str] = state.get("backends", {})
    timeout_ms = int(float(state.get("timeout", 0)) * 1000)
    entries = []
    for e in state["entries"]:
        p2p = e["p2p_seq"] is not None
        name = e["op"]
        if p2p:
            me, peer = state["rank"], e.get("peer")
            name = f"{name} {me}->{peer}" if e["op"] == "send" else f"{name} {me}<-{peer}"
        done = e["state"] in (COMPLETED, FAILED)
        entries.append(
            {
                "record_id": e["record_id"],
                "pg_id": 0,
                "process_group": (group, desc),
                "collective_seq_id": e["seq"] or 0,
                "p2p_seq_id": e["p2p_seq"] or 0,
                "op_id": e["record_id"] + 1,
                "profiling_name": f"{_torch_lib(backends.get(e['device']), e['device'])}:{name}",
                "time_created_ns": e["start_ns"],
                "input_sizes": e["input_sizes"],
                "input_dtypes": [_TORCH_DTYPE.get(d, d) for d in e["input_dtypes"]],
                "output_sizes": e["output_sizes"],
                "output_dtypes": [_TORCH_DTYPE.get(d, d) for d in e["output_dtypes"]],
                "state": e["state"],
                "time_discovered_started_ns": e["start_ns"] if e["state"] != SCHEDULED else None,
                "time_discovered_completed_ns": e["end_ns"] if done else None,
                "retired": done,
                "timeout_ms": timeout_ms,
                "is_p2p": p2p,
                "thread_name": "",
                "thread_id": "",
                "frames": [],
            }
        )
        if e["duration_us"] is not None:
            entries[-1]["duration_ms"] = e["duration_us"] / 1e3
    completed = [e["seq"] for e in state["entries"] if e["seq"] and e["state"] == COMPLETED]
    started = [e["seq"] for e in state["entries"] if e["seq"]]
    return {
        "version": TORCH_FORMAT_VERSION,
        "comm_lib_version": "",
        "pg_config": {group: {"name": group, "desc": desc, "ranks": str(list(range(int(state["size"]))))}},
        "pg_status": {
            "0": {
                "last_enqueued_collective": max(started, default=-1),
                "last_started_collective": max(started, default=-1),
                "last_completed_collective": max(completed, default=-1),
            }
        },
        "entries": entries,
        "pg_core": dict(state),
    }


def write_dump(folder: Path, state: Mapping[str, Any]) -> Path:
    """Write ``state`` (:meth:`Tracer.state`) as torch's format to ``folder``/:func:`dump_name`,
    whole or not at all (a temporary file renamed); returns the path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / dump_name(str(state["group"]), str(state["uid"]), int(state["rank"]))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".pg-core-dump-")
    try:
        with os.fdopen(fd, "wb") as f:
            pickle.dump(torch_dump(state), f, protocol=4)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


class _PlainUnpickler(pickle.Unpickler):
    """Loads dicts, lists, tuples, strings and numbers only: no class, no function."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refused {module}.{name}: a flight-recorder dump holds plain values only")


def load_dump(path: Path) -> dict[str, Any]:
    """A dump written by :func:`write_dump` (or torch's recorder), read without loading any
    class; ``ValueError`` naming the file when it is not one."""
    try:
        with open(path, "rb") as f:
            dump = _PlainUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError) as exc:
        raise ValueError(f"{path} is not a flight-recorder dump: {exc}") from None
    if not isinstance(dump, dict) or ("entries" not in dump and "pg_config" not in dump):
        raise ValueError(f"{path} is not a flight-recorder dump (no 'entries' or 'pg_config')")
    return dump


# -- merging a job's dumps -------------------------------------------------------------------------
def _calls(state: Mapping[str, Any]) -> dict[int, dict[str, Any]]:
    """A rank's collectives by sequence number."""
    return {e["seq"]: e for e in state.get("entries", ()) if e.get("seq")}


def _call_text(e: Mapping[str, Any]) -> str:
    sizes = ", ".join(f"{d}{list(s)}" for s, d in zip(e["input_sizes"], e["input_dtypes"], strict=False))
    state = e["state"] if not e.get("error") else f"{e['state']}: {e['error']}"
    return f"{e['op']} #{e['seq']}{f' {sizes}' if sizes else ''} ({state})"


def _signature(e: Mapping[str, Any]) -> tuple[Any, ...]:
    return (e["op"], e.get("root"), str(e["input_sizes"]), str(e["input_dtypes"]), str(e["output_sizes"]))


def merge(states: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Merge ranks' dumped states (the ``"pg_core"`` part of each dump) into one report per
    group formation: the ranks dumped and not, where each stands (its head), and the first
    sequence number at which the ranks' recorded collectives differ (a rank without it, or
    another op, root, shape or dtype), looked for where every dumped rank's ring still
    reaches."""
    by_group: dict[str, dict[int, Mapping[str, Any]]] = {}
    for state in states:
        by_group.setdefault(str(state["uid"]), {})[int(state["rank"])] = state
    out = []
    for uid, ranks in sorted(by_group.items()):
        first = next(iter(ranks.values()))
        size = int(first["size"])
        calls = {r: _calls(s) for r, s in ranks.items()}
        oldest = max((min(c, default=1) for c in calls.values()), default=1)
        newest = max((max(c, default=0) for c in calls.values()), default=0)
        divergence: dict[str, Any] | None = None
        for seq in range(oldest, newest + 1):
            found = {r: c.get(seq) for r, c in calls.items()}
            kinds = {None if e is None else _signature(e) for e in found.values()}
            if len(kinds) > 1:
                divergence = {
                    "seq": seq,
                    "ranks": {str(r): None if e is None else _call_text(e) for r, e in sorted(found.items())},
                }
                break
        heads = {}
        for r, s in sorted(ranks.items()):
            heads[str(r)] = head_of(s.get("entries", []))
        report_seq: int = divergence["seq"] if divergence else newest
        text_heads = {r: heads.get(str(r)) for r in range(size)}
        out.append(
            {
                "group": first["group"],
                "uid": uid,
                "size": size,
                "backends": first.get("backends", {}),
                "dumped": sorted(ranks),
                "not_heard": [r for r in range(size) if r not in ranks],
                "heads": heads,
                "where": where(report_seq, text_heads) if report_seq else "",
                "where_seq": report_seq,
                "divergence": divergence,
                "reports": {str(r): s["report"]["text"] for r, s in sorted(ranks.items()) if s.get("report")},
                "torch_prefix": dump_name(str(first["group"]), uid, 0)[: -len("0")],
            }
        )
    return out


def merged_text(groups: Sequence[Mapping[str, Any]], folder: str) -> str:
    """:func:`merge`'s report as a person reads it."""
    lines: list[str] = []
    for g in groups:
        backends = ", ".join(f"{d}: {n}" for d, n in g["backends"].items())
        lines.append(
            f"group {g['group']!r} ({g['uid']}), size {g['size']}{f', backends {backends}' if backends else ''}"
        )
        lines.append(f"  dumps from rank(s) {', '.join(map(str, g['dumped']))}")
        if g["not_heard"]:
            lines.append(
                f"  not heard from: rank(s) {', '.join(map(str, g['not_heard']))} (no dump: dead, stuck outside "
                "pg-core, or their operations did not fail)"
            )
        d = g["divergence"]
        if d is None:
            lines.append("  the recorded collectives agree on every rank")
        else:
            lines.append(f"  first divergence at collective #{d['seq']}:")
            missing = f"no collective #{d['seq']} recorded"
            for r, text in d["ranks"].items():
                lines.append(f"    rank {r}: {text if text is not None else missing}")
        if g["where"]:
            lines.append(f"  who is where at #{g['where_seq']}: {g['where']}")
        for r, text in g["reports"].items():
            lines.append(f"  rank {r} reported: {text}")
        lines.append(
            "  torch's analyser: python -m torch.distributed.flight_recorder.fr_trace "
            f"{folder} -p {g['torch_prefix']} --allow-incomplete-ranks"
        )
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
