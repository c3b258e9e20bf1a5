"""Liveness: ``abort()`` wakes what is blocked, and nothing a backend started outlives its group.

The contract (:mod:`pg_core.backend`): ``abort`` releases everything at once and makes
operations blocked in other threads raise :class:`~pg_core.errors.GroupClosedError`;
``shutdown`` releases every thread, socket and process the backend started. The
``liveness`` test proves both on two ranks, with what the backend declares:

* **abort**: rank 0 blocks, each on a thread of its own, a ``recv`` from rank 1 (which never
  sends), a collective that rank 1 never joins (the first declared of :data:`COLLECTIVES`),
  and a ``send`` of :data:`SEND_BYTES` to rank 1 while rank 1's process is stopped
  (``SIGSTOP``), so that no transport can take it in. Once every thread waits inside the
  backend, the main thread calls ``group.abort()``. Each blocked operation must raise
  ``GroupClosedError`` within :data:`ABORT_BOUND_S` of that call, and ``abort()`` itself
  must return within it. A send that completed before the abort (a backend that buffers a
  whole message) was not blocked; the report says so. So was one still copying its message
  in when ``abort()`` came, on a backend whose sends never wait for their receiver (no eager
  limit), if it then returns normally within the bound.
* **pending works**: in a fresh group, rank 0 posts an ``irecv`` that rank 1 never matches and
  the collective with ``async_op=True``, which rank 1 never joins (a trainer's bucket of
  asynchronous all_reduces, say), and aborts; the ``wait()`` of each, on a thread of its own,
  must raise ``GroupClosedError`` within :data:`ABORT_BOUND_S`, and what the group made must
  be released by the same bound as after the first abort.
* **release after abort**: every thread, file descriptor, child process and shared memory
  mapping made since before the group must be gone by the time the aborted operations' own
  timeout has passed, plus the pool's 5 s grace. The measured time is reported: a backend
  releases at once (every CPU backend in this repository), or what a library cannot interrupt
  lingers until the timeout of the operation it runs, which the report shows. ``Capabilities``
  has no field in which a backend declares that it lingers, so the check cannot hold the
  others to "at once" without failing it; the bound is the one every blocking path keeps
  anyway, its timeout.
* **shutdown**: a fresh group runs the warm-up exchange (the collective, then a message each
  way) and shuts down on both ranks; nothing made since before it may be left (5 s grace).
* **shared memory**: a ``/dev/shm`` segment that a rank mapped or held open while its group
  was alive, and that still exists once every rank closed the group, is a leak.

The rank side (:func:`run_liveness`) returns plain data; the controller judges it
(:func:`judge`), raising :class:`~pg_core.testing.harness.ConformanceFailure` with the
check ``liveness`` (an operation abort did not wake, or an abort that did not return) or
``leak``.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..backend_refs import resolve_backend_ref
from ..errors import GroupClosedError
from ..group import ProcessGroup
from ..ops import RedOpType, ReduceOp
from ..store import wait_for
from .pool import SHM_DIR, leaks, resources, shm_left

__all__ = [
    "ABORT_BOUND_S",
    "COLLECTIVES",
    "SEND_BYTES",
    "blocked_timeout",
    "describe",
    "judge",
    "run_liveness",
]

#: A blocked operation must raise within this many seconds of ``abort()``, and ``abort()``
#: return within it: a backend that wakes its waiters does so in milliseconds (pg-tcp writes
#: to a wake-up pipe; pg-gloo and pg-mpi poll in slices of at most 0.1 s), and the rest is
#: for a loaded machine (two cores shared by every rank), as the ``timeouts`` test allows 3 s.
ABORT_BOUND_S = 3.0
#: The send that must block: more than any kernel buffers between two sockets on one host
#: (Linux's loopback buffers grow to 4 MiB for sending and 6 MiB for receiving).
SEND_BYTES = 32 * 1024 * 1024
#: The collectives the test blocks in, the first declared one (a rank that is not the root
#: of ``broadcast`` waits for it: rank 1 is the root, and never calls).
COLLECTIVES = ("barrier", "all_reduce", "broadcast", "all_gather")
#: Candidate dtypes, in order, for the collective and the messages.
_DTYPES = (torch.float32, torch.int64, torch.uint8, torch.float16, torch.bfloat16, torch.float64, torch.int32)
#: The phases of a run, in order: each forms a group and ends it (see the module docstring).
_PHASES = ("abort", "pending", "shutdown")
#: Seconds each operation may take to reach the backend before abort is called anyway.
_ENTER_S = 10.0
#: After every operation waits in the backend, this long for a send to fill the buffers.
_SETTLE_S = 0.3


def blocked_timeout(op_timeout: float) -> float:
    """The timeout the blocked operations are called with: short, since what a library cannot
    interrupt lingers until it, and long enough that ``ABORT_BOUND_S`` after the abort comes
    well before it (an abort that does not wake them fails by the error, not only the time)."""
    return max(min(op_timeout, 6.0), ABORT_BOUND_S + 2.0)


# -- the rank side ------------------------------------------------------------------


def _plan(group: ProcessGroup, device_type: str) -> dict[str, Any]:
    """What the backend declares that the test can block in: a collective and a message dtype."""
    plan: dict[str, Any] = {"collective": None, "dtype": None, "p2p": None}
    for op in COLLECTIVES:
        if op == "barrier":
            if group.supports("barrier", device=device_type):
                plan["collective"] = op
                break
            continue
        for dtype in _DTYPES:
            reduce = ReduceOp(RedOpType.SUM) if op == "all_reduce" else None
            if group.supports(op, device_type, dtype, reduce):
                plan["collective"], plan["dtype"] = op, dtype
                break
        if plan["collective"] is not None:
            break
    for dtype in _DTYPES:
        if group.supports("send", device_type, dtype) and group.supports("recv", device_type, dtype):
            plan["p2p"] = dtype
            break
    return plan


def _collective(group: ProcessGroup, plan: dict[str, Any], device: torch.device) -> Callable[..., Any]:
    """The plan's collective as ``run(timeout, async_op=False)``: its work where asynchronous."""
    op, dtype = plan["collective"], plan["dtype"]

    def run(timeout: float, async_op: bool = False) -> Any:
        if op == "barrier":
            return group.barrier(timeout=timeout, async_op=async_op)
        t = torch.ones(4, dtype=dtype, device=device)
        if op == "all_reduce":
            return group.all_reduce(t, timeout=timeout, async_op=async_op)
        if op == "broadcast":
            return group.broadcast(t, src=1, timeout=timeout, async_op=async_op)
        return group.all_gather([torch.empty_like(t) for _ in range(group.size)], t, timeout=timeout, async_op=async_op)

    return run


