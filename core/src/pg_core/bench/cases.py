"""One op on one runner with its buffers (:class:`Case`): the call that is timed, and around it
the refill, the poison and the output the rank checks; :func:`timed`, the one timing of a call.
Nothing here runs between the clock's two readings but the runner's call."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch

from .catalog import ROOT
from .inputs import NOTHING, POISON, input_values, request_object, tensor_shape
from .runners import Runner

__all__ = ["Case", "make_case", "timed"]


@dataclasses.dataclass
class Case:
    """One op on one runner with its buffers: ``run`` is what is timed."""

    run: Callable[[], None]
    refill: Callable[[], None]  # before every iteration (outside the timing)
    poison: Callable[[], None]  # before the last one, so a stale output cannot pass
    output: Callable[[], object]  # a tensor (None if missing), or an object op's result


def _noop() -> None:
    return None


def make_case(op: str, r: Runner, *, rank: int, n: int, count: int, dtype: torch.dtype) -> Case | None:
    """The buffers and the call for ``op``; ``None`` on ranks that take no part (the
    echo ops beyond rank 1)."""
    if op in ("send_tensor", "send_object", "broadcast_object"):
        return _make_returning_case(op, r, rank=rank, count=count, dtype=dtype)
    if op in ("all_reduce", "all_reduce_async", "reduce", "broadcast", "broadcast_async"):
        pristine = input_values(rank, count, dtype)
        buf = pristine.clone()

        def restore() -> None:
            buf.copy_(pristine)

        if op == "all_reduce":
            return Case(lambda: r.all_reduce(buf), restore, _noop, lambda: buf)
        if op == "all_reduce_async":
            return Case(lambda: r.all_reduce_async(buf), restore, _noop, lambda: buf)
        if op == "broadcast_async":
            return Case(lambda: r.broadcast_async(buf, ROOT), _noop, restore, lambda: buf)
        if op == "reduce":
            return Case(lambda: r.reduce(buf, ROOT), restore, _noop, lambda: buf)
        # broadcast: the root's buffer is unchanged; other ranks' own inputs differ from the root's
        return Case(lambda: r.broadcast(buf, ROOT), _noop, restore, lambda: buf)
    if op in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"):
        pristine = input_values(rank, count // n if op == "all_gather_into_tensor" else count, dtype)
        inp = pristine.clone()
        out = torch.empty(count // n if op == "reduce_scatter_tensor" else count, dtype=dtype)

        def refill_input() -> None:
            inp.copy_(pristine)

        def poison() -> None:
            out.fill_(POISON)

        if op == "all_gather_into_tensor":
            return Case(lambda: r.all_gather_into_tensor(out, inp), _noop, poison, lambda: out)
        if op == "reduce_scatter_tensor":
            return Case(lambda: r.reduce_scatter_tensor(out, inp), refill_input, poison, lambda: out)
        return Case(lambda: r.all_to_all_single(out, inp), _noop, poison, lambda: out)
    if op in ("send_recv", "isend_irecv"):
        if rank > 1:
            return None
        msg = input_values(0, count, dtype)
        got = torch.empty(count, dtype=dtype)

        def poison_got() -> None:
            got.fill_(POISON)

        send, recv = (r.send, r.recv) if op == "send_recv" else (r.isend_wait, r.irecv_wait)
        if rank == 0:

            def ping() -> None:
                send(msg, 1)
                recv(got, 1)

            return Case(ping, _noop, poison_got, lambda: got)

        def pong() -> None:
            recv(got, 0)
            send(got, 0)

        return Case(pong, _noop, poison_got, lambda: got)
    raise ValueError(f"unknown op {op!r}")


def _make_returning_case(op: str, r: Runner, *, rank: int, count: int, dtype: torch.dtype) -> Case | None:
    """The ops whose receivers get a new tensor or object (checked: the last one received)."""
    got: list[object] = [NOTHING]

    def poison() -> None:
        got[0] = NOTHING

    def output() -> object:
        return None if got[0] is NOTHING and op == "send_tensor" else got[0]

    if op == "broadcast_object":
        obj = request_object(count) if rank == ROOT else None

        def bcast() -> None:
            got[0] = r.broadcast_object(obj, ROOT)

        return Case(bcast, _noop, poison, output)
    if rank > 1:
        return None
    if op == "send_tensor":
        msg: object = input_values(0, count, dtype).reshape(tensor_shape(count))
        send: Callable[[Any, int], None] = r.send_tensor
        recv: Callable[[int], object] = r.recv_tensor
    else:
        msg, send, recv = request_object(count), r.send_object, r.recv_object
    if rank == 0:

        def ping() -> None:
            send(msg, 1)
            got[0] = recv(1)

        return Case(ping, _noop, poison, output)

    def pong() -> None:
        got[0] = recv(0)
        send(got[0], 0)

    return Case(pong, _noop, poison, output)


def timed(run: Callable[[], None]) -> int:
    """Nanoseconds ``run()`` took: :func:`time.perf_counter_ns` on either side, nothing else."""
    start = time.perf_counter_ns()
    run()
    return time.perf_counter_ns() - start
