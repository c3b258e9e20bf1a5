"""Backends that do nothing, for measuring what is left when they are called through a group:
:class:`NullBackend` (every op returns at once, declaring every op and dtype) and
:class:`LaunchingNullBackend` (the same, launching: API 1.2). ``pg-core bench --overhead``
(:mod:`pg_core.bench.overhead`) times the core over them; tests use them as a backend whose
own cost is nil."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..backend import Backend, Capabilities
from ..ops import ReduceOp
from ..work import Work

__all__ = ["LaunchingNullBackend", "NullBackend"]


class NullBackend(Backend):
    """A backend whose every op returns at once, doing nothing; it declares every op and
    dtype. What is left when it is called through a group is the core's own cost."""

    capabilities = Capabilities()

    def send(self, tensor: torch.Tensor, dst: int, tag: int, *, timeout: float) -> None:
        return None

    def recv(self, tensor: torch.Tensor, src: int, tag: int, *, timeout: float) -> None:
        return None

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, *, timeout: float) -> Work | None:
        return None

    def prepared_all_reduce(
        self, dtype: torch.dtype, op: ReduceOp, *, timeout: float
    ) -> Callable[[torch.Tensor], None]:
        return _nothing  # as a torch C++ backend does (C10dBackend), so the group's hot path is measured

    def broadcast(self, tensor: torch.Tensor, src: int, *, timeout: float) -> Work | None:
        return None

    def reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp, *, timeout: float) -> Work | None:
        return None

    def all_gather(self, output_list: list[torch.Tensor], tensor: torch.Tensor, *, timeout: float) -> None:
        return None

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor, *, timeout: float) -> Work | None:
        return None

    def reduce_scatter(
        self, output: torch.Tensor, input_list: list[torch.Tensor], op: ReduceOp, *, timeout: float
    ) -> None:
        return None

    def reduce_scatter_tensor(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp, *, timeout: float
    ) -> Work | None:
        return None

    def all_to_all(self, output_list: list[torch.Tensor], input_list: list[torch.Tensor], *, timeout: float) -> None:
        return None

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        *,
        timeout: float,
    ) -> None:
        return None

    def gather(self, tensor: torch.Tensor, gather_list: list[torch.Tensor] | None, dst: int, *, timeout: float) -> None:
        return None

    def scatter(
        self, tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None, src: int, *, timeout: float
    ) -> None:
        return None

    def barrier(self, *, timeout: float) -> Work | None:
        return None


def _nothing(tensor: torch.Tensor) -> None:
    return None


class LaunchingNullBackend(NullBackend):
    """:class:`NullBackend` that launches (API 1.2): every collective called with
    ``async_op=True`` returns a :class:`~pg_core.work.Work` that is already complete, so what
    the group adds around a launch is what is left; so do its own ``isend`` and ``irecv``."""

    launches = True

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, *, timeout: float, async_op: bool = False) -> Work | None:
        return Work.completed("all_reduce") if async_op else None

    def broadcast(self, tensor: torch.Tensor, src: int, *, timeout: float, async_op: bool = False) -> Work | None:
        return Work.completed("broadcast") if async_op else None

    def reduce(
        self, tensor: torch.Tensor, dst: int, op: ReduceOp, *, timeout: float, async_op: bool = False
    ) -> Work | None:
        return Work.completed("reduce") if async_op else None

    def all_gather_into_tensor(
        self, output: torch.Tensor, input: torch.Tensor, *, timeout: float, async_op: bool = False
    ) -> Work | None:
        return Work.completed("all_gather_into_tensor") if async_op else None

    def reduce_scatter_tensor(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp, *, timeout: float, async_op: bool = False
    ) -> Work | None:
        return Work.completed("reduce_scatter_tensor") if async_op else None

    def barrier(self, *, timeout: float, async_op: bool = False) -> Work | None:
        return Work.completed("barrier") if async_op else None

    def isend(self, tensor: torch.Tensor, dst: int, tag: int, *, timeout: float) -> Work:
        return Work.completed("isend")  # its own isend, as every shipped backend has: no helper thread

    def irecv(self, tensor: torch.Tensor, src: int, tag: int, *, timeout: float) -> Work:
        return Work.completed("irecv")
