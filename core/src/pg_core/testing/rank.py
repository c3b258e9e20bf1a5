"""What a rank process does with a conformance example.

:func:`run_example` runs in every rank of a :class:`~pg_core.testing.pool.RankPool`:
it forms one :class:`~pg_core.ProcessGroup` per top-level lane the rank belongs to
(lanes run concurrently, each on its own thread), makes its inputs with
:func:`~pg_core.testing.buffers.prepare` (values with :mod:`~pg_core.testing.values`),
runs the calls, waits for async ones in the example's order, shuts the groups
down, and returns what it observed: every output and input buffer, every value
it received and every value it sent (as it was afterwards), each call's error (if
any), whether an async call finished before a rank it depends on had called it,
what ``supports()`` said, and the rank, size and ``parent_ranks`` of every
subgroup it formed. A subgroup's lane runs on the subgroup right after the
``split``/``new_group`` call that formed it. It judges nothing; the controller does.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any

import torch

from ..backend import BackendSpec
from ..backend_refs import resolve_backend_ref
from ..errors import CollectiveTimeout
from ..group import P2POp, ProcessGroup
from ..objects import VALUE_COLLECTIVES
from ..ops import RedOpType, ReduceOp
from ..store import wait_for
from ..work import Work
from .buffers import Bufs, collective_input, message_value, plain_buffer, prepare
from .cases import Call, Example, depends_on, dtype_of
from .values import observe, spec_dtypes

__all__ = ["run_dead_peer", "run_example"]

#: How long a rank watches an async call that must not be complete yet.
EARLY_WINDOW_S = 0.05


def _device(device_type: str, rank: int) -> torch.device:
    if device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, device_type)
    count = module.device_count()
    return torch.device(device_type, rank % max(count, 1))


def _error(exc: BaseException) -> dict[str, Any]:
    return {
        "type": type(exc).__name__,
        "mro": [c.__name__ for c in type(exc).__mro__],
        "message": str(exc)[:2000],
        "op": getattr(exc, "op", None),
    }


class _Lane:
    def __init__(
        self,
        ctx: Any,
        ex: Example,
        index: int,
        backend: BackendSpec,
        op_timeout: float,
        *,
        results: dict[int, Any],
    ) -> None:
        self.ctx, self.ex, self.index = ctx, ex, index
        self.results = results  # lane index -> records, shared by the example's lanes (subgroups add theirs)
        self.lane = ex.lanes[index]
        self.me = self.lane.members.index(ctx.rank)
        self.n = len(self.lane.members)
        self.device = _device(ex.device, ctx.rank)
        self.backend = backend
        self.op_timeout = op_timeout
        #: a blocking send above this many bytes may wait for its receiver (None: never waits)
        self.eager_limit = backend.capabilities_for(ex.device).eager_limit_bytes
        from torch.distributed import PrefixStore

        self.signals = PrefixStore(f"conformance/lane{index}", ctx.store)
        self.records: list[dict[str, Any]] = []
        self.works: dict[int, list[Work]] = {}
        self.bufs: dict[int, Bufs] = {}
        self.inputs: dict[int, Any] = {}  # value collective -> what this rank passed
        self.values: dict[int, Any] = {}  # value collective -> what it returned (its Work, if async)
        self.sent: dict[int, dict[int, Any]] = {}  # messages call -> message -> the value sent
        self.received: dict[int, dict[int, Any]] = {}  # messages call -> message -> value, Work or buffer
        #: id of a receive's Work -> (call, receive index): its buffer is read as soon as wait() returns
        self.snapshot_after: dict[int, tuple[int, int]] = {}
        self.at_once: dict[int, dict[int, torch.Tensor]] = {}  # call -> receive index -> buffer read then

    # -- running -------------------------------------------------------------------
    def run(self) -> list[dict[str, Any]]:
        group = ProcessGroup(
            self.ctx.store,
            self.me,
            self.n,
            backends={self.ex.device: self.backend},
            name=f"conformance-lane{self.index}",
            timeout=self.op_timeout,
        )
        try:
            return self.run_on(group)
        finally:
            group.shutdown()

    def run_on(self, group: ProcessGroup) -> list[dict[str, Any]]:
        """Run the lane's calls on ``group`` (formed for this lane); the caller shuts it down."""
        # Form the backend on every member now: a backend's construction may be collective (Gloo's is),
        # and a lane may start with messages that leave some ranks out.
        group.form_backend(self.device)
        coalesced = self.lane.coalesced
        try:
            with group.coalescing(async_op=coalesced == "async") if coalesced else contextlib.nullcontext() as batch:
                for ci, call in enumerate(self.lane.calls):
                    record: dict[str, Any] = {"call": ci, "error": None, "early": None, "supports": None}
                    self.records.append(record)
                    try:
                        self._start(group, ci, call, record)
                    except Exception as exc:
                        record["error"] = _error(exc)
                        if call.op not in ("undeclared", "bad_input"):
                            break
            if batch is not None:
                batch.wait()  # (a blocking block's exit waited already)
        except Exception as exc:  # the batch failed: every call of it did
            for record in self.records:
                record["error"] = record["error"] or _error(exc)
        for ci in self.lane.wait_order:
            for work in self.works.get(ci, []):
                try:
                    work.wait()
                except Exception as exc:
                    if self.records[ci]["error"] is None:
                        self.records[ci]["error"] = _error(exc)
                    continue
                at = self.snapshot_after.get(id(work))
                if at is not None:  # a receive's data must be final once wait() returns: read it at once
                    self.at_once.setdefault(at[0], {})[at[1]] = self.bufs[at[0]].out_bases[at[1]].detach().cpu().clone()
        # Values are observed now, after every call of the lane: a value that a later
        # message overwrote (a reused receive buffer) shows.
        for record in self.records:
            ci = record["call"]
            bufs = self.bufs.get(ci)
            if bufs is not None:
                record["outs"] = [b.detach().cpu().clone() for b in bufs.out_bases]
                record["ins"] = [b.detach().cpu().clone() for b in bufs.in_bases]
            if ci in self.at_once:
                record["at_once"] = self.at_once[ci]
            if ci in self.inputs:
                record["input"] = observe(self.inputs[ci])
            if ci in self.values:
                done, value = _resolved(self.values[ci])
                if done:
                    record["value"] = observe(value)
            if ci in self.sent:
                record["sent"] = {m: observe(v) for m, v in self.sent[ci].items()}
            if ci in self.received:
                got = {}
                for m, held in self.received[ci].items():
                    done, value = _resolved(held)
                    if done:
                        got[m] = observe(value)
                record["received"] = got
        return self.records

    def _signal(self, call: int, rank: int) -> str:
        return f"{call}/{rank}"

    def _start(self, group: ProcessGroup, ci: int, call: Call, record: dict[str, Any]) -> None:
        if call.op == "undeclared":
            self._undeclared(group, call, record)
            return
        if call.op == "bad_input":
            if call.params["caller"] == self.me:
                _bad_input(group, call, self.device)
            return
        if call.op == "timeout":
            self._timeout(group, call, record)
            return
        if call.op in ("split", "new_group"):
            self._subgroup(group, call, record)
            return
        where = (self.ex.seed, self.index, ci)
        record["supports"] = _supports(group, call, self.device)
        if call.op == "messages":
            self._messages(group, ci, call, record)
            return
        if call.op in VALUE_COLLECTIVES:
            obj = collective_input(call, where, self.me, self.device)
            self.inputs[ci] = obj

            def start() -> Any:
                return _invoke_value(group, call, obj, async_op=call.async_op)

        else:
            bufs = prepare(call, where, self.me, self.n).to(self.device)
            self.bufs[ci] = bufs
            if call.op == "p2p":
                self._p2p(group, ci, call, bufs, record)
                return
            if call.op == "any_source":
                self._any_source(group, call, bufs, record)
                return

            def start() -> Any:
                return _invoke(group, call, bufs, self.me, async_op=call.async_op)

        late = call.late if call.async_op and self.n > 1 else None
        if late is not None and self.me == late:
            others = [self._signal(ci, r) for r in range(self.n) if r != late]
            wait_for(self.signals, others, self.op_timeout)  # polled: lanes share the store client
        result = start()
        if call.op in VALUE_COLLECTIVES:
            self.values[ci] = result
        if not call.async_op:
            return
        work = result
        self.works[ci] = [work]
        if late is not None and self.me != late:
            if depends_on(call, self.me, late, self.n):
                record["early"] = _finishes_within(work, EARLY_WINDOW_S)
            self.signals.set(self._signal(ci, self.me), "1")

    def _p2p(self, group: ProcessGroup, ci: int, call: Call, bufs: Bufs, record: dict[str, Any]) -> None:
        msgs = call.params["messages"]
        mode = call.params["mode"]
        sends = [(m, msg) for m, msg in enumerate(msgs) if msg[0] == self.me]
        recvs = [(m, msg) for m, msg in enumerate(msgs) if msg[1] == self.me]
        send_t = dict(zip((m for m, _ in sends), bufs.ins, strict=True))
        recv_t = dict(zip((m for m, _ in recvs), bufs.outs, strict=True))
        order = [m for m in call.params["recv_order"] if m in recv_t]
        received = {m: k for k, (m, _msg) in enumerate(recvs)}  # message -> this rank's receive index
        if mode == "overwrite":
            # Every send's Work waited, then its buffer overwritten at once: what the receivers
            # get (they receive afterwards) must be what was there when isend was called. An
            # isend above the eager limit may complete only once its receiver took it, so a
            # rank that receives such a message posts all its receives first.
            early = (
                []
                if all(self._eager(recv_t[m]) for m in order)
                else [group.irecv(recv_t[m], msgs[m][0], msgs[m][2]) for m in order]
            )
            sent = [group.isend(send_t[m], dst, tag) for m, (_, dst, tag, *_r) in sends]
            for work in sent:
                work.wait()
            for t in send_t.values():
                t.copy_(torch.full_like(t, 1) if t.dtype is torch.bool else torch.full_like(t, 77))
            for work in early:
                work.wait()
            if not early:
                for m in order:
                    group.recv(recv_t[m], msgs[m][0], msgs[m][2])
            return
        if mode == "mixed":
            # Several messages in flight on one (peer, tag), blocking and async alternating:
            # sends first (a send of at most the eager limit does not wait for its receiver;
            # one above it is an isend), then the receives.
            mixed: list[Work] = []
            for i, (m, (_, dst, tag, *_r)) in enumerate(sends):
                if i % 2 or not self._eager(send_t[m]):
                    mixed.append(group.isend(send_t[m], dst, tag))
                else:
                    group.send(send_t[m], dst, tag)
            for i, m in enumerate(order):
                if i % 2:
                    work = group.irecv(recv_t[m], msgs[m][0], msgs[m][2])
                    self.snapshot_after[id(work)] = (ci, received[m])
                    mixed.append(work)
                else:
                    group.recv(recv_t[m], msgs[m][0], msgs[m][2])
            self.works[ci] = mixed[::-1]
            return
        if mode == "blocking":
            # Every rank takes the messages in list order, so a send that waits for its
            # receiver (which the contract allows) cannot deadlock; out-of-order receives
            # are the async and batch modes' business.
            for m, (src, dst, tag, *_r) in enumerate(msgs):
                if src == self.me:
                    group.send(send_t[m], dst, tag)
                elif dst == self.me:
                    group.recv(recv_t[m], src, tag)
            return
        works: list[Work] = []
        if mode == "batch":
            if not order and not sends:
                return  # this rank takes no part: batch_isend_irecv of nothing is an error
            ops = [P2POp(group.irecv, recv_t[m], msgs[m][0], msgs[m][2]) for m in order]
            ops += [P2POp(group.isend, send_t[m], dst, tag) for m, (_, dst, tag, *_r) in sends]
            self.works[ci] = group.batch_isend_irecv(ops)
            return
        for m in order:
            work = group.irecv(recv_t[m], msgs[m][0], msgs[m][2])
            self.snapshot_after[id(work)] = (ci, received[m])
            works.append(work)
        if call.late is not None:
            # Every sender waits until its receivers have posted and looked: a receive
            # that is complete before its sender sent anything reports completion early.
            if works:
                record["early"] = _finishes_within(works[0], EARLY_WINDOW_S) or any(w.is_completed() for w in works)
            self.signals.set(self._signal(ci, self.me), "1")
            dsts = sorted({dst for _, (_, dst, *_r) in sends})
            if dsts:
                wait_for(self.signals, [self._signal(ci, d) for d in dsts], self.op_timeout)
        for m, (_, dst, tag, *_r) in sends:
            works.append(group.isend(send_t[m], dst, tag))
        self.works[ci] = works[::-1]  # waited newest first

    def _eager(self, tensor: torch.Tensor) -> bool:
        """Whether a blocking send of ``tensor`` returns without waiting for its receiver (the
        backend's declared ``eager_limit_bytes``)."""
        return self.eager_limit is None or tensor.numel() * tensor.element_size() <= self.eager_limit

    def _any_source(self, group: ProcessGroup, call: Call, bufs: Bufs, record: dict[str, Any]) -> None:
        """Every other rank sends its messages to the receiver, which receives them in the plan's
        order (from any source, or naming the sender) and records what each receive returned.
        Everything completes within the call, so no receive of a later call can take these."""
        p = call.params
        receiver = p["receiver"]
        if self.me == receiver:
            if p["mode"] == "async":  # posted at once, pending together, then waited in order
                works = [group.irecv(out, src, tag) for out, (src, tag) in zip(bufs.outs, p["plan"], strict=True)]
                record["sources"] = [work.result() for work in works]
            else:
                record["sources"] = [
                    group.recv(out, src, tag) for out, (src, tag) in zip(bufs.outs, p["plan"], strict=True)
                ]
            return
        tags = [tag for src, tag in p["messages"] if src == self.me]
        if p["mode"] == "async":
            for work in [group.isend(t, receiver, tag) for t, tag in zip(bufs.ins, tags, strict=True)]:
                work.wait()
        else:
            # the receiver takes them in its own order: a message above the eager limit is an
            # isend, which a blocking send there may wait for
            pending = []
            for t, tag in zip(bufs.ins, tags, strict=True):
                if self._eager(t):
                    group.send(t, receiver, tag)
                else:
                    pending.append(group.isend(t, receiver, tag))
            for work in pending:
                work.wait()

    def _messages(self, group: ProcessGroup, ci: int, call: Call, record: dict[str, Any]) -> None:
        """Value messages: every rank sends its messages (all first, in the blocking mode),
        then receives its own in the drawn order."""
        msgs = call.params["messages"]
        where = (self.ex.seed, self.index, ci)
        sends = [m for m, msg in enumerate(msgs) if msg[0] == self.me]
        recvs = [m for m in call.params["recv_order"] if msgs[m][1] == self.me]
        values = {m: message_value(call, where, m, self.device) for m in sends}
        buffers = {m: plain_buffer(call, where, m, self.device) for m in recvs if msgs[m][3] == "plain"}
        self.sent[ci] = values
        got: dict[int, Any] = {}
        self.received[ci] = got
        if call.params["mode"] == "blocking" and self.eager_limit is not None:
            # A message's size is not known before it is encoded, and a send above the declared
            # eager limit may wait for its receiver: every rank takes the messages in list order.
            for m, msg in enumerate(msgs):
                if msg[0] == self.me:
                    _send_message(group, msg, values[m], async_op=False)
                elif msg[1] == self.me:
                    value = _recv_message(group, msg, buffers.get(m), async_op=False)
                    got[m] = buffers.get(m, value)
            return
        if call.params["mode"] == "blocking":
            # Sends first: a blocking send must not wait for its receiver (no eager limit is
            # declared), and receives in another order than the sends prove that matching is by
            # (peer, tag).
            for m in sends:
                _send_message(group, msgs[m], values[m], async_op=False)
            for m in recvs:
                value = _recv_message(group, msgs[m], buffers.get(m), async_op=False)
                got[m] = buffers.get(m, value)
            return
        works: list[Work] = []
        for m in recvs:
            work = _recv_message(group, msgs[m], buffers.get(m), async_op=True)
            works.append(work)
            got[m] = buffers.get(m, work)
        if call.late is not None:
            # As in p2p: a receive complete before its sender sent anything reports completion early.
            if works:
                record["early"] = _finishes_within(works[0], EARLY_WINDOW_S) or any(w.is_completed() for w in works)
            self.signals.set(self._signal(ci, self.me), "1")
            dsts = sorted({msgs[m][1] for m in sends})
            if dsts:
                wait_for(self.signals, [self._signal(ci, d) for d in dsts], self.op_timeout)
        for m in sends:
            works.append(_send_message(group, msgs[m], values[m], async_op=True))
        self.works[ci] = works[::-1]  # waited newest first

    def _subgroup(self, group: ProcessGroup, call: Call, record: dict[str, Any]) -> None:
        """Form the subgroup of a ``split`` / ``new_group`` call and run its lane on it."""
        p = call.params
        if call.op == "split":
            color = p["colors"][self.me]
            sub = group.split(color, p["keys"][self.me], name=p.get("name"))
            child = next((li for c, li in p["lanes"] if c == color), None)
        else:
            if self.me not in p["ranks"]:
                return  # non-members never call new_group
            sub = group.new_group(p["ranks"], name=p.get("name"))
            child = p["lane"]
        if sub is None:
            record["formed"] = None
            return
        try:
            parents = sub.parent_ranks
            record["formed"] = {
                "rank": sub.rank,
                "size": sub.size,
                "parent_ranks": None if parents is None else list(parents),
            }
            if child is None:
                return  # color None must give None: the controller reports it
            lane = _Lane(self.ctx, self.ex, child, self.backend, self.op_timeout, results=self.results)
            if (sub.rank, sub.size) != (lane.me, lane.n):
                return  # the controller reports the membership; calls with other ranks could hang
            self.results[child] = lane.run_on(sub)
        finally:
            sub.shutdown()

    def _undeclared(self, group: ProcessGroup, call: Call, record: dict[str, Any]) -> None:
        p = call.params
        device = torch.device(p["device"]) if p.get("device") else self.device
        dtype = dtype_of(call.dtype)
        rop = None
        if p.get("reduce") == "PREMUL_SUM":
            rop = ReduceOp.premul_sum(2.0)
        elif p.get("reduce"):
            rop = ReduceOp(RedOpType[p["reduce"]])
        record["supports"] = group.supports(p["target"], device=device.type, dtype=dtype, reduce_op=rop)
        if p["caller"] != self.me:
            return
        _call_once(group, p["target"], device, dtype, rop)

    def _timeout(self, group: ProcessGroup, call: Call, record: dict[str, Any]) -> None:
        p = call.params
        done = self._signal(-1, p["caller"])
        if p["caller"] != self.me:
            # stay in the group until the caller has timed out: leaving would be a peer failure
            wait_for(self.signals, [done], self.op_timeout + float(p["seconds"]))
            return
        start = time.monotonic()
        try:
            self._timeout_call(group, call)
        finally:
            record["seconds"] = time.monotonic() - start  # how long the call took to give up
            self.signals.set(done, "1")

    def _timeout_call(self, group: ProcessGroup, call: Call) -> None:
        p = call.params
        dtype = dtype_of(call.dtype)
        t = torch.zeros(4, dtype=dtype, device=self.device)
        seconds = float(p["seconds"])
        target = p["target"]
        if target == "recv":
            group.recv(t, p["peer"], tag=int(p.get("tag", 0)), timeout=seconds)
        elif target == "recv_anysource":
            group.recv(t, None, tag=int(p.get("tag", 0)), timeout=seconds)
        elif target == "barrier":
            group.barrier(timeout=seconds)
        elif target == "all_reduce":
            group.all_reduce(t, timeout=seconds)
        elif target == "broadcast":
            group.broadcast(t, p["peer"], timeout=seconds)
        elif target == "all_gather":
            group.all_gather([torch.empty_like(t) for _ in range(self.n)], t, timeout=seconds)
        elif target == "recv_object":
            group.recv_object(p["peer"], tag=int(p.get("tag", 0)), timeout=seconds)
        elif target == "broadcast_object":
            group.broadcast_object(None, p["peer"], timeout=seconds)
        else:
            raise ValueError(f"no timeout probe for {target}")