def _warm_up(group: ProcessGroup, plan: dict[str, Any], device: torch.device, timeout: float) -> None:
    """The collective once, then one message each way: every connection is up."""
    if plan["collective"] is not None:
        _collective(group, plan, device)(timeout)
    if plan["p2p"] is not None:
        t = torch.ones(8, dtype=plan["p2p"], device=device)
        for sender in (0, 1):
            if group.rank == sender:
                group.send(t, 1 - sender, timeout=timeout)
            elif group.rank == 1 - sender:
                group.recv(t, sender, timeout=timeout)


def _segments(res: tuple[Any, ...]) -> set[str]:
    """The shared memory segments of a :func:`~pg_core.testing.pool.resources` reading."""
    fds = {fd.split("->", 1)[1] for fd in res[1] if "->" + SHM_DIR + "/" in fd}
    return fds | set(res[3])


def _backend_dirs(spec: Any) -> set[str]:
    """The folders of the backend's classes (not pg-core's): a thread with a frame there waits in it."""
    core = str(Path(inspect.getfile(ProcessGroup)).parent)
    factory = spec.load_factory()
    dirs = set()
    for obj in factory.__mro__ if isinstance(factory, type) else (factory,):
        with contextlib.suppress(TypeError, OSError):
            folder = str(Path(inspect.getfile(obj)).parent)
            if not folder.startswith(core):
                dirs.add(folder)
    return dirs


def _in_backend(thread: threading.Thread, dirs: set[str]) -> bool:
    frame = sys._current_frames().get(thread.ident or -1)
    while frame is not None:
        if any(frame.f_code.co_filename.startswith(d) for d in dirs):
            return True
        frame = frame.f_back
    return False


