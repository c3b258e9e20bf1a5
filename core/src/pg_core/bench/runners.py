"""The runners a rank measures: the :class:`Runner` protocol every row is timed through, a
pg-core :class:`~pg_core.ProcessGroup` through its public API (:class:`PgCoreRunner`) and
through its ``to_torch()`` face (:class:`ToTorchRunner`). The raw libraries beside them are
in :mod:`pg_core.bench.baselines`."""

from __future__ import annotations

from typing import Any, Final, Protocol

import torch

from ..dtypes import dtype_name
from .baselines import TorchGlooRunner
from .catalog import BLOCKING_OF, ECHO_OPS, OBJECT_OPS, REDUCING_OPS

__all__ = ["PgCoreRunner", "Runner", "ToTorchRunner"]


class Runner(Protocol):
    """What a rank times every row through: a pg-core group or a raw library, one method per
    call an op makes. ``why_not`` says why ``op`` cannot run on ``dtype`` (``None``: it can), the
    same answer on every rank; ``barrier`` lines the ranks up and returns ``False`` where the
    runner has none (the rank then uses the store); ``label`` is the rows' ``backend``."""

    label: str
    is_baseline: bool

    def why_not(self, op: str, dtype: torch.dtype) -> str | None: ...
    def barrier(self) -> bool: ...
    def all_reduce(self, t: torch.Tensor) -> None: ...
    def all_reduce_async(self, t: torch.Tensor) -> None: ...
    def broadcast(self, t: torch.Tensor, src: int) -> None: ...
    def broadcast_async(self, t: torch.Tensor, src: int) -> None: ...
    def reduce(self, t: torch.Tensor, dst: int) -> None: ...
    def all_gather_into_tensor(self, out: torch.Tensor, inp: torch.Tensor) -> None: ...
    def reduce_scatter_tensor(self, out: torch.Tensor, inp: torch.Tensor) -> None: ...
    def all_to_all_single(self, out: torch.Tensor, inp: torch.Tensor) -> None: ...
    def send(self, t: torch.Tensor, dst: int) -> None: ...
    def recv(self, t: torch.Tensor, src: int) -> None: ...
    def isend_wait(self, t: torch.Tensor, dst: int) -> None: ...
    def irecv_wait(self, t: torch.Tensor, src: int) -> None: ...
    def send_tensor(self, t: torch.Tensor, dst: int) -> None: ...
    def recv_tensor(self, src: int) -> torch.Tensor: ...
    def send_object(self, obj: object, dst: int) -> None: ...
    def recv_object(self, src: int) -> object: ...
    def broadcast_object(self, obj: object, src: int) -> object: ...
    def close(self) -> None: ...


# the ProcessGroup methods each op calls (beyond the backend ops that ``supports`` answers for)
_GROUP_METHODS: Final[dict[str, tuple[str, ...]]] = {
    "send_tensor": ("send_tensor", "recv_tensor"),
    "send_object": ("send_object", "recv_object"),
    "broadcast_object": ("broadcast_object",),
}


class PgCoreRunner:
    """A pg-core ProcessGroup, through its public API."""

    is_baseline = False

    def __init__(self, store: Any, rank: int, size: int, *, spec: str, label: str, timeout: float) -> None:
        from ..backend_refs import resolve_backend_ref
        from ..group import ProcessGroup

        self.label = label
        value = resolve_backend_ref(spec, "cpu")
        self.group = ProcessGroup(
            store, rank=rank, size=size, backends={"cpu": value}, name=f"bench-{label}", timeout=timeout
        )

    def why_not(self, op: str, dtype: torch.dtype) -> str | None:
        from ..ops import ReduceOp

        for method in _GROUP_METHODS.get(op, ()):
            if not callable(getattr(self.group, method, None)):
                return f"this pg-core's ProcessGroup has no {method}"
        if op == "broadcast_object":
            return None  # built by the core on whatever the backend declares
        reduce_op = ReduceOp.SUM if op in REDUCING_OPS else None
        of = None if op == "send_object" else dtype
        for name in ("send", "recv") if op in ECHO_OPS else (BLOCKING_OF.get(op, op),):
            if not self.group.supports(name, "cpu", of, reduce_op):
                return f"{self.label} does not declare {name}" + ("" if of is None else f" for {dtype_name(of)}")
        return None

    def barrier(self) -> bool:
        if not self.group.supports("barrier"):
            return False
        self.group.barrier()
        return True

    def all_reduce(self, t: torch.Tensor) -> None:
        self.group.all_reduce(t)

    def all_reduce_async(self, t: torch.Tensor) -> None:
        self.group.all_reduce(t, async_op=True).wait()  # type: ignore[union-attr]

    def broadcast(self, t: torch.Tensor, src: int) -> None:
        self.group.broadcast(t, src)

    def broadcast_async(self, t: torch.Tensor, src: int) -> None:
        self.group.broadcast(t, src, async_op=True).wait()  # type: ignore[union-attr]

    def reduce(self, t: torch.Tensor, dst: int) -> None:
        self.group.reduce(t, dst)

    def all_gather_into_tensor(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        self.group.all_gather_into_tensor(out, inp)

    def reduce_scatter_tensor(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        self.group.reduce_scatter_tensor(out, inp)

    def all_to_all_single(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        self.group.all_to_all_single(out, inp)

    def send(self, t: torch.Tensor, dst: int) -> None:
        self.group.send(t, dst)

    def recv(self, t: torch.Tensor, src: int) -> None:
        self.group.recv(t, src)

    def isend_wait(self, t: torch.Tensor, dst: int) -> None:
        self.group.isend(t, dst).wait()

    def irecv_wait(self, t: torch.Tensor, src: int) -> None:
        self.group.irecv(t, src).wait()

    def send_tensor(self, t: torch.Tensor, dst: int) -> None:
        self.group.send_tensor(t, dst)

    def recv_tensor(self, src: int) -> torch.Tensor:
        got: torch.Tensor = self.group.recv_tensor(src)
        return got

    def send_object(self, obj: object, dst: int) -> None:
        self.group.send_object(obj, dst)

    def recv_object(self, src: int) -> object:
        return self.group.recv_object(src)

    def broadcast_object(self, obj: object, src: int) -> object:
        return self.group.broadcast_object(obj, src)

    def close(self) -> None:
        self.group.shutdown()


class ToTorchRunner(TorchGlooRunner):
    """A pg-core group's ``to_torch()``, through torch's ``ProcessGroup`` API: the calls the
    torch-gloo baseline makes, so the two rows compare the group's torch face with raw Gloo."""

    is_baseline = False

    def __init__(self, of: PgCoreRunner) -> None:
        self._options(of.group.to_torch())
        self.label = f"{of.label}.to_torch"
        self._default_group = False

    def why_not(self, op: str, dtype: torch.dtype) -> str | None:
        if op in OBJECT_OPS or op == "send_tensor":
            return f"{op} is a pg-core group method, not a torch ProcessGroup one"
        return None

    def close(self) -> None:
        self.pg = None  # the group's own runner shuts the group down
