"""Names shared by users, the core and plugins: reduce operations and op names.

``ReduceOp`` mirrors ``torch.distributed.ReduceOp`` (``ReduceOp.SUM``,
``ReduceOp.premul_sum(factor)``) and accepts torch's values, so code written for
torch.distributed carries over unchanged.
"""

from __future__ import annotations

import enum
from typing import Any, ClassVar, Final

import torch

__all__ = [
    "COLLECTIVE_OPS",
    "OPS",
    "OPTIONAL_OPS",
    "P2P_OPS",
    "RedOpType",
    "ReduceOp",
    "as_reduce_op",
]


class RedOpType(enum.Enum):
    """The kind of a reduction; ``PREMUL_SUM`` carries a factor in :class:`ReduceOp`."""

    SUM = "sum"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"
    AVG = "avg"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"
    PREMUL_SUM = "premul_sum"

    def __repr__(self) -> str:
        return f"RedOpType.{self.name}"

    # Members are singletons compared by identity, so identity is their hash: Enum's own
    # hashes the name in Python, and the capability check hashes one on every call.
    __hash__ = object.__hash__


class ReduceOp:
    """A reduction: one of the class constants, or ``ReduceOp.premul_sum(factor)``.

    ``premul_sum(f)`` multiplies every rank's input by ``f`` before summing, the
    way ``torch.distributed._make_nccl_premul_sum`` does; ``f`` is a Python number
    or a 0-d / one-element tensor.
    """

    SUM: ClassVar[ReduceOp]
    PRODUCT: ClassVar[ReduceOp]
    MIN: ClassVar[ReduceOp]
    MAX: ClassVar[ReduceOp]
    AVG: ClassVar[ReduceOp]
    BAND: ClassVar[ReduceOp]
    BOR: ClassVar[ReduceOp]
    BXOR: ClassVar[ReduceOp]

    __slots__ = ("factor", "type")

    def __init__(self, type: RedOpType, factor: float | complex | torch.Tensor | None = None) -> None:
        if not isinstance(type, RedOpType):
            raise TypeError(f"ReduceOp type must be a RedOpType, got {type!r}")
        if (type is RedOpType.PREMUL_SUM) != (factor is not None):
            raise ValueError("a factor is given with PREMUL_SUM and only with PREMUL_SUM")
        if isinstance(factor, torch.Tensor) and factor.numel() != 1:
            raise ValueError(f"premul_sum factor must have one element, got shape {tuple(factor.shape)}")
        self.type = type
        self.factor = factor

    @staticmethod
    def premul_sum(factor: float | complex | torch.Tensor) -> ReduceOp:
        """Sum of every rank's input multiplied by ``factor``."""
        if not isinstance(factor, (int, float, complex, torch.Tensor)) or isinstance(factor, bool):
            raise TypeError(f"premul_sum factor must be a number or a tensor, got {type(factor).__name__}")
        return ReduceOp(RedOpType.PREMUL_SUM, factor)

    def factor_value(self) -> float | complex:
        """The premul factor as a Python number (``PREMUL_SUM`` only)."""
        if self.factor is None:
            raise ValueError(f"{self!r} has no factor")
        if isinstance(self.factor, torch.Tensor):
            return self.factor.item()  # type: ignore[return-value]
        return self.factor

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RedOpType):
            return self.factor is None and self.type is other
        if not isinstance(other, ReduceOp):
            return NotImplemented
        if self.type is not other.type:
            return False
        if self.factor is None or other.factor is None:
            return self.factor is other.factor
        return self.factor_value() == other.factor_value()

    def __hash__(self) -> int:
        return hash((self.type, None if self.factor is None else self.factor_value()))

    def __repr__(self) -> str:
        if self.type is RedOpType.PREMUL_SUM:
            return f"ReduceOp.premul_sum({self.factor_value()!r})"
        return f"ReduceOp.{self.type.name}"

    def __reduce__(self) -> tuple[Any, ...]:
        factor = None if self.factor is None else self.factor_value()
        return (ReduceOp, (self.type, factor))


for _t in RedOpType:
    if _t is not RedOpType.PREMUL_SUM:
        setattr(ReduceOp, _t.name, ReduceOp(_t))


def as_reduce_op(op: object) -> ReduceOp:
    """Normalise ``op`` (a :class:`ReduceOp`, a :class:`RedOpType`, a name such as
    ``"sum"``, or a ``torch.distributed.ReduceOp``) to a :class:`ReduceOp`."""
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, RedOpType):
        if op is RedOpType.PREMUL_SUM:
            raise ValueError("PREMUL_SUM needs a factor: use ReduceOp.premul_sum(factor)")
        return ReduceOp(op)
    if isinstance(op, str):
        try:
            return as_reduce_op(RedOpType[op.upper()])
        except KeyError:
            raise ValueError(
                f"unknown reduce op {op!r}; expected one of {', '.join(t.name for t in RedOpType)}"
            ) from None
    # torch.distributed.ReduceOp and its RedOpType: matched by name, never imported eagerly.
    name = getattr(op, "name", None)
    if name is None and hasattr(op, "op"):
        name = getattr(op.op, "name", None)  # torch's ReduceOp instance wraps a RedOpType
    if isinstance(name, str) and name in RedOpType.__members__ and name != "PREMUL_SUM":
        return ReduceOp(RedOpType[name])
    raise TypeError(f"expected a pg_core.ReduceOp, got {op!r} ({type(op).__name__})")


#: Collective operations, by the names the ``ProcessGroup`` methods have.
COLLECTIVE_OPS: Final[tuple[str, ...]] = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "barrier",
)
#: Point-to-point operations (``isend``/``irecv`` are ``send``/``recv`` with ``async_op``).
P2P_OPS: Final[tuple[str, ...]] = ("send", "recv")
#: The ops of the default :class:`~pg_core.backend.Capabilities`: every collective and
#: ``send``/``recv``, which every backend has (the collectives' defaults are written on
#: ``send``/``recv``).
OPS: Final[tuple[str, ...]] = COLLECTIVE_OPS + P2P_OPS
#: Ops a backend has only where it implements them and names them in ``Capabilities.ops``:
#: the default ``Capabilities()`` leaves them out, since the core cannot build them from
#: ``send``/``recv``. ``recv_anysource`` (API 1.4): ``recv``/``irecv`` with ``src=None``, the
#: next message on a tag from whichever rank sent it.
OPTIONAL_OPS: Final[tuple[str, ...]] = ("recv_anysource",)