def _stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _stop(pid: int) -> bool:
    """Stop process ``pid`` (``SIGSTOP``) and wait, at most 5 s, until it is stopped."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 5.0
    while not _stopped(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)  # the kernel stops it: no event to wait on
    return True


class _Blocked(threading.Thread):
    """One operation run on a thread of its own, with what became of it."""

    def __init__(self, name: str, body: Callable[[], object]) -> None:
        super().__init__(name=f"conformance-liveness-{name}", daemon=True)
        self.op, self._body = name, body
        self.error: BaseException | None = None
        self.ended: float | None = None

    def run(self) -> None:
        try:
            self._body()
        except BaseException as exc:
            self.error = exc
        finally:
            self.ended = time.monotonic()


def _outcome(op: _Blocked, blocked: bool, entered: bool, aborted_at: float) -> dict[str, Any]:
    err = op.error
    return {
        "blocked": blocked,  # still running when abort() was called
        "entered": entered,  # seen waiting inside the backend
        "ended": not op.is_alive(),
        "seconds": None if op.ended is None else op.ended - aborted_at,
        "type": None if err is None else type(err).__name__,
        "mro": [] if err is None else [c.__name__ for c in type(err).__mro__],
        "message": None if err is None else str(err)[:1000],
    }


def _formed(
    ctx: Any, spec: Any, device_type: str, device: torch.device, timeout: float, *, phase: str
) -> tuple[tuple[Any, ...], ProcessGroup, dict[str, Any], set[str]]:
    """A phase's group, warmed up: what the process held before it, the group, its plan, and
    the shared memory segments it made."""
    before = resources()
    group = ProcessGroup(
        ctx.store,
        ctx.rank,
        ctx.size,
        backends={device_type: spec},
        name=f"conformance-liveness-{phase}",
        timeout=timeout,
    )
    plan = _plan(group, device_type)
    _warm_up(group, plan, device, timeout)
    return before, group, plan, _segments(resources()) - _segments(before)


def _abort_phase(ctx: Any, spec: Any, device_type: str, device: torch.device, timeout: float) -> dict[str, Any]:
    before, group, plan, seen = _formed(ctx, spec, device_type, device, timeout, phase="abort")
    wait_s = 3 * timeout + _ENTER_S + 30.0
    if ctx.rank != 0:
        if ctx.rank == 1:
            ctx.store.set("liveness/ready", str(os.getpid()))
        wait_for(ctx.store, ["liveness/done"], wait_s, what=f"liveness rank {ctx.rank}: rank 0's abort")
        start = time.monotonic()
        group.abort()
        leak = leaks(before)
        return {"plan": _shown(plan), "release": {"seconds": time.monotonic() - start, "leak": leak}, "shm": seen}
    wait_for(ctx.store, ["liveness/ready"], wait_s, what="liveness rank 0: rank 1 ready")
    peer = int(ctx.store.get("liveness/ready"))
    dirs = _backend_dirs(spec)
    ops: list[_Blocked] = []
    # a backend without an eager limit never makes a send wait for its receiver (API 1.10)
    sends_wait = spec.capabilities_for(device_type).eager_limit_bytes is not None
    result: dict[str, Any] = {"plan": _shown(plan), "timeout": timeout, "sends_wait": sends_wait}
    stopped = False
    try:
        if plan["p2p"] is not None:
            stopped = _stop(peer)
            result["peer_stopped"] = stopped
            dtype = plan["p2p"]
            item = torch.empty((), dtype=dtype).element_size()
            big = torch.ones(SEND_BYTES // item, dtype=dtype, device=device)
            into = torch.zeros(4, dtype=dtype, device=device)
            ops.append(_Blocked("recv", lambda: group.recv(into, 1, tag=5, timeout=timeout)))
            ops.append(_Blocked("send", lambda: group.send(big, 1, tag=6, timeout=timeout)))
        if plan["collective"] is not None:
            run = _collective(group, plan, device)
            ops.append(_Blocked(plan["collective"], lambda: run(timeout)))
        for op in ops:
            op.start()
        entered = {op.op: False for op in ops}
        deadline = time.monotonic() + _ENTER_S
        while time.monotonic() < deadline and not all(entered[op.op] or not op.is_alive() for op in ops):
            for op in ops:
                entered[op.op] = entered[op.op] or _in_backend(op, dirs)
            time.sleep(0.005)  # polling another thread's stack: no event to wait on
        settle = time.monotonic() + _SETTLE_S
        while time.monotonic() < settle and any(op.is_alive() for op in ops):
            time.sleep(0.01)  # a send fills the buffers meanwhile
        blocked = {op.op: op.is_alive() for op in ops}
        aborted_at = time.monotonic()
        group.abort()
        result["abort_s"] = time.monotonic() - aborted_at
        for op in ops:
            op.join(timeout=max(0.0, aborted_at + timeout + 5.0 - time.monotonic()))
        result["ops"] = {op.op: _outcome(op, blocked[op.op], entered[op.op], aborted_at) for op in ops}
        for op in ops:
            op.error = None  # its traceback holds the frames that waited, and what they waited on
    finally:
        if stopped:
            os.kill(peer, signal.SIGCONT)
        ctx.store.set("liveness/done", "1")
    del ops, op
    # what cannot be interrupted may run until the blocked operations' own timeout
    grace = max(0.0, aborted_at + timeout - time.monotonic()) + 5.0
    leak = leaks(before, grace_s=grace)
    result["release"] = {"seconds": time.monotonic() - aborted_at, "leak": leak}
    result["shm"] = seen
    return result


def _pending_phase(ctx: Any, spec: Any, device_type: str, device: torch.device, timeout: float) -> dict[str, Any]:
    """Rank 0 posts an ``irecv`` that rank 1 never matches and the plan's collective with
    ``async_op=True``, which rank 1 never joins, lets them settle, and aborts; then each work's
    ``wait()``, on a thread of its own, must raise ``GroupClosedError`` within the bound."""
    before, group, plan, seen = _formed(ctx, spec, device_type, device, timeout, phase="pending")
    if ctx.rank != 0:
        wait_for(
            ctx.store, ["liveness/pending-done"], 2 * timeout + 30.0, what=f"liveness rank {ctx.rank}: rank 0's abort"
        )
        start = time.monotonic()
        group.abort()
        return {"release": {"seconds": time.monotonic() - start, "leak": leaks(before)}, "shm": seen}
    works: dict[str, Any] = {}
    result: dict[str, Any] = {"timeout": timeout}
    try:
        if plan["p2p"] is not None:
            works["irecv"] = group.irecv(torch.zeros(4, dtype=plan["p2p"], device=device), 1, tag=7, timeout=timeout)
        if plan["collective"] is not None:
            works[plan["collective"] + "(async_op=True)"] = _collective(group, plan, device)(timeout, async_op=True)
        settle = time.monotonic() + _SETTLE_S
        while time.monotonic() < settle and not all(work.is_completed() for work in works.values()):
            time.sleep(0.01)  # the works reach their backend meanwhile
        pending = {name: not work.is_completed() for name, work in works.items()}
        aborted_at = time.monotonic()
        group.abort()
        waits = [_Blocked(name, work.wait) for name, work in works.items()]
        for wait in waits:
            wait.start()
        for wait in waits:
            wait.join(timeout=max(0.0, aborted_at + timeout + 5.0 - time.monotonic()))
        result["works"] = {w.op: _outcome(w, pending[w.op], True, aborted_at) for w in waits}
        for wait in waits:
            wait.error = None  # (its traceback holds the frames that waited)
    finally:
        ctx.store.set("liveness/pending-done", "1")
    del works, waits, wait  # (the last loop variable too)
    grace = max(0.0, aborted_at + timeout - time.monotonic()) + 5.0
    result["release"] = {"seconds": time.monotonic() - aborted_at, "leak": leaks(before, grace_s=grace)}
    result["shm"] = seen
    return result


def _shutdown_phase(ctx: Any, spec: Any, device_type: str, device: torch.device, timeout: float) -> dict[str, Any]:
    before, group, _, seen = _formed(ctx, spec, device_type, device, timeout, phase="shutdown")
    start = time.monotonic()
    group.shutdown()
    shut_s = time.monotonic() - start
    leak = leaks(before)
    return {"shutdown_s": shut_s, "release": {"seconds": time.monotonic() - start, "leak": leak}, "shm": seen}


def _shown(plan: dict[str, Any]) -> dict[str, Any]:
    return {k: str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else v for k, v in plan.items()}


def run_liveness(ctx: Any, backend_ref: str, device_type: str, op_timeout: float) -> dict[str, Any]:
    """On every rank of a pool of two or more: the abort phase, then the shutdown phase (see
    the module docstring); then, once every rank is done, which of the shared memory segments
    it saw are still there. Ranks above 1 only form the groups and close them."""
    spec = resolve_backend_ref(backend_ref, device_type, factories=False)
    from .rank import _device

    device = _device(device_type, ctx.rank)
    timeout = blocked_timeout(op_timeout)
    out: dict[str, Any] = {"abort": _abort_phase(ctx, spec, device_type, device, timeout)}
    _together(ctx, "aborted", 3 * timeout + 30.0)  # rank 0 may wait for what lingers until the timeout
    out["pending"] = _pending_phase(ctx, spec, device_type, device, timeout)
    _together(ctx, "aborted-pending", 3 * timeout + 30.0)
    out["shutdown"] = _shutdown_phase(ctx, spec, device_type, device, op_timeout)
    _together(ctx, "closed", 3 * op_timeout + 30.0)
    out["shm_left"] = {phase: shm_left(out[phase].pop("shm")) for phase in _PHASES}
    return out


def _together(ctx: Any, step: str, timeout: float) -> None:
    """Wait until every rank has reached ``step`` (a store barrier, bounded)."""
    ctx.store.set(f"liveness/{step}/{ctx.rank}", "1")
    keys = [f"liveness/{step}/{r}" for r in range(ctx.size)]
    wait_for(ctx.store, keys, timeout, what=f"liveness rank {ctx.rank}: every rank {step}")


# -- the controller side ----------------------------------------------------------------


def _taken_in(zero: dict[str, Any], name: str, got: dict[str, Any]) -> bool:
    """Whether ``got`` is the send to the stopped rank taken in whole by the backend, blocked on
    nothing: it returned normally before ``abort()``, or, where the backend's sends never wait
    for their receiver (no eager limit), it was still copying the message in when ``abort()``
    came (32 MiB on a loaded machine can take longer than the test lets it settle) and
    returned normally within the bound."""
    if name != "send" or got["type"] is not None:
        return False
    if not got["blocked"]:
        return True
    return zero.get("sends_wait") is False and got["ended"] and got["seconds"] <= ABORT_BOUND_S


def _unwoken(got: dict[str, Any], waited: str, how_blocked: str, timeout: float) -> str | None:
    """What is wrong with ``got``, an operation that was blocked (``how_blocked``) when
    ``abort()`` came, or None: it must raise ``GroupClosedError`` within the bound."""
    if got["type"] is None or "GroupClosedError" not in got["mro"]:
        how = (
            f"{got['seconds']:.2f} s after it, {_said(got)}"
            if got["ended"]
            else f"it is still blocked {timeout + 5:g} s after it"
        )
        return (
            f"rank 0: {waited} {how_blocked} when group.abort() was called, and {how}; "
            f"it must raise {GroupClosedError.__name__} within {ABORT_BOUND_S:g} s"
        )
    if got["seconds"] > ABORT_BOUND_S:
        return (
            f"rank 0: {waited} {how_blocked} when group.abort() was called, and its "
            f"GroupClosedError came {got['seconds']:.2f} s after it; it must come within {ABORT_BOUND_S:g} s "
            "(abort() wakes what is blocked, at once)"
        )
    return None


def judge(results: list[dict[str, Any]]) -> tuple[str, str] | None:
    """``(check, detail)`` for the first thing the ranks' results break, or ``None``."""
    zero = results[0]["abort"]
    for name, got in zero.get("ops", {}).items():
        waited = "the send of 32 MiB to the stopped rank 1" if name == "send" else f"the {name}"
        if _taken_in(zero, name, got):
            continue  # the backend took the whole message in: nothing was blocked
        if not got["blocked"]:
            return "liveness", (
                f"rank 0: {waited} (on its own thread, rank 1 never taking part) ended before abort() was called: "
                f"{_said(got)}; it must wait until abort() or its timeout ({zero['timeout']:g} s)"
            )
        if problem := _unwoken(got, waited, "was blocked on another thread", zero["timeout"]):
            return "liveness", problem
    pending = results[0].get("pending", {})
    for name, got in pending.get("works", {}).items():
        if not got["blocked"]:
            return "liveness", (
                f"rank 0: the {name} work (rank 1 never taking part) completed before abort() was called; "
                f"it must stay pending until abort() or its timeout ({pending['timeout']:g} s)"
            )
        if problem := _unwoken(
            got, f"the wait() of the {name} work", "(posted, not waited for) was pending", pending["timeout"]
        ):
            return "liveness", problem
    if zero.get("abort_s") is not None and zero["abort_s"] > ABORT_BOUND_S:
        return "liveness", f"rank 0: group.abort() took {zero['abort_s']:.2f} s to return; at most {ABORT_BOUND_S:g} s"
    for r, res in enumerate(results):
        for phase in (p for p in _PHASES if p in res):
            leak = res[phase]["release"]["leak"]
            if leak is not None:
                after = (
                    "group.shutdown() (5 s after it)"
                    if phase == "shutdown"
                    else f"group.abort() ({res[phase].get('timeout', 0):g} s after it, the aborted operations' "
                    "timeout, plus 5 s)" + (" with works pending" if phase == "pending" else "")
                )
                return "leak", f"rank {r}: after {after}, it {leak}"
            left = res["shm_left"][phase]
            if left:
                return "leak", (
                    f"rank {r}: shared memory segments it used while the group was alive are still in {SHM_DIR} "
                    f"after every rank's group.{'shutdown' if phase == 'shutdown' else 'abort'}(): {left} "
                    "(unlink them when the group closes)"
                )
    return None


