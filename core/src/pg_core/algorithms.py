"""Every collective, written once on point-to-point messages.

These are the defaults of :class:`pg_core.backend.Backend`: a backend that
implements only ``send`` and ``recv`` gets all of them. They run on a
:class:`Channel`, which a backend may build with its own framing.

Guarantees every algorithm here keeps:

* all ranks end with bitwise-identical ``all_reduce`` / ``reduce_scatter``
  results (every element is reduced once, in an order fixed by the algorithm,
  then copied);
* inputs that the operation does not define as outputs are left unchanged;
* zero-element tensors work (they still exchange empty messages, so ranks stay in
  step);
* every wait is bounded by the channel's deadline.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Final, Protocol

import torch

from .errors import CollectiveTimeout
from .ops import RedOpType, ReduceOp
from .work import Work

if TYPE_CHECKING:
    from .backend import Backend

__all__ = [
    "COLLECTIVE_TAG",
    "BackendChannel",
    "Channel",
]

#: The tag the default channel uses for collective traffic. User tags are ``>= 0``;
#: negative tags belong to the core.
COLLECTIVE_TAG: Final[int] = -1


class Channel(Protocol):
    """Point-to-point messaging between the ranks of one group, for one operation.

    ``send`` returns when the tensor may be reused and never waits for the
    receiver to post its receive; ``recv`` fills the tensor with the next message
    from ``peer`` on this channel (messages between two ranks arrive in order).
    ``isend``/``irecv`` start the same and return a :class:`Work`;
    ``sendrecv`` does both at once and is how ring steps exchange data without
    deadlock. A channel's deadline bounds every call: past it they raise
    :class:`~pg_core.errors.CollectiveTimeout`.
    """

    rank: int
    size: int

    def send(self, tensor: torch.Tensor, peer: int) -> None: ...

    def recv(self, tensor: torch.Tensor, peer: int) -> None: ...

    def isend(self, tensor: torch.Tensor, peer: int) -> Work: ...

    def irecv(self, tensor: torch.Tensor, peer: int) -> Work: ...

    def sendrecv(self, send_tensor: torch.Tensor, dst: int, recv_tensor: torch.Tensor, src: int) -> None: ...

    def wait(self, work: Work) -> None: ...


class BackendChannel:
    """The default :class:`Channel`: a backend's ``send``/``recv``/``isend``/``irecv``
    with tag :data:`COLLECTIVE_TAG` and one deadline for the whole operation."""

    def __init__(self, backend: Backend, timeout: float, tag: int = COLLECTIVE_TAG) -> None:
        self.backend = backend
        self.rank = backend.rank
        self.size = backend.size
        self.tag = tag
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout

    def remaining(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise CollectiveTimeout(f"collective exceeded its timeout of {self.timeout:g} s")
        return left

    def send(self, tensor: torch.Tensor, peer: int) -> None:
        self.backend.send(tensor, peer, self.tag, timeout=self.remaining())

    def recv(self, tensor: torch.Tensor, peer: int) -> None:
        self.backend.recv(tensor, peer, self.tag, timeout=self.remaining())

    def isend(self, tensor: torch.Tensor, peer: int) -> Work:
        return self.backend.isend(tensor, peer, self.tag, timeout=self.remaining())

    def irecv(self, tensor: torch.Tensor, peer: int) -> Work:
        return self.backend.irecv(tensor, peer, self.tag, timeout=self.remaining())

    def sendrecv(self, send_tensor: torch.Tensor, dst: int, recv_tensor: torch.Tensor, src: int) -> None:
        work = self.isend(send_tensor, dst)
        self.recv(recv_tensor, src)
        self.wait(work)

    def wait(self, work: Work) -> None:
        work.wait(self.remaining())


# -- reductions ------------------------------------------------------------------

_PAIRWISE = {
    RedOpType.SUM: torch.Tensor.add_,
    RedOpType.PRODUCT: torch.Tensor.mul_,
    RedOpType.BAND: torch.Tensor.bitwise_and_,
    RedOpType.BOR: torch.Tensor.bitwise_or_,
    RedOpType.BXOR: torch.Tensor.bitwise_xor_,
}


def combine_(acc: torch.Tensor, other: torch.Tensor, op: RedOpType) -> None:
    """``acc = acc (op) other`` in place, for the pairwise ops (SUM for AVG/PREMUL_SUM)."""
    if op is RedOpType.MIN:
        torch.minimum(acc, other, out=acc)
    elif op is RedOpType.MAX:
        torch.maximum(acc, other, out=acc)
    elif op in (RedOpType.AVG, RedOpType.PREMUL_SUM):
        acc.add_(other)
    else:
        _PAIRWISE[op](acc, other)
