"""The ``receives`` conformance test: what a receive does with a message it did not expect, and
byte messages at their edges.

Not drawn: deterministic, two ranks of the smallest world size >= 2 (the others form the group and
wait), one pool job for each half.

**Mismatches** (check ``receive-mismatch``). Rank 0 sends rank 1 a message that does not fit the
receive rank 1 posts: one element short, one element long, empty, non-empty into an empty
receive, and (where two declared dtypes have one element size) the same bytes as another dtype.
Each is received every way the backend declares: ``recv`` with the message already there, ``irecv``
posted before it is sent, and, where ``recv_anysource`` is declared, both from any source. The
receive buffer is filled with sentinel bytes first. The contract (:mod:`pg_core.backend`):

* a size mismatch raises :class:`~pg_core.errors.CollectiveMismatchError` (a backend declaring
  ``Capabilities(checks_message_size=False)``: :class:`~pg_core.errors.CollectiveTimeout` at the
  receive's timeout): it never returns with the buffer truncated, zero-padded or partly written.
  The buffer it raises with holds, byte for byte, what it held before or the message's byte at
  that offset: a zero-copy receive that learns the message's size only as it completes (pg-mpi's
  ``MPI_Irecv`` into the tensor) may have written the part of the message that fits, and nothing
  else (no zeros, no scratch);
* a dtype mismatch of the same byte count raises the same way where the wire carries dtypes, or
  delivers the sent bytes exactly where it does not (both are allowed);
* where sizes are checked, the refused message is consumed and the stream stays in step: a
  message of the right size that follows on the same (peer, tag) arrives intact (pg-tcp, pg-gloo
  and pg-mpi all drain a refused message, as MPI's receive consumes a truncated one).

**Byte messages** (check ``byte-messages``). Where values travel (``send_bytes``/``recv_bytes``,
or pg-core's emulation on ``uint8`` sends), rank 0 sends rank 1 messages of 0, 1 and odd lengths and
of one byte below, at and above every threshold the in-repo backends and the core switch protocol
at (:data:`THRESHOLDS`), their parts laid out as one buffer, with empty parts around and between
them, or only empty parts: each must arrive with exactly its length and its bytes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..dtypes import dtype_name
from ..messages import EAGER_BYTES
from .cases import dtype_of

if TYPE_CHECKING:
    from .harness import Conformance

__all__ = ["THRESHOLDS", "check_receives", "run_byte_messages", "run_mismatches"]

#: Message sizes (bytes) where a transport changes how it moves a message: pg-core's emulated
#: first chunk (its payload, and its whole size), pg-tcp's 64 KiB scratch reads and 1 MiB mmap'd
#: receives, 256 KiB (pg-mpi copied through a pool above it before API 1.10), pg-gloo's 4 MiB inline
#: limit, and 4 KiB for a page and pg-mpi's eager limit.
THRESHOLDS: tuple[int, ...] = (EAGER_BYTES - 8, EAGER_BYTES, 4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20)
#: Elements of the receive in the mismatch cases.
ELEMENTS = 6
#: The dtype mismatches' pairs (one element size), the first with both sides declared is used.
SAME_SIZE = (
    (torch.float32, torch.int32),
    (torch.int64, torch.float64),
    (torch.float16, torch.bfloat16),
    (torch.int16, torch.float16),
    (torch.uint8, torch.int8),
)
#: The timeout of a receive that can only end at its timeout (``checks_message_size=False``).
BLIND_TIMEOUT_S = 1.0
_FIRST_TAG = 1000


@dataclass(frozen=True)
class Mismatch:
    """One case: rank 0 sends ``sent`` (dtype, elements) on ``tag``; rank 1 receives into ``into`` ``how``."""

    case: str
    how: str  # "recv" (the message is there first), "irecv" (posted first), "any", "any-irecv"
    sent: tuple[str, int]
    into: tuple[str, int]
    tag: int

    def describe(self) -> str:
        ways = {
            "recv": "a blocking recv (the message already there)",
            "irecv": "an irecv posted before the message was sent",
            "any": "a blocking recv from any source (the message already there)",
            "any-irecv": "an irecv from any source posted before the message was sent",
        }
        return (
            f"rank 0 sent {self.sent[1]} {self.sent[0]} element(s) on tag {self.tag}; rank 1 received it with "
            f"{ways[self.how]} into {self.into[1]} {self.into[0]} element(s) ({self.case})"
        )


def mismatch_plan(dtypes: list[torch.dtype], any_source: bool) -> list[Mismatch]:
    """Every mismatch case for the declared point-to-point ``dtypes``."""
    plain = [d for d in dtypes if d is not torch.bool]
    if not plain:
        return []
    base = torch.float32 if torch.float32 in plain else plain[0]
    b = dtype_name(base)
    cases: list[tuple[str, tuple[str, int], tuple[str, int]]] = [
        ("one element short", (b, ELEMENTS - 1), (b, ELEMENTS)),
        ("one element long", (b, ELEMENTS + 1), (b, ELEMENTS)),
        ("an empty message", (b, 0), (b, ELEMENTS)),
        ("into an empty receive", (b, ELEMENTS), (b, 0)),
    ]
    pair = next(((x, y) for x, y in SAME_SIZE if x in plain and y in plain), None)
    if pair is not None:
        cases.append(
            ("another dtype, the same bytes", (dtype_name(pair[1]), ELEMENTS), (dtype_name(pair[0]), ELEMENTS))
        )
    ways = ["recv", "irecv"] + (["any", "any-irecv"] if any_source else [])
    plan: list[Mismatch] = []
    for how in ways:
        for case, sent, into in cases:
            plan.append(Mismatch(case, how, sent, into, _FIRST_TAG + len(plan)))
    return plan


def byte_plan() -> list[list[int]]:
    """The byte messages, as their parts' lengths."""
    sizes = sorted({0, 1, 7, 13, *(t + d for t in THRESHOLDS for d in (-1, 0, 1))})
    plan: list[list[int]] = [[0, 0, 0]]
    for i, size in enumerate(sizes):
        layout = i % 3
        if layout == 0:
            plan.append([size])
        elif layout == 1:
            plan.append([0, size, 0])
        else:
            half = size // 2 + (size % 2)
            plan.append([half, 0, size - half])
    return plan