def describe(results: list[dict[str, Any]]) -> str:
    """One line of what a passed run exercised and measured, for the summary."""
    zero = results[0]["abort"]
    bits = []
    for name, got in zero.get("ops", {}).items():
        what = "send 32 MiB to a stopped peer" if name == "send" else name
        if not _taken_in(zero, name, got):
            bits.append(f"{what} woke in {got['seconds']:.2f} s")
        else:
            stopped = "" if zero.get("peer_stopped") else "; rank 1 could not be stopped"
            when = "completed before abort" if not got["blocked"] else f"completed {got['seconds']:.2f} s after abort"
            bits.append(f"{what}: {when} (the backend took it all in{stopped}), not blocked")
    if not bits:
        bits.append("nothing declared that could block")
    works = results[0].get("pending", {}).get("works", {})
    if works:
        bits.append(", ".join(f"pending {name} woke in {got['seconds']:.2f} s" for name, got in works.items()))
    release = max(r[p]["release"]["seconds"] for r in results for p in ("abort", "pending") if p in r)
    lingered = " (lingered until the aborted operations' timeout)" if release > 5.0 else ""
    shut = max(r["shutdown"]["release"]["seconds"] for r in results)
    return (
        f"abort: {', '.join(bits)} (GroupClosedError, bound {ABORT_BOUND_S:g} s); threads, descriptors, children "
        f"and shared memory released {release:.2f} s after abort{lingered}; after shutdown nothing left "
        f"({shut:.2f} s), no {SHM_DIR} segment left"
    )