def _finishes_within(work: Work, seconds: float) -> bool:
    try:
        work.wait(timeout=seconds)
    except CollectiveTimeout:
        return False
    except Exception:
        return True  # it finished, with an error: the error is recorded when it is waited
    return True


def _resolved(held: Any) -> tuple[bool, Any]:
    """``(True, value)`` for a value, or a ``Work`` that succeeded; ``(False, None)`` otherwise."""
    if not isinstance(held, Work):
        return True, held
    if not held.is_completed() or held.exception(0) is not None:
        return False, None
    return True, held.result(0)


def _value_dtypes(call: Call) -> set[str]:
    p = call.params
    specs = [m[5] for m in p.get("messages", [])] + list(p.get("objs", [])) + ([p["obj"]] if "obj" in p else [])
    found: set[str] = set()
    for spec in specs:
        found |= spec_dtypes(spec)
    return found


def _supports(group: ProcessGroup, call: Call, device: torch.device) -> bool | None:
    if call.op in ("split", "new_group"):
        return None
    if call.op == "messages" or call.op in VALUE_COLLECTIVES:
        kind = device.type
        return all(
            group.supports("send", device=kind, dtype=dtype) and group.supports("recv", device=kind, dtype=dtype)
            for dtype in [None, *(dtype_of(d) for d in sorted(_value_dtypes(call)))]
        )
    if call.op == "any_source":
        return all(
            group.supports(op, device=device.type, dtype=call.torch_dtype) for op in ("send", "recv", "recv_anysource")
        )
    if call.op == "p2p":
        return all(
            group.supports("send", device=device.type, dtype=dtype_of(m[4]))
            and group.supports("recv", device=device.type, dtype=dtype_of(m[4]))
            for m in call.params["messages"]
        )
    reduce = call.reduce_op() if "reduce" in call.params else None
    dtype = None if call.op == "barrier" else call.torch_dtype
    return group.supports(call.op, device=device.type, dtype=dtype, reduce_op=reduce)


