"""``C10dBackend``: the base of backends that wrap a torch C++ backend (``ProcessGroupGloo``,
``ProcessGroupNCCL``, a vendor's ``c10d::Backend``).

Every collective is the torch backend's own call, with the call's timeout in its options,
waited for in the calling thread; torch's ``RuntimeError`` goes through the subclass's
:meth:`C10dBackend._error` into pg-core's errors. A subclass builds the torch object in its
constructor (from ``ctx.store``, seen through :class:`pg_core.store.PolledStore`), returns it
from :attr:`C10dBackend.c10d`, and overrides what its library does differently (pg-gloo:
dtypes moved as bytes, ``reduce`` off the root on a copy, uneven ``all_to_all``).

``c10d`` is also what ``ProcessGroup.to_torch()`` registers on a torch ``ProcessGroup``, so
torch-side calls (DDP's) reach that very object with no Python in between.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Final

import torch
import torch._C._distributed_c10d as c10d
import torch.distributed as dist

from .backend import Backend
from .ops import RedOpType, ReduceOp

__all__ = ["REDUCE_OPS", "C10dBackend", "flat_bytes", "torch_reduce_op"]

#: pg-core's reduce ops as torch's (``PREMUL_SUM`` carries a factor: see :func:`torch_reduce_op`).
REDUCE_OPS: Final[dict[RedOpType, Any]] = {
    RedOpType.SUM: dist.ReduceOp.SUM,
    RedOpType.PRODUCT: dist.ReduceOp.PRODUCT,
    RedOpType.MIN: dist.ReduceOp.MIN,
    RedOpType.MAX: dist.ReduceOp.MAX,
    RedOpType.AVG: dist.ReduceOp.AVG,
    RedOpType.BAND: dist.ReduceOp.BAND,
    RedOpType.BOR: dist.ReduceOp.BOR,
    RedOpType.BXOR: dist.ReduceOp.BXOR,
}


def torch_reduce_op(op: ReduceOp) -> Any:
    """``op`` as torch's ``ReduceOp`` (``PREMUL_SUM`` through torch's factory for it)."""
    if op.type is RedOpType.PREMUL_SUM:
        return dist._make_nccl_premul_sum(op.factor)  # type: ignore[arg-type]  # a complex factor too
    return REDUCE_OPS[op.type]


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A dense tensor's memory as a 1-D ``uint8`` view."""
    return t.reshape(-1).view(torch.uint8)


def _seconds(timeout: float) -> timedelta:
    return timedelta(seconds=max(timeout, 0.001))


