"""``pg-core bench --overhead``: what the core adds to every call, measured without a network.

At world size 1, in this one process, with :class:`NullBackend` (a backend whose every
op returns at once, declaring every op and dtype), each op of :data:`OPS` on tensors of
one element is timed three ways:

* ``direct``: the backend's own method, called on an instance built from a
  :class:`~pg_core.backend.BackendContext` (``backend.all_reduce(t, ReduceOp.SUM,
  timeout=...)``): the baseline, what any caller of the backend pays;
* ``blocking``: the same op through a :class:`~pg_core.ProcessGroup` formed on that
  backend (``group.all_reduce(t)``): argument checks, capability checks, staging,
  sequence numbers, dispatch, the executor's ordering, error handling;
* ``async``: ``group.all_reduce(t, async_op=True).wait()``: the same plus a
  :class:`~pg_core.work.Work` and the hand-over to the group's progress thread and back
  (:class:`NullBackend` does not launch);
* ``launched``: the same call on a group formed on :class:`LaunchingNullBackend`, which
  declares ``launches = True`` (API 1.2) and returns a work that is already complete: the
  core's launch path (:meth:`pg_core.ProcessGroup` ``_launch``: the executor's order and
  sequence number, the flight recorder, the failure latch's callback, the user's work),
  without a thread, plus the backend's one :class:`~pg_core.work.Work`.

``send`` and ``recv`` need a peer: they go to rank 1 of a group of size 2 formed on a
:class:`~pg_core.HashStore` in which rank 1 never appears (NullBackend's ``send``/``recv``
return at once, and forming a group on it asks the peer nothing); their ``direct`` is the
backend's ``send``/``recv`` with the wire tag of user tag 0. Their ``blocking`` and
``launched`` modes run on such a group of :class:`LaunchingNullBackend`, which has its own
``isend``/``irecv`` as every shipped backend has, so no helper thread ever exists there
(once one does, every blocking call asks whether its stream's helper has work queued);
``async`` runs on one of :class:`NullBackend`, whose ``isend``/``irecv`` are the core's
default: the blocking call on a helper thread.

``blocking - direct`` is the **core overhead per call**, the figure the project's target
(at most 3 us per blocking collective) is judged by; ``async - direct`` the same for an
asynchronous call waited for at once; ``launched - blocking`` what an asynchronous call
waited for at once costs over the blocking one where the backend launches (issue 33's
target: at most 5 us, on a real backend).

**How it is timed.** Every mode of every op is one closure of the same shape
(``lambda: f(args)``), so what the loop and the closure cost cancels out of the
differences. Each is warmed up (``iters // 10`` calls, at least 100), then timed in
``repeats`` batches of ``iters`` back-to-back calls with :func:`time.perf_counter_ns`
around each batch, with the garbage collector disabled during the batches (and run
before them). A batch's time divided by ``iters`` is one sample; a row reports the
median and the minimum of its ``repeats`` samples, in nanoseconds per call. The modes of
an op are measured in rotation (direct, blocking, async, direct, ...), batch by batch,
so a change in the machine's speed during the run touches all three alike.

This measures the core, not a network: a real backend's call costs its own time on
top. Absolute numbers depend on the machine and its load; compare figures measured in
one run, and repeat the run to see the spread.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Final

import torch

from ..backend import Backend, BackendContext
from ..ops import ReduceOp
from .nullbackend import LaunchingNullBackend, NullBackend

__all__ = [
    "MODES",
    "OPS",
    "TARGET_US",
    "OverheadRow",
    "format_table",
    "measure",
]

#: The ops measured: the collectives that make sense at world size 1 without a peer, and
#: point to point to a peer that never answers (see the module docstring).
OPS: Final[tuple[str, ...]] = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "barrier",
    "send",
    "recv",
)

#: The wire tag of user tag 0 on a backend with tags (:mod:`pg_core.tags`): the direct calls' tag.
_USER_TAG_0: Final = 2

#: How each op is called, in the order they are measured and reported.
MODES: Final[tuple[str, ...]] = ("direct", "blocking", "async", "launched")

#: The project's target: core overhead of a blocking collective, in microseconds.
TARGET_US: Final[float] = 3.0

_TIMEOUT_S: Final[float] = 60.0


@dataclasses.dataclass
class OverheadRow:
    """One op: nanoseconds per call, the median (and the minimum) of ``repeats`` batches
    of ``iters`` calls, per mode; ``overhead_ns`` = ``blocking_ns - direct_ns`` (the core
    overhead per blocking call), ``async_overhead_ns`` = ``async_ns - direct_ns``,
    ``launch_cost_ns`` = ``launched_ns - blocking_ns`` (an asynchronous call waited for at
    once, over the blocking one, where the backend launches)."""

    op: str
    dtype: str
    numel: int
    iters: int
    repeats: int
    direct_ns: float
    blocking_ns: float
    async_ns: float
    direct_min_ns: float
    blocking_min_ns: float
    async_min_ns: float
    overhead_ns: float
    async_overhead_ns: float
    launched_ns: float = 0.0
    launched_min_ns: float = 0.0
    launch_cost_ns: float = 0.0

    @property
    def overhead_us(self) -> float:
        return self.overhead_ns / 1e3


def _calls(
    op: str,
    backend: Backend,
    group: Any,
    launching: Any,
    dtype: torch.dtype,
    *,
    pair: Any = None,
    launching_pair: Any = None,
) -> dict[str, Callable[[], Any]]:
    """The calls of ``op`` in every mode, as closures of one shape (see the module docstring);
    ``launching`` is the group on :class:`LaunchingNullBackend`; ``pair`` the group of size 2
    of ``send``/``recv``'s ``async`` mode, ``launching_pair`` that of its others (see the
    module docstring)."""
    t = torch.ones(1, dtype=dtype)
    out = torch.empty(1, dtype=dtype)
    s = ReduceOp.SUM
    b, g, lg, p, lp = backend, group, launching, pair, launching_pair
    if op == "send":
        return {
            "direct": lambda: b.send(t, 1, _USER_TAG_0, timeout=_TIMEOUT_S),
            "blocking": lambda: lp.send(t, 1),
            "async": lambda: p.isend(t, 1).wait(),
            "launched": lambda: lp.isend(t, 1).wait(),
        }
    if op == "recv":
        return {
            "direct": lambda: b.recv(t, 1, _USER_TAG_0, timeout=_TIMEOUT_S),
            "blocking": lambda: lp.recv(t, 1),
            "async": lambda: p.irecv(t, 1).wait(),
            "launched": lambda: lp.irecv(t, 1).wait(),
        }
    if op == "all_reduce":
        return {
            "direct": lambda: b.all_reduce(t, s, timeout=_TIMEOUT_S),
            "blocking": lambda: g.all_reduce(t),
            "async": lambda: g.all_reduce(t, async_op=True).wait(),
            "launched": lambda: lg.all_reduce(t, async_op=True).wait(),
        }
    if op == "broadcast":
        return {
            "direct": lambda: b.broadcast(t, 0, timeout=_TIMEOUT_S),
            "blocking": lambda: g.broadcast(t, 0),
            "async": lambda: g.broadcast(t, 0, async_op=True).wait(),
            "launched": lambda: lg.broadcast(t, 0, async_op=True).wait(),
        }
    if op == "reduce":
        return {
            "direct": lambda: b.reduce(t, 0, s, timeout=_TIMEOUT_S),
            "blocking": lambda: g.reduce(t, 0),
            "async": lambda: g.reduce(t, 0, async_op=True).wait(),
            "launched": lambda: lg.reduce(t, 0, async_op=True).wait(),
        }
    if op == "all_gather_into_tensor":
        return {
            "direct": lambda: b.all_gather_into_tensor(out, t, timeout=_TIMEOUT_S),
            "blocking": lambda: g.all_gather_into_tensor(out, t),
            "async": lambda: g.all_gather_into_tensor(out, t, async_op=True).wait(),
            "launched": lambda: lg.all_gather_into_tensor(out, t, async_op=True).wait(),
        }
    if op == "reduce_scatter_tensor":
        return {
            "direct": lambda: b.reduce_scatter_tensor(out, t, s, timeout=_TIMEOUT_S),
            "blocking": lambda: g.reduce_scatter_tensor(out, t),
            "async": lambda: g.reduce_scatter_tensor(out, t, async_op=True).wait(),
            "launched": lambda: lg.reduce_scatter_tensor(out, t, async_op=True).wait(),
        }
    if op == "barrier":
        return {
            "direct": lambda: b.barrier(timeout=_TIMEOUT_S),
            "blocking": lambda: g.barrier(),  # noqa: PLW0108  (the same shape as the other modes)
            "async": lambda: g.barrier(async_op=True).wait(),
            "launched": lambda: lg.barrier(async_op=True).wait(),
        }
    raise ValueError(f"unknown op {op!r}; --overhead measures {', '.join(OPS)}")


def _batch(call: Callable[[], Any], iters: int) -> float:
    """Nanoseconds per call over ``iters`` back-to-back calls."""
    loop = range(iters)
    start = time.perf_counter_ns()
    for _ in loop:
        call()
    return (time.perf_counter_ns() - start) / iters


def measure(
    ops: Sequence[str] = OPS,
    *,
    iters: int = 20_000,
    repeats: int = 5,
    dtype: torch.dtype = torch.float32,
    progress: Callable[[str], None] | None = None,
) -> list[OverheadRow]:
    """Time every op of ``ops`` in every one of :data:`MODES`; see the module docstring."""
    from ..group import ProcessGroup
    from ..store import HashStore, TCPStore

    if iters < 1 or repeats < 1:
        raise ValueError(f"iters and repeats must be >= 1, got {iters} and {repeats}")
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        raise ValueError(f"unknown ops {unknown}; --overhead measures {', '.join(OPS)}")
    store = TCPStore("127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False)
    ctx = BackendContext(
        store=store,
        rank=0,
        size=1,
        device=torch.device("cpu"),
        timeout=_TIMEOUT_S,
        group_name="overhead-direct",
        group_uid="overhead-direct#0",
        backend_name="null",
    )
    backend = NullBackend(ctx)
    group = ProcessGroup(store, 0, 1, backends=NullBackend, name="overhead", timeout=timedelta(seconds=_TIMEOUT_S))
    launching = ProcessGroup(
        store, 0, 1, backends=LaunchingNullBackend, name="overhead-launching", timeout=timedelta(seconds=_TIMEOUT_S)
    )
    pair = ProcessGroup(HashStore(), 0, 2, backends=NullBackend, name="overhead-p2p", timeout=_TIMEOUT_S)
    launching_pair = ProcessGroup(
        HashStore(), 0, 2, backends=LaunchingNullBackend, name="overhead-p2p-launching", timeout=_TIMEOUT_S
    )
    rows: list[OverheadRow] = []
    try:
        for op in ops:
            calls = _calls(op, backend, group, launching, dtype, pair=pair, launching_pair=launching_pair)
            for call in calls.values():  # warm up: caches, the progress thread, branch predictors
                _batch(call, max(100, iters // 10))
            samples: dict[str, list[float]] = {mode: [] for mode in MODES}
            gc.collect()
            enabled = gc.isenabled()
            gc.disable()
            try:
                for _ in range(repeats):
                    for mode in MODES:  # in rotation: drift touches every mode alike
                        samples[mode].append(_batch(calls[mode], iters))
            finally:
                if enabled:
                    gc.enable()
            med = {mode: statistics.median(samples[mode]) for mode in MODES}
            row = OverheadRow(
                op=op,
                dtype=str(dtype).removeprefix("torch."),
                numel=1,
                iters=iters,
                repeats=repeats,
                direct_ns=med["direct"],
                blocking_ns=med["blocking"],
                async_ns=med["async"],
                direct_min_ns=min(samples["direct"]),
                blocking_min_ns=min(samples["blocking"]),
                async_min_ns=min(samples["async"]),
                overhead_ns=med["blocking"] - med["direct"],
                async_overhead_ns=med["async"] - med["direct"],
                launched_ns=med["launched"],
                launched_min_ns=min(samples["launched"]),
                launch_cost_ns=med["launched"] - med["blocking"],
            )
            rows.append(row)
            if progress is not None:
                progress(f"bench --overhead: {op}: core overhead {row.overhead_us:.2f} us per blocking call")
    finally:
        group.shutdown()
        launching.shutdown()
        pair.shutdown()
        launching_pair.shutdown()
        backend.shutdown()
    return rows


# -- reports -----------------------------------------------------------------------------------------


def format_table(rows: Sequence[OverheadRow]) -> str:
    """One line per op, then the summary against :data:`TARGET_US` and a legend."""
    if not rows:
        return "(no ops measured)"
    first = rows[0]
    header = ["op", "direct", "blocking", "async+wait", "overhead", "async overhead", "launched+wait", "launch cost"]
    lines = [header]
    for r in rows:
        lines.append(
            [
                r.op,
                f"{r.direct_ns / 1e3:.3f}",
                f"{r.blocking_ns / 1e3:.3f}",
                f"{r.async_ns / 1e3:.3f}",
                f"{r.overhead_ns / 1e3:.3f}",
                f"{r.async_overhead_ns / 1e3:.3f}",
                f"{r.launched_ns / 1e3:.3f}",
                f"{r.launch_cost_ns / 1e3:.3f}",
            ]
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = [
        f"# core overhead (world size 1, one process, NullBackend; {first.dtype} tensors of {first.numel} element; "
        f"median of {first.repeats} batches of {first.iters} calls; microseconds per call)"
    ]
    for line in lines:
        out.append(
            "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths, strict=True)))
        )
    worst = max(rows, key=lambda r: r.overhead_ns)
    verdict = "within" if worst.overhead_us <= TARGET_US else "ABOVE"
    out.append("")
    out.append(
        f"# core overhead per blocking call: at most {worst.overhead_us:.2f} us ({worst.op}), "
        f"median over ops {statistics.median(r.overhead_us for r in rows):.2f} us; "
        f"{verdict} the target of {TARGET_US:g} us"
    )
    out.append(
        "# direct: the backend's method on an instance; blocking: group.OP(...); async+wait:\n"
        "# group.OP(..., async_op=True).wait(). overhead = blocking - direct, async overhead = async+wait - direct.\n"
        "# launched+wait: async+wait on a group whose backend launches (LaunchingNullBackend: its work is done at\n"
        "# once), so no thread hop; launch cost = launched+wait - blocking, the core's launch path.\n"
        "# Compare figures from one run on one machine; repeat the run to see the spread."
    )
    return "\n".join(out)