def _invoke(group: ProcessGroup, call: Call, b: Bufs, me: int, *, async_op: bool) -> Work | None:
    op, p = call.op, call.params
    if op == "all_reduce":
        return group.all_reduce(b.outs[0], call.reduce_op(), async_op=async_op)
    if op == "broadcast":
        return group.broadcast(b.outs[0], p["root"], async_op=async_op)
    if op == "reduce":
        return group.reduce(b.outs[0], p["root"], call.reduce_op(), async_op=async_op)
    if op == "all_gather":
        return group.all_gather(b.outs, b.ins[0], async_op=async_op)
    if op == "all_gather_into_tensor":
        return group.all_gather_into_tensor(b.outs[0], b.ins[0], async_op=async_op)
    if op == "reduce_scatter":
        return group.reduce_scatter(b.outs[0], b.ins, call.reduce_op(), async_op=async_op)
    if op == "reduce_scatter_tensor":
        return group.reduce_scatter_tensor(b.outs[0], b.ins[0], call.reduce_op(), async_op=async_op)
    if op == "all_to_all":
        return group.all_to_all(b.outs, b.ins, async_op=async_op)
    if op == "all_to_all_single":
        splits = p["splits"]
        if p.get("even"):
            return group.all_to_all_single(b.outs[0], b.ins[0], async_op=async_op)
        out_splits = [row[me] for row in splits]
        return group.all_to_all_single(b.outs[0], b.ins[0], out_splits, splits[me], async_op=async_op)
    if op == "gather":
        return group.gather(b.ins[0], b.outs if p["root"] == me else None, p["root"], async_op=async_op)
    if op == "scatter":
        return group.scatter(b.outs[0], b.ins if p["root"] == me else None, p["root"], async_op=async_op)
    if op == "barrier":
        return group.barrier(async_op=async_op)
    raise ValueError(f"unknown op {op!r}")