def _said(got: dict[str, Any]) -> str:
    if got["type"] is None:
        return "it returned normally"
    return f"it raised {got['type']}: {got['message']}"


def check_liveness(suite: Any) -> None:
    """The ``liveness`` test of a :class:`~pg_core.testing.harness.Conformance`: once per tested
    device, on a pool of the smallest world size >= 2; raises its ``ConformanceFailure``."""
    from .harness import ConformanceFailure, NotApplicable
    from .pool import RanksFailed

    sizes = [n for n in suite.world_sizes if n >= 2]
    if not sizes:
        raise NotApplicable("liveness needs a world size >= 2: a peer that never takes part")
    n, op_timeout = sizes[0], suite.profile.op_timeout
    seen = []
    for device in suite.devices:
        suite.examples["liveness"] += 1
        suite.sizes["liveness"][n] += 1
        start = time.monotonic()
        try:
            results = suite.pool(n).run(
                run_liveness, suite.rank_ref, device, op_timeout, timeout=suite.profile.deadline + 4 * op_timeout
            )
        except RanksFailed as exc:
            outcomes = exc.outcomes.values()
            check = (
                "deadline"
                if any("did not finish" in o for o in outcomes)
                else "leak"
                if any("leaked" in o for o in outcomes)
                else "liveness"
            )
            raise ConformanceFailure(check, f"world size {n}, device {device}:\n{exc}") from None
        finally:
            suite.seconds["liveness"] += time.monotonic() - start
        for op in results[0]["abort"].get("ops", {}):
            suite.calls["liveness"][op] += 1
        suite.calls["liveness"]["abort"] += 1
        suite.calls["liveness"]["shutdown"] += 1
        problem = judge(results)
        if problem is not None:
            raise ConformanceFailure(problem[0], f"world size {n}, device {device}: {problem[1]}")
        seen.append(f"{device}: {describe(results)}")
    suite.notes["liveness"] = "; ".join(seen)