class C10dBackend(Backend):
    """A pg-core backend whose operations are a torch C++ backend's (see the module docstring)."""

    #: dtypes the torch backend cannot move: the copying collectives (broadcast, the gathers,
    #: scatters and all-to-alls) hand it their bytes instead, which is exact
    as_bytes: frozenset[torch.dtype] = frozenset()

    @property
    def c10d(self) -> Any:
        """The torch backend object (``torch._C._distributed_c10d.Backend``)."""
        raise NotImplementedError(f"{type(self).__name__} must return its torch backend from c10d")

    def _ready(self, what: str, peers: Sequence[int] = ()) -> Any:
        """The torch object, or the error this backend's state calls for, before anything is sent."""
        return self.c10d

    def _error(self, exc: BaseException, what: str, timeout: float, peers: Sequence[int] = ()) -> BaseException:
        """Torch's error as pg-core's; the default returns it unchanged."""
        return exc

    def _movable(self, t: torch.Tensor) -> torch.Tensor:
        """What a copying collective hands the torch backend for ``t``: ``t`` itself, or for a
        dtype in :attr:`as_bytes` a view of its bytes with the same dim 0 (split sizes still
        count rows)."""
        if t.dtype not in self.as_bytes:
            return t
        if t.dim() == 0:
            t = t.reshape(1)
        return t.reshape(t.shape[0], math.prod(t.shape[1:])).view(torch.uint8)

    def _flat(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as one flat run of elements (of bytes for a dtype in :attr:`as_bytes`)."""
        return flat_bytes(t) if t.dtype in self.as_bytes else t.reshape(-1)

    def _wait(
        self, post: Callable[[], Any], what: str, timeout: float, peers: Sequence[int] = (), *, bounded: bool = False
    ) -> None:
        """Post an operation (``post()`` returns the torch backend's work) and wait for it, in pg-core's errors."""
        try:
            work = post()
            if bounded:  # point to point: the work's wait takes the bound (a collective carries it in its options)
                work.wait(_seconds(timeout))
            else:
                work.wait()
        except RuntimeError as exc:
            raise self._error(exc, what, timeout, peers) from exc

    # -- collectives: the torch backend's own ------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, *, timeout: float) -> None:
        pg = self._ready("all_reduce")
        opts = c10d.AllreduceOptions()
        opts.reduceOp = torch_reduce_op(op)
        opts.timeout = _seconds(timeout)
        self._wait(lambda: pg.allreduce([tensor], opts), "all_reduce", timeout)

    def broadcast(self, tensor: torch.Tensor, src: int, *, timeout: float) -> None:
        pg = self._ready("broadcast")
        opts = c10d.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        opts.timeout = _seconds(timeout)
        self._wait(lambda: pg.broadcast([self._movable(tensor)], opts), "broadcast", timeout)

    def reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp, *, timeout: float) -> None:
        pg = self._ready("reduce")
        opts = c10d.ReduceOptions()
        opts.reduceOp = torch_reduce_op(op)
        opts.rootRank = dst
        opts.rootTensor = 0
        opts.timeout = _seconds(timeout)
        self._wait(lambda: pg.reduce([tensor], opts), "reduce", timeout)

    def all_gather(self, output_list: list[torch.Tensor], tensor: torch.Tensor, *, timeout: float) -> None:
        pg = self._ready("all_gather")
        opts = c10d.AllgatherOptions()
        opts.timeout = _seconds(timeout)
        outs = [self._movable(t) for t in output_list]
        self._wait(lambda: pg.allgather([outs], [self._movable(tensor)], opts), "all_gather", timeout)

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor, *, timeout: float) -> None:
        pg = self._ready("all_gather_into_tensor")
        opts = c10d.AllgatherOptions()
        opts.timeout = _seconds(timeout)
        # flat: torch's backends want the output in rows shaped like the input, the core allows (size, *shape) too
        out, inp = self._flat(output), self._flat(input)
        self._wait(lambda: pg._allgather_base(out, inp, opts), "all_gather_into_tensor", timeout)

    def reduce_scatter(
        self, output: torch.Tensor, input_list: list[torch.Tensor], op: ReduceOp, *, timeout: float
    ) -> None:
        pg = self._ready("reduce_scatter")
        opts = c10d.ReduceScatterOptions()
        opts.reduceOp = torch_reduce_op(op)
        opts.timeout = _seconds(timeout)
        self._wait(lambda: pg.reduce_scatter([output], [input_list], opts), "reduce_scatter", timeout)

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp, *, timeout: float) -> None:
        pg = self._ready("reduce_scatter_tensor")
        opts = c10d.ReduceScatterOptions()
        opts.reduceOp = torch_reduce_op(op)
        opts.timeout = _seconds(timeout)
        self._wait(
            lambda: pg._reduce_scatter_base(output.reshape(-1), input.reshape(-1), opts),
            "reduce_scatter_tensor",
            timeout,
        )

    def all_to_all(self, output_list: list[torch.Tensor], input_list: list[torch.Tensor], *, timeout: float) -> None:
        pg = self._ready("all_to_all")
        opts = c10d.AllToAllOptions()
        opts.timeout = _seconds(timeout)
        outs = [self._flat(t) for t in output_list]
        ins = [self._flat(t) for t in input_list]
        self._wait(lambda: pg.alltoall(outs, ins, opts), "all_to_all", timeout)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        *,
        timeout: float,
    ) -> None:
        pg = self._ready("all_to_all_single")
        opts = c10d.AllToAllOptions()
        opts.timeout = _seconds(timeout)
        out, inp = self._movable(output), self._movable(input)
        out_splits, in_splits = list(output_split_sizes), list(input_split_sizes)
        self._wait(lambda: pg.alltoall_base(out, inp, out_splits, in_splits, opts), "all_to_all_single", timeout)

    def gather(self, tensor: torch.Tensor, gather_list: list[torch.Tensor] | None, dst: int, *, timeout: float) -> None:
        pg = self._ready("gather")
        opts = c10d.GatherOptions()
        opts.rootRank = dst
        opts.timeout = _seconds(timeout)
        outs = [[self._movable(t) for t in gather_list]] if gather_list is not None else []
        self._wait(lambda: pg.gather(outs, [self._movable(tensor)], opts), "gather", timeout)

    def scatter(
        self, tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None, src: int, *, timeout: float
    ) -> None:
        pg = self._ready("scatter")
        opts = c10d.ScatterOptions()
        opts.rootRank = src
        opts.timeout = _seconds(timeout)
        ins = [[self._movable(t) for t in scatter_list]] if scatter_list is not None else []
        self._wait(lambda: pg.scatter([self._movable(tensor)], ins, opts), "scatter", timeout)

    def barrier(self, *, timeout: float) -> None:
        pg = self._ready("barrier")
        opts = c10d.BarrierOptions()
        opts.timeout = _seconds(timeout)
        self._wait(lambda: pg.barrier(opts), "barrier", timeout)