def _invoke_value(group: ProcessGroup, call: Call, obj: Any, *, async_op: bool) -> Any:
    """Call the value collective ``call`` with this rank's ``obj``: its result, or a ``Work``."""
    op, p = call.op, call.params
    if op == "broadcast_object":
        return group.broadcast_object(obj, p["root"], async_op=async_op)
    if op == "all_gather_object":
        return group.all_gather_object(obj, async_op=async_op)
    if op == "gather_object":
        return group.gather_object(obj, p["root"], async_op=async_op)
    if op == "scatter_object":
        return group.scatter_object(obj, p["root"], async_op=async_op)
    if op == "broadcast_tensor_dict":
        return group.broadcast_tensor_dict(obj, p["root"], device=p.get("device"), async_op=async_op)
    raise ValueError(f"unknown value collective {op!r}")


def _send_message(group: ProcessGroup, msg: list[Any], value: Any, *, async_op: bool) -> Any:
    _src, dst, tag, kind, _recv_as, _spec = msg
    if kind == "object":
        return group.send_object(value, dst, tag=tag, async_op=async_op)
    if kind == "tensor":
        return group.send_tensor(value, dst, tag=tag, async_op=async_op)
    if kind == "tensor_dict":
        return group.send_tensor_dict(value, dst, tag=tag, async_op=async_op)
    if kind == "plain":
        return group.isend(value, dst, tag) if async_op else group.send(value, dst, tag)
    raise ValueError(f"unknown message kind {kind!r}")