def pattern(nbytes: int, salt: int) -> torch.Tensor:
    """``nbytes`` deterministic bytes (a uint8 tensor), different per ``salt``.

    Byte ``i`` is ``(131 * i + 17 * salt + nbytes) % 251``, which repeats every 251 bytes: one
    period is computed and tiled (the suite fills messages of several MiB for every dtype).
    """
    period = ((torch.arange(251, dtype=torch.int64) * 131 + salt * 17 + nbytes) % 251).to(torch.uint8)
    return period.repeat(-(-nbytes // 251))[:nbytes]


def _filled(dtype: torch.dtype, numel: int, salt: int) -> torch.Tensor:
    t = torch.empty(numel, dtype=dtype)
    if numel:
        t.view(torch.uint8).copy_(pattern(numel * t.element_size(), salt))
    return t


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).clone()


# -- the rank side ---------------------------------------------------------------
def _group(ctx: Any, backend_ref: str, device_type: str, op_timeout: float, name: str) -> Any:
    from ..backend_refs import resolve_backend_ref
    from ..group import ProcessGroup

    spec = resolve_backend_ref(backend_ref, device_type, factories=False)
    return ProcessGroup(ctx.store, ctx.rank, ctx.size, backends={device_type: spec}, name=name, timeout=op_timeout)


def group_caps(backend_ref: str, device_type: str) -> Any:
    from ..backend_refs import resolve_backend_ref

    return resolve_backend_ref(backend_ref, device_type, factories=False).capabilities_for(device_type)


def _error(exc: BaseException) -> dict[str, Any]:
    return {"type": type(exc).__name__, "mro": [c.__name__ for c in type(exc).__mro__], "message": str(exc)[:1000]}


def run_mismatches(
    ctx: Any, backend_ref: str, device_type: str, plan: list[Mismatch], op_timeout: float
) -> list[dict[str, Any]]:
    """Rank 0 sends every case's message (and, where the backend checks sizes, a right-sized one
    after it on the same tag); rank 1 receives both and reports what happened. Other ranks only
    form the group."""
    from torch.distributed import PrefixStore

    from ..store import wait_for

    device = torch.device(device_type) if device_type == "cpu" else torch.device(device_type, ctx.rank)
    group = _group(ctx, backend_ref, device_type, op_timeout, "conformance-receives")
    blind = not group_caps(backend_ref, device_type).checks_message_size
    signals = PrefixStore("conformance/receives", ctx.store)
    records: list[dict[str, Any]] = []
    try:
        group.form_backend(device)  # on every member (a backend's construction may be collective)
        for k, m in enumerate(plan):
            record: dict[str, Any] = {"error": None, "follow_error": None}
            records.append(record)
            into_dtype, into_n = dtype_of(m.into[0]), m.into[1]
            posted_first = m.how in ("irecv", "any-irecv")
            if ctx.rank == 0:
                try:
                    if posted_first:
                        wait_for(signals, [f"{k}/posted"], op_timeout)
                    group.send(_filled(dtype_of(m.sent[0]), m.sent[1], k).to(device), 1, m.tag)
                    if not blind:
                        group.send(_filled(into_dtype, into_n, k + 5000).to(device), 1, m.tag)
                    if not posted_first:
                        signals.set(f"{k}/sent", "1")
                    wait_for(signals, [f"{k}/done"], 3 * op_timeout)
                except Exception as exc:
                    record["error"] = _error(exc)
                    break
            elif ctx.rank == 1:
                buf = _filled(into_dtype, into_n, k + 9000).to(device)
                timeout = BLIND_TIMEOUT_S if blind else op_timeout
                src = None if m.how.startswith("any") else 0
                try:
                    if posted_first:
                        work = group.irecv(buf, src, m.tag, timeout=timeout)
                        signals.set(f"{k}/posted", "1")
                        work.wait()
                    else:
                        wait_for(signals, [f"{k}/sent"], op_timeout)
                        group.recv(buf, src, m.tag, timeout=timeout)
                except Exception as exc:
                    record["error"] = _error(exc)
                record["buffer"] = _bytes_of(buf)
                if not blind:
                    follow = _filled(into_dtype, into_n, k + 9000).to(device)
                    try:
                        group.recv(follow, 0, m.tag)
                    except Exception as exc:
                        record["follow_error"] = _error(exc)
                    record["follow"] = _bytes_of(follow)
                signals.set(f"{k}/done", "1")
    finally:
        group.shutdown()
    return records


def run_byte_messages(
    ctx: Any, backend_ref: str, device_type: str, plan: list[list[int]], op_timeout: float
) -> list[dict[str, Any]]:
    """Rank 0 sends every message of ``plan`` (its parts' lengths) as one message on the group's
    message path (the backend's ``send_bytes`` where it has one, else pg-core's emulation); rank 1
    receives them in order and reports each one's length and its first wrong byte."""
    from torch.distributed import PrefixStore

    from ..messages import Endpoint
    from ..store import wait_for
    from ..timeouts import Deadline

    device = torch.device(device_type) if device_type == "cpu" else torch.device(device_type, ctx.rank)
    group = _group(ctx, backend_ref, device_type, op_timeout, "conformance-byte-messages")
    signals = PrefixStore("conformance/byte-messages", ctx.store)
    records: list[dict[str, Any]] = []
    try:
        instance = group._dispatch.instance(device)
        endpoint = Endpoint(instance)
        tag = instance.tags.message(7)
        for i, lengths in enumerate(plan):
            total = sum(lengths)
            want = pattern(total, i)
            if ctx.rank == 0:
                data = bytearray(want.numpy().tobytes())
                view = memoryview(data)
                parts: list[Any] = []
                at = 0
                for j, n in enumerate(lengths):
                    parts.append(bytes(view[at : at + n]) if j % 2 else view[at : at + n])
                    at += n
                try:
                    endpoint.send(parts, 1, tag, Deadline("send_bytes", op_timeout))
                except Exception as exc:
                    records.append({"error": _error(exc)})
                    break
            elif ctx.rank == 1:
                try:
                    got = endpoint.recv(0, tag, Deadline("recv_bytes", op_timeout))
                except Exception as exc:
                    records.append({"error": _error(exc)})
                    break
                raw = memoryview(got).cast("B")
                length = len(raw)
                common = min(length, total)  # the bytes both have: where they first differ
                first_wrong = None
                if common:
                    received = torch.frombuffer(bytearray(raw[:common]), dtype=torch.uint8)
                    wrong = (received != want[:common]).nonzero()
                    first_wrong = int(wrong[0]) if len(wrong) else None
                records.append({"error": None, "length": length, "first_wrong": first_wrong})
        # the sender's group lives until everything was received
        if ctx.rank == 1:
            signals.set("received", "1")
        elif ctx.rank == 0:
            wait_for(signals, ["received"], 3 * op_timeout)
    finally:
        group.shutdown()
    return records


# -- the controller side ----------------------------------------------------------
def check_receives(suite: Conformance) -> None:
    """Run the ``receives`` test on ``suite``'s backend; raise ``ConformanceFailure`` on the first failure."""
    from .harness import NotApplicable

    sizes = [n for n in suite.world_sizes if n >= 2]
    if not sizes:
        raise NotApplicable("a receive needs a sender: a world size >= 2")
    target = suite.target()
    n = sizes[0]
    ran = False
    notes = []
    for device in suite.devices:
        dtypes = target.p2p_dtypes(device)
        plan = mismatch_plan(dtypes, bool(target.any_source(device)))
        if plan:
            ran = True
            blind = not suite.caps[device].checks_message_size
            results = _run(suite, n, run_mismatches, suite.rank_ref, device, plan, suite.profile.op_timeout)
            _judge_mismatches(plan, results, blind=blind, device=device)
            suite.calls["receives"]["recv (mismatched)"] += len(plan)
            ways = sorted({m.how for m in plan})
            expected = "CollectiveTimeout (sizes not checked)" if blind else "CollectiveMismatchError"
            notes.append(f"{device}: {len(plan)} mismatched receives ({', '.join(ways)}), {expected}")
        if target.messages(device):
            ran = True
            messages = byte_plan()
            results = _run(suite, n, run_byte_messages, suite.rank_ref, device, messages, suite.profile.op_timeout)
            _judge_bytes(messages, results, device=device)
            suite.calls["receives"]["byte messages"] += len(messages)
            longest = max(sum(m) for m in messages)
            notes.append(f"{device}: {len(messages)} byte messages, 0 to {longest} bytes, empty parts included")
        suite.examples["receives"] += 1
        suite.sizes["receives"][n] += 1
    if not ran:
        raise NotApplicable("send/recv are not declared")
    suite.notes["receives"] = "; ".join(notes)


def _run(suite: Conformance, n: int, fn: Any, *args: Any, test: str = "receives") -> list[Any]:
    """Run ``fn(ctx, *args)`` on the pool of world size ``n`` for conformance test ``test``."""
    from .harness import ConformanceFailure
    from .pool import RanksFailed

    start = time.monotonic()
    try:
        return suite.pool(n).run(fn, *args, timeout=suite.profile.deadline + 4 * suite.profile.op_timeout)
    except RanksFailed as exc:
        outcomes = exc.outcomes.values()
        if any("did not finish" in o for o in outcomes):
            check = "deadline"
        elif any(o.startswith("died") for o in outcomes):
            check = "rank-died"
        elif any("leaked" in o for o in outcomes):
            check = "leak"
        else:
            check = "rank-error"
        raise ConformanceFailure(check, f"{test}, world size {n}:\n{exc}") from None
    finally:
        suite.seconds[test] += time.monotonic() - start


def _said(err: dict[str, Any] | None) -> str:
    return "it returned normally" if err is None else f"it raised {err['type']}: {err['message'][:300]}"


def _changed(got: torch.Tensor, before: torch.Tensor, message: torch.Tensor) -> str:
    """How a receive buffer differs from what it held before the receive."""
    wrong = (got != before).nonzero()
    first = int(wrong[0])
    what = f"{len(wrong)} of its {got.numel()} bytes changed, the first at byte {first}"
    common = min(got.numel(), message.numel())
    if common and torch.equal(got[:common], message[:common]):
        tail = got[common:]
        if tail.numel() and not bool(tail.any()):
            return what + " (it holds the message's bytes, then zeros: zero-padded)"
        return what + f" (it holds the message's first {common} bytes: truncated or partly written)"
    return what


def _written_in_place(got: torch.Tensor, before: torch.Tensor, message: torch.Tensor) -> bool:
    """Every byte of the buffer is what it held, or the message's byte at that offset: what a
    zero-copy receive that learns the size only as it completes (MPI's) may leave behind."""
    common = min(got.numel(), message.numel())
    ours = (got[:common] == before[:common]) | (got[:common] == message[:common])
    return bool(ours.all()) and torch.equal(got[common:], before[common:])


def _judge_mismatches(plan: list[Mismatch], results: list[Any], *, blind: bool, device: str) -> None:
    from .harness import ConformanceFailure

    sender, receiver = results[0], results[1]
    for k, m in enumerate(plan):
        if k < len(sender) and sender[k]["error"] is not None:
            raise ConformanceFailure(
                "declared-must-pass", f"on {device}: {m.describe()}: rank 0's send failed: {_said(sender[k]['error'])}"
            )
        if k >= len(receiver):
            raise ConformanceFailure("declared-must-pass", f"on {device}: {m.describe()}: rank 1 never got there")
        rec = receiver[k]
        err = rec["error"]
        into = dtype_of(m.into[0])
        before = _bytes_of(_filled(into, m.into[1], k + 9000))
        message = _bytes_of(_filled(dtype_of(m.sent[0]), m.sent[1], k))
        got: torch.Tensor = rec["buffer"]
        untouched = torch.equal(got, before)
        in_place = untouched or _written_in_place(got, before, message)
        # a backend that declares it cannot see sizes may still see this one
        refusals = {"CollectiveMismatchError", "CollectiveTimeout"} if blind else {"CollectiveMismatchError"}
        same_bytes = m.sent[0] != m.into[0] and m.sent[1] == m.into[1]
        delivered = err is None and same_bytes and torch.equal(got, message)
        refused = err is not None and bool(refusals & set(err["mro"]))
        if not delivered and not (refused and in_place):
            if refused:
                problem = (
                    f"it raised {err['type']} as it must, but the receive buffer holds bytes that are neither its own "
                    f"nor the message's at their offset: {_changed(got, before, message)}"
                )
            else:
                problem = _said(err)
                if not untouched:
                    problem += f", and the receive buffer was written: {_changed(got, before, message)}"
            allowed = (
                "the same bytes as another dtype may also be delivered exactly, where the wire carries no dtype; "
                if same_bytes
                else ""
            )
            rule = (
                "the backend declares checks_message_size=False, so it must fail at the receive's timeout "
                f"({BLIND_TIMEOUT_S:g} s here) with CollectiveTimeout (or raise CollectiveMismatchError)"
                if blind
                else "it must raise CollectiveMismatchError naming the sender (a backend that cannot see sizes "
                "declares Capabilities(checks_message_size=False) and fails at the timeout instead)"
            )
            raise ConformanceFailure(
                "receive-mismatch",
                f"on {device}: {m.describe()}: {problem}. The message does not fit the receive: {rule}, never "
                f"return with it truncated, zero-padded or partly written; {allowed}the buffer is left as it was, "
                "or (a zero-copy receive that learns the size too late) holds the message's bytes at their offsets",
            )
        if blind:
            continue
        follow = _bytes_of(_filled(into, m.into[1], k + 5000))
        if rec["follow_error"] is not None or not torch.equal(rec["follow"], follow):
            what = (
                _said(rec["follow_error"]) if rec["follow_error"] is not None else "it holds other bytes than were sent"
            )
            raise ConformanceFailure(
                "receive-mismatch",
                f"on {device}: {m.describe()}, which was refused; then rank 0 sent a message of the right size on "
                f"the same tag, and rank 1's recv of it went wrong: {what}. A refused message is consumed, so the "
                "stream stays in step",
            )


def _judge_bytes(plan: list[list[int]], results: list[Any], *, device: str) -> None:
    from .harness import ConformanceFailure

    sender, receiver = results[0], results[1]
    if sender and sender[-1].get("error") is not None:
        raise ConformanceFailure(
            "declared-must-pass",
            f"on {device}: byte message #{len(sender) - 1} (parts of {plan[len(sender) - 1]} bytes): rank 0's send "
            f"failed: {_said(sender[-1]['error'])}",
        )
    for i, lengths in enumerate(plan):
        total = sum(lengths)
        name = f"on {device}: byte message #{i} of {total} bytes (sent as parts of {lengths} bytes)"
        if i >= len(receiver):
            raise ConformanceFailure("declared-must-pass", f"{name}: rank 1 never received it")
        rec = receiver[i]
        if rec["error"] is not None:
            raise ConformanceFailure("declared-must-pass", f"{name}: rank 1's receive failed: {_said(rec['error'])}")
        if rec["length"] != total:
            raise ConformanceFailure(
                "byte-messages",
                f"{name}: rank 1 received {rec['length']} bytes; a message arrives with exactly its length",
            )
        if rec["first_wrong"] is not None:
            raise ConformanceFailure(
                "byte-messages",
                f"{name}: rank 1 received the right length, but byte {rec['first_wrong']} differs from what was sent",
            )
