"""The ``eager_limit`` conformance test: point to point on both sides of the declared eager limit.

Not drawn: deterministic, two ranks of the smallest world size >= 2 (the others form the group and
wait), one pool job per device. The contract (:mod:`pg_core.backend`, API 1.10): a blocking ``send``
or ``send_bytes`` of at most :attr:`~pg_core.backend.Capabilities.eager_limit_bytes` returns without
waiting for its receiver; a larger one may wait until the matching receive is posted; ``isend`` need
not copy, but once its ``Work`` completed the tensor is the caller's again.

For every declared point-to-point dtype, at sizes around the limit (:func:`sizes_for`: the largest
whole number of elements at most the limit and one element less, one element more and about four
times the limit; with no limit, one element, 64 KiB and 1 MiB, all eager):

* **eager** (check ``eager-limit``), sizes at most the limit: rank 0's blocking ``send`` must return
  while rank 1 has not posted its receive: rank 1 waits, through the store, until rank 0 says its send
  returned (at most :data:`EAGER_WINDOW_S`), and only then receives. The same for a byte message on the
  group's message path (the backend's ``send_bytes``, or pg-core's emulation on ``uint8`` sends).
* **posted first**: rank 1 posts ``irecv``, then rank 0 makes a blocking ``send`` to it, then rank 1
  waits: what MPI and torch call the correct program above the limit. (Not in both directions at
  once: on NCCL a receive runs in its stream's order, so two ranks that each post a receive before
  their send wait for each other on the GPU; the exchange below is the two-way case.)
* **exchange**: each rank ``isend``\\ s to the other and ``irecv``\\ s from it (rank 0 sends first, rank
  1 receives first), then waits for both: two ranks exchanging messages this way never deadlock.
* **isend**: rank 0 ``isend``\\ s, waits for the work, and at once overwrites its tensor; rank 1
  receives afterwards (at most the limit: posted once rank 0 said so; above it: posted before), and
  must get the bytes the tensor held when ``isend`` was called. An ``isend`` may read the tensor until
  its work completes (it need not copy), never after.
* above the limit, a byte message from rank 0 to rank 1 (rank 1 receiving as it comes) arrives whole.

Every message must arrive with exactly its bytes (check ``reference``); a case that does not finish
fails ``deadline`` with every rank's stacks, and a call that raises fails ``declared-must-pass``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..dtypes import dtype_name
from .cases import dtype_of
from .receives import pattern

if TYPE_CHECKING:
    from .harness import Conformance

__all__ = ["EAGER_WINDOW_S", "check_eager_limit", "eager_plan", "run_eager", "sizes_for"]

#: How long rank 1 waits for rank 0 to say that a send of at most the limit returned, before it
#: posts its receive anyway (so that a send that waits for it finishes) and reports the send late.
#: A send that buffers returns in milliseconds; the rest is for a loaded machine.
EAGER_WINDOW_S = 3.0
#: The sizes (bytes) checked where a backend declares no limit: every send is eager.
UNLIMITED_SIZES: tuple[int, ...] = (64 << 10, 1 << 20)
_FIRST_TAG = 3000


@dataclass(frozen=True)
class Case:
    """One message exchange: ``how`` (``eager``, ``posted``, ``exchange``, ``isend``, ``bytes``,
    ``bytes-above``) with ``numel`` elements of ``dtype`` (bytes: ``numel`` bytes) on ``tag``."""

    how: str
    dtype: str
    numel: int
    tag: int
    within: bool  # at most the limit

    def nbytes(self) -> int:
        if self.how.startswith("bytes"):
            return self.numel
        return self.numel * torch.empty(0, dtype=dtype_of(self.dtype)).element_size()

    def describe(self, limit: int | None) -> str:
        declared = "no eager limit" if limit is None else f"eager_limit_bytes={limit}"
        size = f"{self.numel} {self.dtype} element(s) ({self.nbytes()} bytes)"
        ways = {
            "eager": f"rank 0's blocking send of {size} to rank 1, which posted its receive only once rank 0 "
            "said the send had returned",
            "posted": f"rank 1 posted irecv, then rank 0 sent it {size} with a blocking send, then rank 1 waited",
            "exchange": f"ranks 0 and 1 exchanged {size} with isend and irecv (rank 0 sending first, rank 1 "
            "receiving first), then waited for both",
            "isend": f"rank 0's isend of {size} to rank 1, waited for, then its tensor overwritten at once",
            "bytes": f"rank 0's byte message of {self.numel} bytes to rank 1, which received it only once rank 0 "
            "said the send had returned",
            "bytes-above": f"rank 0's byte message of {self.numel} bytes to rank 1, received as it came",
        }
        return f"{ways[self.how]} ({declared})"


def sizes_for(limit: int | None, itemsize: int) -> tuple[list[int], list[int]]:
    """Element counts at most ``limit`` bytes and above it, for elements of ``itemsize`` bytes."""
    if limit is None:
        return [1, *(n // itemsize for n in UNLIMITED_SIZES)], []
    most = limit // itemsize
    at_most = sorted({n for n in (1, most - 1, most) if 0 <= n <= most})
    above = sorted({most + 1, (4 * limit) // itemsize + 1})
    return at_most, above


def eager_plan(dtypes: list[torch.dtype], limit: int | None, messages: bool) -> list[Case]:
    """Every case for the declared point-to-point ``dtypes`` under ``limit`` (``messages``: whether
    byte messages travel on the device)."""
    plan: list[Case] = []

    def add(how: str, dtype: str, numel: int, within: bool) -> None:
        plan.append(Case(how, dtype, numel, _FIRST_TAG + len(plan), within))

    for dtype in dtypes:
        name = dtype_name(dtype)
        at_most, above = sizes_for(limit, torch.empty(0, dtype=dtype).element_size())
        for n in at_most:
            add("eager", name, n, True)
        for n in at_most + above:
            for how in ("posted", "exchange", "isend"):
                add(how, name, n, n in at_most)
    if messages:
        at_most, above = sizes_for(limit, 1)
        for n in at_most:
            add("bytes", "uint8", n, True)
        for n in above:
            add("bytes-above", "uint8", n, False)
    return plan


def _payload(dtype: torch.dtype, numel: int, salt: int) -> torch.Tensor:
    """``numel`` elements of ``dtype`` with deterministic bytes (bool: 0 and 1), different per ``salt``."""
    t = torch.empty(numel, dtype=dtype)
    if numel:
        raw = pattern(numel * t.element_size(), salt)
        t.view(torch.uint8).copy_(raw % 2 if dtype is torch.bool else raw)
    return t


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).clone()


def _first_wrong(got: torch.Tensor, want: torch.Tensor) -> int | None:
    """The first byte where ``got`` differs from ``want`` (-1: another length), or None."""
    if got.numel() != want.numel():
        return -1
    wrong = (got != want).nonzero()
    return int(wrong[0]) if len(wrong) else None


# -- the rank side ---------------------------------------------------------------
def run_eager(
    ctx: Any, backend_ref: str, device_type: str, plan: list[Case], op_timeout: float
) -> list[dict[str, Any]]:
    """Ranks 0 and 1 run every case of ``plan`` in order and report, per case, what happened to them
    (an error, how long a send took, whether rank 1 had to give up waiting for rank 0's word, and
    the first wrong byte of what they received). Other ranks only form the group. A case that went
    wrong on either rank ends the run for both (they agree through the store)."""
    from torch.distributed import PrefixStore

    from ..messages import Endpoint
    from ..store import wait_for
    from ..timeouts import Deadline
    from .receives import _error, _group

    device = torch.device(device_type) if device_type == "cpu" else torch.device(device_type, ctx.rank)
    group = _group(ctx, backend_ref, device_type, op_timeout, "conformance-eager-limit")
    signals = PrefixStore("conformance/eager-limit", ctx.store)
    records: list[dict[str, Any]] = []
    me, peer = ctx.rank, 1 - ctx.rank
    try:
        instance = group._dispatch.instance(device)  # formed on every member (construction may be collective)
        if me > 1:
            return records
        endpoint = Endpoint(instance)
        for k, case in enumerate(plan):
            record: dict[str, Any] = {"error": None, "late": False, "wrong": None, "seconds": None}
            records.append(record)
            dtype = dtype_of(case.dtype)
            sent = _payload(dtype, case.numel, 2 * k + me)  # this rank's message
            want = _bytes_of(_payload(dtype, case.numel, 2 * k + peer))  # the peer's
            into = torch.full((case.numel,), 1 if dtype is torch.bool else 77, dtype=dtype)
            try:
                if case.how in ("eager", "bytes"):
                    wire = instance.tags.message(7)
                    if me == 0:
                        start = time.monotonic()
                        if case.how == "eager":
                            group.send(sent.to(device), 1, case.tag)
                        else:
                            data = bytearray(sent.numpy().tobytes())
                            endpoint.send([memoryview(data)], 1, wire, Deadline("send_bytes", op_timeout))
                        record["seconds"] = time.monotonic() - start
                        signals.set(f"{k}/returned", "1")
                    else:
                        try:
                            wait_for(signals, [f"{k}/returned"], EAGER_WINDOW_S)
                        except Exception:
                            record["late"] = True  # then receive anyway, so that a send waiting for it finishes
                        if case.how == "eager":
                            buf = into.to(device)
                            group.recv(buf, 0, case.tag)
                            record["wrong"] = _first_wrong(
                                _bytes_of(buf), _bytes_of(_payload(dtype, case.numel, 2 * k))
                            )
                        else:
                            got = endpoint.recv(0, wire, Deadline("recv_bytes", op_timeout))
                            raw = torch.frombuffer(bytearray(memoryview(got).cast("B")), dtype=torch.uint8)
                            record["wrong"] = _first_wrong(raw, _bytes_of(_payload(dtype, case.numel, 2 * k)))
                elif case.how == "bytes-above":
                    wire = instance.tags.message(7)
                    if me == 0:
                        data = bytearray(sent.numpy().tobytes())
                        endpoint.send([memoryview(data)], 1, wire, Deadline("send_bytes", op_timeout))
                    else:
                        got = endpoint.recv(0, wire, Deadline("recv_bytes", op_timeout))
                        raw = torch.frombuffer(bytearray(memoryview(got).cast("B")), dtype=torch.uint8)
                        record["wrong"] = _first_wrong(raw, _bytes_of(_payload(dtype, case.numel, 2 * k)))
                elif case.how == "posted":
                    if me == 0:
                        wait_for(signals, [f"{k}/posted"], op_timeout)
                        group.send(sent.to(device), 1, case.tag)
                    else:
                        buf = into.to(device)
                        work = group.irecv(buf, 0, case.tag)
                        signals.set(f"{k}/posted", "1")
                        work.wait()
                        record["wrong"] = _first_wrong(_bytes_of(buf), want)
                elif case.how == "exchange":
                    buf = into.to(device)
                    if me == 0:
                        works = [group.isend(sent.to(device), peer, case.tag), group.irecv(buf, peer, case.tag)]
                    else:
                        works = [group.irecv(buf, peer, case.tag), group.isend(sent.to(device), peer, case.tag)]
                    for work in works:
                        work.wait()
                    record["wrong"] = _first_wrong(_bytes_of(buf), want)
                elif me == 0:  # isend: waited for, then the tensor overwritten at once
                    if not case.within:
                        wait_for(signals, [f"{k}/posted"], op_timeout)
                    source = sent.to(device)
                    group.isend(source, 1, case.tag).wait()
                    source.copy_(into.to(device))
                    signals.set(f"{k}/waited", "1")
                else:
                    buf = into.to(device)
                    if case.within:
                        try:
                            wait_for(signals, [f"{k}/waited"], EAGER_WINDOW_S)
                        except Exception:
                            record["late"] = True
                        group.recv(buf, 0, case.tag)
                    else:
                        work = group.irecv(buf, 0, case.tag)
                        signals.set(f"{k}/posted", "1")
                        work.wait()
                    record["wrong"] = _first_wrong(_bytes_of(buf), _bytes_of(_payload(dtype, case.numel, 2 * k)))
            except Exception as exc:
                record["error"] = _error(exc)
            # both ranks go on only if both got through this case
            signals.set(f"{k}/verdict/{me}", "ok" if _fine(record) else "failed")
            wait_for(signals, [f"{k}/verdict/{peer}"], 3 * op_timeout + EAGER_WINDOW_S)
            if not _fine(record) or signals.get(f"{k}/verdict/{peer}") != b"ok":
                break
    finally:
        group.shutdown()
    return records


def _fine(record: dict[str, Any]) -> bool:
    return record["error"] is None and not record["late"] and record["wrong"] is None


# -- the controller side ----------------------------------------------------------
def check_eager_limit(suite: Conformance) -> None:
    """Run the ``eager_limit`` test on ``suite``'s backend; raise ``ConformanceFailure`` on the first failure."""
    from .harness import NotApplicable
    from .receives import _run

    sizes = [n for n in suite.world_sizes if n >= 2]
    if not sizes:
        raise NotApplicable("a send needs a receiver: a world size >= 2")
    target = suite.target()
    n = sizes[0]
    notes = []
    ran = False
    for device in suite.devices:
        dtypes = target.p2p_dtypes(device)
        if not dtypes:
            continue
        ran = True
        limit = suite.caps[device].eager_limit_bytes
        plan = eager_plan(dtypes, limit, bool(target.messages(device)))
        results = _run(suite, n, run_eager, suite.rank_ref, device, plan, suite.profile.op_timeout, test="eager_limit")
        slowest = _judge(plan, results, limit=limit, device=device)
        suite.calls["eager_limit"]["send/recv around the limit"] += len(plan)
        suite.examples["eager_limit"] += 1
        suite.sizes["eager_limit"][n] += 1
        declared = "no limit" if limit is None else f"eager_limit_bytes={limit}"
        largest = max(c.nbytes() for c in plan)
        notes.append(
            f"{device}: {declared}; {len(plan)} exchanges of {len(dtypes)} dtypes up to {largest} bytes "
            f"(eager sends returned within {slowest:.3f} s before their receivers posted)"
        )
    if not ran:
        raise NotApplicable("send/recv are not declared")
    suite.notes["eager_limit"] = "; ".join(notes)