def _recv_message(group: ProcessGroup, msg: list[Any], buffer: torch.Tensor | None, *, async_op: bool) -> Any:
    """Receive message ``msg`` the way it says (``recv_as``): its value, or a ``Work``."""
    src, _dst, tag, kind, recv_as, _spec = msg
    if kind == "plain":
        assert buffer is not None
        return group.irecv(buffer, src, tag) if async_op else group.recv(buffer, src, tag)
    how, _, device = str(recv_as).partition("@")
    where = device or None
    if how == "recv_object":
        return group.recv_object(src, tag=tag, async_op=async_op)
    if how == "recv_tensor":
        return group.recv_tensor(src, where, tag=tag, async_op=async_op)
    if how == "recv_tensor_dict":
        return group.recv_tensor_dict(src, where, tag=tag, async_op=async_op)
    raise ValueError(f"unknown way to receive {recv_as!r}")


def _call_once(group: ProcessGroup, op: str, device: torch.device, dtype: torch.dtype, rop: ReduceOp | None) -> None:
    """Call ``op`` once with well-formed arguments of ``dtype`` on ``device`` (for the undeclared probe)."""
    me, n = group.rank, group.size
    t = torch.zeros(2 * n, dtype=dtype, device=device)
    rop = rop if rop is not None else ReduceOp(RedOpType.SUM)
    peer = (me + 1) % n
    if op == "all_reduce":
        group.all_reduce(t, rop)
    elif op == "broadcast":
        group.broadcast(t, 0)
    elif op == "reduce":
        group.reduce(t, 0, rop)
    elif op == "all_gather":
        group.all_gather([torch.empty_like(t) for _ in range(n)], t)
    elif op == "all_gather_into_tensor":
        group.all_gather_into_tensor(torch.empty(2 * n * n, dtype=dtype, device=device), t)
    elif op == "reduce_scatter":
        group.reduce_scatter(torch.empty(2, dtype=dtype, device=device), [t[:2].clone() for _ in range(n)], rop)
    elif op == "reduce_scatter_tensor":
        group.reduce_scatter_tensor(torch.empty(2, dtype=dtype, device=device), t, rop)
    elif op == "all_to_all":
        group.all_to_all([torch.empty(2, dtype=dtype, device=device) for _ in range(n)], list(t.split(2)))
    elif op == "all_to_all_single":
        group.all_to_all_single(torch.empty_like(t), t)
    elif op == "gather":
        group.gather(t, [torch.empty_like(t) for _ in range(n)] if me == 0 else None, 0)
    elif op == "scatter":
        group.scatter(t, [torch.empty_like(t) for _ in range(n)] if me == 0 else None, 0)
    elif op == "barrier":
        group.barrier()
    elif op == "send":
        group.send(t, peer if n > 1 else 0)
    elif op == "recv":
        group.recv(t, peer if n > 1 else 0)
    elif op == "recv_anysource":
        group.recv(t, None)
    elif op == "send_object":
        group.send_object([1, "x"], peer if n > 1 else 0)
    elif op == "broadcast_object":
        group.broadcast_object([1, "x"], 0)
    else:
        raise ValueError(f"unknown op {op!r}")