def _judge(plan: list[Case], results: list[Any], *, limit: int | None, device: str) -> float:
    """Raise ``ConformanceFailure`` for the first case that went wrong; the slowest eager send (s)."""
    from .harness import ConformanceFailure
    from .receives import _said

    slowest = 0.0
    sender, receiver = results[0], results[1]
    rule = (
        "every blocking send must return without waiting for its receiver (the backend declares no eager limit)"
        if limit is None
        else f"a blocking send of at most eager_limit_bytes={limit} bytes must return without waiting for its receiver"
    )
    for k, case in enumerate(plan):
        name = f"on {device}: {case.describe(limit)}"
        if k >= len(sender) or k >= len(receiver):
            raise ConformanceFailure("declared-must-pass", f"{name}: the ranks never got there")
        for rank, rec in ((0, sender[k]), (1, receiver[k])):
            if rec["error"] is not None:
                raise ConformanceFailure(
                    "declared-must-pass", f"{name}: rank {rank}'s call failed: {_said(rec['error'])}"
                )
        if receiver[k]["late"]:
            what = "rank 0's send" if case.how != "isend" else "rank 0's isend and its wait()"
            took = sender[k]["seconds"]
            after = f" (it returned after {took:.2f} s, once rank 1 had posted its receive)" if took is not None else ""
            raise ConformanceFailure(
                "eager-limit",
                f"{name}: {what} did not return within {EAGER_WINDOW_S:g} s while rank 1 had not posted its "
                f"receive{after}: {rule}. A send that waits for its receiver above some size declares that size as "
                "Capabilities(eager_limit_bytes=...)",
            )
        if case.how in ("eager", "bytes") and sender[k]["seconds"] is not None:
            slowest = max(slowest, float(sender[k]["seconds"]))
        for rank, rec in ((0, sender[k]), (1, receiver[k])):
            wrong = rec["wrong"]
            if wrong is None:
                continue
            where = "another length" if wrong == -1 else f"byte {wrong} differs from what was sent"
            extra = (
                "; rank 0 overwrote its tensor as soon as the isend's wait() returned, so the backend read the "
                "tensor after its work had completed (an isend need not copy, but once its work is complete the "
                "tensor is the caller's again)"
                if case.how == "isend"
                else ""
            )
            raise ConformanceFailure("reference", f"{name}: rank {rank} received {where}{extra}")
    return slowest