#: Each bad input, called on one rank: it must raise ValueError or TypeError there,
#: before anything is sent (the calls after it prove nothing was).
BAD_INPUTS: dict[str, str] = {
    "root_out_of_range": "broadcast with src = world size",
    "negative_root": "reduce with dst = -1",
    "list_too_long": "all_gather with world size + 1 outputs",
    "list_too_short": "reduce_scatter with world size - 1 inputs",
    "into_tensor_numel": "all_gather_into_tensor whose output is one element short",
    "reduce_scatter_numel": "reduce_scatter_tensor whose input is one element long",
    "mixed_dtypes": "all_gather with one output of another dtype",
    "bad_splits": "all_to_all_single whose input splits do not add up",
    "not_a_tensor": "all_reduce of a Python list",
    "negative_tag": "send with tag -1",
    "self_send": "send to this rank",
    "peer_out_of_range": "recv from world size",
    "bool_root": "broadcast with src=True",
    "unknown_reduce_op": "all_reduce with op='bogus'",
    # objects, tensors of unknown shape, tensor dicts
    "scatter_object_wrong_length": "scatter_object from this rank with world size + 1 objects",
    "scatter_object_not_a_list": "scatter_object from this rank with objs=None",
    "broadcast_object_root_out_of_range": "broadcast_object with src = world size",
    "gather_object_negative_root": "gather_object with dst = -1",
    "send_object_to_self": "send_object to this rank",
    "send_object_negative_tag": "send_object with tag -1",
    "send_object_unpicklable": "send_object of a threading.Lock (it cannot be pickled)",
    "recv_object_out_of_range": "recv_object from world size",
    "send_tensor_not_a_tensor": "send_tensor of a Python list",
    "recv_tensor_from_self": "recv_tensor from this rank",
    "send_tensor_dict_not_a_dict": "send_tensor_dict of a list of tensors",
    "broadcast_tensor_dict_off_root": "broadcast_tensor_dict given a dict on a rank that is not the source",
    # subgroups
    "new_group_out_of_range": "new_group with a rank equal to the world size",
    "new_group_duplicate": "new_group listing this rank twice",
    "new_group_non_member": "new_group called by a rank it does not list",
    "split_negative_color": "split with color -1",
    "split_key_not_int": "split with key '0' (a str)",
}


def _bad_input(group: ProcessGroup, call: Call, device: torch.device) -> None:
    kind = call.params["kind"]
    dtype = dtype_of(call.dtype)
    n, me = group.size, group.rank
    t = torch.zeros(4, dtype=dtype, device=device)
    if kind == "root_out_of_range":
        group.broadcast(t, n)
    elif kind == "negative_root":
        group.reduce(t, -1)
    elif kind == "list_too_long":
        group.all_gather([torch.empty_like(t) for _ in range(n + 1)], t)
    elif kind == "list_too_short":
        group.reduce_scatter(t, [torch.empty_like(t) for _ in range(n - 1)])
    elif kind == "into_tensor_numel":
        group.all_gather_into_tensor(torch.empty(4 * n - 1, dtype=dtype, device=device), t)
    elif kind == "reduce_scatter_numel":
        group.reduce_scatter_tensor(t, torch.empty(4 * n + 1, dtype=dtype, device=device))
    elif kind == "mixed_dtypes":
        other = torch.float64 if dtype != torch.float64 else torch.float32
        outs = [torch.empty_like(t) for _ in range(n - 1)] + [torch.empty(4, dtype=other, device=device)]
        group.all_gather(outs, t)
    elif kind == "bad_splits":
        group.all_to_all_single(torch.empty(4, dtype=dtype, device=device), t, None, [5] + [0] * (n - 1))
    elif kind == "not_a_tensor":
        group.all_reduce([1, 2, 3])  # type: ignore[arg-type]
    elif kind == "negative_tag":
        group.send(t, (me + 1) % n, tag=-1)
    elif kind == "self_send":
        group.send(t, me)
    elif kind == "peer_out_of_range":
        group.recv(t, n)
    elif kind == "bool_root":
        group.broadcast(t, True)
    elif kind == "unknown_reduce_op":
        group.all_reduce(t, op="bogus")  # type: ignore[arg-type]
    elif kind.startswith(("new_group", "split")):
        _bad_subgroup(group, kind)
    else:
        _bad_message(group, kind, t)
    raise AssertionError(f"bad input {kind!r} ({BAD_INPUTS[kind]}) was accepted")


def _bad_message(group: ProcessGroup, kind: str, t: torch.Tensor) -> None:
    n, me = group.size, group.rank
    peer = (me + 1) % n
    obj = {"a": [1, 2.5, "x"], "t": t}
    if kind == "scatter_object_wrong_length":
        group.scatter_object([obj] * (n + 1), me)
    elif kind == "scatter_object_not_a_list":
        group.scatter_object(None, me)
    elif kind == "broadcast_object_root_out_of_range":
        group.broadcast_object(obj, n)
    elif kind == "gather_object_negative_root":
        group.gather_object(obj, -1)
    elif kind == "send_object_to_self":
        group.send_object(obj, me)
    elif kind == "send_object_negative_tag":
        group.send_object(obj, peer, tag=-1)
    elif kind == "send_object_unpicklable":
        group.send_object({"lock": threading.Lock()}, peer)
    elif kind == "recv_object_out_of_range":
        group.recv_object(n)
    elif kind == "send_tensor_not_a_tensor":
        group.send_tensor([1.0, 2.0], peer)  # type: ignore[arg-type]
    elif kind == "recv_tensor_from_self":
        group.recv_tensor(me)
    elif kind == "send_tensor_dict_not_a_dict":
        group.send_tensor_dict([t], peer)  # type: ignore[arg-type]
    elif kind == "broadcast_tensor_dict_off_root":
        group.broadcast_tensor_dict({"t": t}, peer)
    else:
        raise AssertionError(f"unknown bad input {kind!r}")


def _bad_subgroup(group: ProcessGroup, kind: str) -> None:
    n, me = group.size, group.rank
    if kind == "new_group_out_of_range":
        group.new_group([me, n])
    elif kind == "new_group_duplicate":
        group.new_group([me, me])
    elif kind == "new_group_non_member":
        group.new_group([r for r in range(n) if r != me])
    elif kind == "split_negative_color":
        group.split(-1)
    elif kind == "split_key_not_int":
        group.split(0, "0")  # type: ignore[arg-type]
    else:
        raise AssertionError(f"unknown bad input {kind!r}")


def run_example(ctx: Any, backend_ref: str, example_json: str, op_timeout: float) -> dict[str, Any]:
    """Run ``example_json`` on this rank; return ``{lane index: records}`` and timings."""
    ex = Example.from_json(example_json)
    backend = resolve_backend_ref(backend_ref, ex.device, factories=False)
    mine = [i for i, lane in enumerate(ex.lanes) if lane.parent is None and ctx.rank in lane.members]
    results: dict[int, Any] = {}
    start = time.monotonic()

    def one(index: int) -> None:
        try:
            results[index] = _Lane(ctx, ex, index, backend, op_timeout, results=results).run()
        except Exception as exc:  # forming the group or shutting it down failed
            results[index] = _error(exc)

    if len(mine) == 1:
        one(mine[0])
    else:
        threads = [threading.Thread(target=one, args=(i,), name=f"conformance-lane{i}") for i in mine]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return {"lanes": results, "seconds": time.monotonic() - start}


def run_dead_peer(
    ctx: Any, backend_ref: str, device_type: str, victim: int, op_timeout: float
) -> dict[str, Any] | None:
    """Rank ``victim`` dies after a first exchange; every other rank then waits on it.

    Returns the error the waiting rank saw (``None`` on the victim, which never returns)."""
    backend = resolve_backend_ref(backend_ref, device_type, factories=False)
    group = ProcessGroup(
        ctx.store,
        ctx.rank,
        ctx.size,
        backends={device_type: backend},
        name="conformance-dead-peer",
        timeout=op_timeout,
    )
    device = _device(device_type, ctx.rank)
    # the exchange: the first declared of barrier, send/recv, broadcast, all_reduce
    dtypes = (torch.float32, torch.int64, torch.uint8, torch.float16, torch.bfloat16)
    if group.supports("barrier", device=device_type):
        op = "barrier"
    elif any(group.supports("send", device_type, d) and group.supports("recv", device_type, d) for d in dtypes):
        op = "recv"
    else:
        op = "broadcast" if any(group.supports("broadcast", device_type, d) for d in dtypes) else "all_reduce"
    dtype = next(
        (
            d
            for d in dtypes
            if group.supports(
                "send" if op == "recv" else op, device_type, d, ReduceOp.MAX if op == "all_reduce" else None
            )
        ),
        torch.float32,
    )
    t = torch.zeros(4, dtype=dtype, device=device)

    def exchange() -> None:
        if op == "barrier":
            group.barrier()
        elif op == "broadcast":
            group.broadcast(t, src=victim)
        elif op == "all_reduce":
            group.all_reduce(t, ReduceOp.MAX)
        elif ctx.rank == victim:
            for peer in range(ctx.size):
                if peer != victim:
                    group.send(t, peer)
        else:
            group.recv(t, victim)

    try:
        group.form_backend(device)
        exchange()  # the group works
        if ctx.rank == victim:
            os._exit(0)
        start = time.monotonic()
        try:
            exchange()
        except Exception as exc:
            return {**_error(exc), "seconds": time.monotonic() - start, "op": op}
        return None
    finally:
        group.shutdown()


def run_warm_up(ctx: Any, backend_ref: Any, device_types: list[str], op_timeout: float) -> None:
    """Form a group on each device type given and run one declared collective, then shut it down:
    what a device's library starts once per process (a CUDA context; NCCL's RAS service with
    its listening sockets and pipe; MPI_Init's shared memory and sockets, for a backend with a
    launcher) exists before the examples, whose leak check then counts what each group leaves
    behind. Run by the pools without the leak check."""
    candidates = [(op, d) for op in ("all_reduce", "broadcast") for d in (torch.float32, torch.uint8, torch.int64)]
    for device_type in device_types:
        backend = resolve_backend_ref(backend_ref, device_type, factories=False)
        group = ProcessGroup(
            ctx.store,
            ctx.rank,
            ctx.size,
            backends={device_type: backend},
            name=f"conformance-warm-up-{device_type}",
            timeout=op_timeout,
        )
        try:
            rop = ReduceOp(RedOpType.MAX)
            for op, dtype in candidates:
                if group.supports(op, device_type, dtype, rop if op == "all_reduce" else None):
                    _call_once(group, op, _device(device_type, ctx.rank), dtype, rop)
                    break
        finally:
            group.shutdown()
