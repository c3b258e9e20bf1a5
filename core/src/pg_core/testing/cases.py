"""What a conformance example is: plain data that names the calls and where their tensors come from.

An :class:`Example` is plain data (JSON round-trips it exactly, which is what the
one-line reproduction carries): a world size, a device type, a seed, and one or
more *lanes*. A lane is a group formed by some of the ranks (all of them, or an
overlapping subset for the concurrent-groups check) and the :class:`Call` s it
runs in order. Every tensor is derived from ``(seed, lane, step, rank, role)``
(:mod:`pg_core.testing.tensors`), so the rank processes and the controller build
bit-identical inputs without sending them anywhere: :mod:`pg_core.testing.buffers`
makes what a rank passes to a call, and :mod:`pg_core.testing.reference` what it
must get back, in float64.

This module is imported by the rank processes and by the controller; it needs
torch and pg_core, not hypothesis or pytest.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ..dtypes import NAMES
from ..objects import VALUE_COLLECTIVES
from ..ops import RedOpType, ReduceOp
from .values import describe_spec

__all__ = [
    "DTYPE_NAMES",
    "EXTREME",
    "VALUE_OPS",
    "Call",
    "Example",
    "Lane",
    "depends_on",
    "dtype_of",
]

#: The declarable dtypes by name: :data:`pg_core.dtypes.NAMES`, the one table.
DTYPE_NAMES: dict[str, torch.dtype] = NAMES


#: Ops whose calls move values (objects, tensors of unknown shape, tensor dicts) or
#: form subgroups: described by value specs, judged by :mod:`pg_core.testing.values`.
VALUE_OPS: frozenset[str] = frozenset({"messages", *VALUE_COLLECTIVES, "split", "new_group"})

#: ``Call.params["values"]``: ``"extreme"`` draws from each dtype's whole range
#: (:func:`~pg_core.testing.tensors.extreme_tensor`); absent, the comfortable ranges of
#: :func:`~pg_core.testing.tensors.random_tensor`.
EXTREME = "extreme"


def dtype_of(name: str) -> torch.dtype:
    """The declarable dtype ``name`` spells (``"float32"`` -> ``torch.float32``)."""
    return DTYPE_NAMES[name]


@dataclass
class Call:
    """One operation of a lane.

    ``op`` is a ProcessGroup collective, a value collective (``broadcast_object``,
    ``all_gather_object``, ``gather_object``, ``scatter_object``,
    ``broadcast_tensor_dict``), ``"p2p"`` (a set of tensor messages), ``"any_source"``
    (tensor messages to one rank, which receives them from any source or naming the
    sender in a drawn order: ``receiver``, ``messages`` as ``[sender, tag]``, ``plan`` as
    ``[sender or None, tag]`` per receive, ``mode``), ``"messages"``
    (a set of value messages: objects, tensors of unknown shape, tensor dicts, and
    tensor sends of a known shape on the same tags), a subgroup formation
    (``"split"``, ``"new_group"``: the subgroup is another lane of the example), or
    one of the probes ``"undeclared"``, ``"bad_input"``, ``"timeout"``. ``shape``
    is the per-rank piece; ``layout`` is ``"contig"`` (a fresh tensor), ``"bucket"`` (a
    contiguous view at a non-zero offset of a flat storage, between sentinels), ``"strided"``
    (every other element of a wider buffer) or ``"transposed"``. ``late``: with ``async_op``,
    the rank that calls last, after every other rank has checked that its ``Work``
    is not complete yet. ``params`` holds what only some ops take (``reduce``,
    ``factor``, ``root``, ``splits``, ``out_form``, ``messages``, value specs
    ``obj``/``objs`` (see :mod:`pg_core.testing.values`), ...).
    """

    op: str
    dtype: str = "float32"
    shape: tuple[int, ...] = ()
    layout: str = "contig"
    async_op: bool = False
    late: int | None = None
    params: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.shape = tuple(self.shape)

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_of(self.dtype)

    def reduce_op(self) -> ReduceOp:
        kind = RedOpType[self.params["reduce"]]
        if kind == RedOpType.PREMUL_SUM:
            return ReduceOp.premul_sum(float(self.params["factor"]))
        return ReduceOp(kind)

    def split_rows(self) -> list[list[int]]:
        """``params["splits"]`` of an ``all_to_all`` / ``all_to_all_single``: row ``i``, column
        ``j`` is how many rows of the piece rank ``i`` sends to rank ``j``."""
        splits: list[list[int]] = self.params["splits"]
        return splits

    def describe(self) -> str:
        if self.op in VALUE_OPS:
            return self._describe_values()
        if self.op == "any_source":
            return self._describe_any_source()
        bits = [self.op]
        if self.op not in ("p2p", "barrier", "undeclared", "bad_input", "timeout"):
            bits.append(f"{self.dtype}{list(self.shape)}")
            if self.layout != "contig":
                bits.append(self.layout)
        for key, value in self.params.items():
            bits.append(f"{key}={value}")
        if self.async_op:
            bits.append("async" + (f" late={self.late}" if self.late is not None else ""))
        return " ".join(str(b) for b in bits)

    def _describe_any_source(self) -> str:
        p = self.params
        bits = [self.op, f"{self.dtype}{list(self.shape)}", *([self.layout] if self.layout != "contig" else [])]
        bits += [f"receiver={p['receiver']}", f"mode={p['mode']}"]
        sent = ", ".join(f"{src}->{p['receiver']} tag={tag}" for src, tag in p["messages"])
        plan = ", ".join(("any" if src is None else f"from {src}") + f" tag={tag}" for src, tag in p["plan"])
        return "\n".join(
            [" ".join(bits), f"        sent in this order by each rank: {sent}", f"        received: {plan}"]
        )

    def _describe_values(self) -> str:
        p = self.params
        bits = [self.op]
        lines = []
        if self.op == "messages":
            bits.append(f"mode={p['mode']}")
            if p["mode"] == "async":
                bits.append(f"recv_order={p['recv_order']}")
            for m, (src, dst, tag, kind, recv_as, spec) in enumerate(p["messages"]):
                lines.append(
                    f"        #{m} {src}->{dst} tag={tag} {kind} {describe_spec(spec)} (received with {recv_as})"
                )
        elif self.op == "split":
            bits.append(f"colors={p['colors']} keys={p['keys']}")
            bits += [f"color {c} -> lane {li}" for c, li in p["lanes"]]
        elif self.op == "new_group":
            bits.append(f"ranks={p['ranks']} -> lane {p['lane']}")
        else:
            if "root" in p:
                bits.append(f"root={p['root']}")
            if "obj" in p:
                bits.append(f"obj={describe_spec(p['obj'])}")
            if "objs" in p:
                bits.append("objs=[" + "; ".join(describe_spec(o) for o in p["objs"]) + "]")
            if p.get("device"):
                bits.append(f"device={p['device']}")
        if p.get("name"):
            bits.append(f"name={p['name']}")
        if self.async_op and self.op != "messages":
            bits.append("async" + (f" late={self.late}" if self.late is not None else ""))
        elif self.late is not None:
            bits.append(f"late={self.late}")
        return "\n".join([" ".join(str(b) for b in bits), *lines])


@dataclass
class Lane:
    """A group formed by ``members`` (rank ``i`` of the lane is ``members[i]``, a
    rank of the world) and the calls it runs; ``wait_order`` is the order in which
    the async calls' ``Work`` s are waited (indices into ``calls``).

    ``parent``: ``None`` for a group formed on its own; for a subgroup, the lane
    whose ``split`` or ``new_group`` call forms it. Its members run its calls right
    after that call, then shut it down.

    ``coalesced``: ``None``, or ``"blocking"`` / ``"async"``: the lane's calls are made
    inside one ``group.coalescing()`` block with that ``async_op``."""

    members: list[int]
    calls: list[Call]
    wait_order: list[int] = field(default_factory=list)
    parent: int | None = None
    coalesced: str | None = None


@dataclass
class Example:
    world_size: int
    device: str
    seed: int
    lanes: list[Lane]

    def to_json(self) -> str:
        raw = dataclasses.asdict(self)
        for lane in raw["lanes"]:
            if lane["parent"] is None:
                del lane["parent"]  # examples without subgroups read as they always did
            if lane["coalesced"] is None:
                del lane["coalesced"]
        return json.dumps(raw, separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Example:
        raw = json.loads(text)
        lanes = [
            Lane(
                members=list(lane["members"]),
                calls=[Call(**{**c, "shape": tuple(c["shape"])}) for c in lane["calls"]],
                wait_order=list(lane["wait_order"]),
                parent=lane.get("parent"),
                coalesced=lane.get("coalesced"),
            )
            for lane in raw["lanes"]
        ]
        return cls(world_size=raw["world_size"], device=raw["device"], seed=raw["seed"], lanes=lanes)

    def describe(self) -> str:
        lines = [f"world size {self.world_size}, device {self.device}, seed {self.seed}"]
        for li, lane in enumerate(self.lanes):
            head = f"  lane {li} (ranks {lane.members})" if len(self.lanes) > 1 else "  calls"
            if lane.parent is not None:
                head = f"  lane {li} (ranks {lane.members}, a subgroup of lane {lane.parent})"
            if lane.coalesced is not None:
                head += f" in one coalescing block ({lane.coalesced})"
            lines.append(head + ":")
            for ci, call in enumerate(lane.calls):
                lines.append(f"    [{ci}] {call.describe()}")
            if lane.wait_order:
                lines.append(f"    waits in order {lane.wait_order}")
        return "\n".join(lines)


def depends_on(call: Call, rank: int, late: int, n: int) -> bool:
    """Whether ``rank`` cannot finish ``call`` before rank ``late`` has called it."""
    if rank == late or n < 2:
        return False
    op, p = call.op, call.params
    piece = math.prod(call.shape)
    if op == "barrier":
        return True
    if op in ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor"):
        return piece > 0
    if op in {"broadcast", "scatter"}:
        return bool(p["root"] == late and piece > 0)
    if op in ("reduce", "gather"):
        return bool(p["root"] == rank and piece > 0)
    if op in ("all_to_all", "all_to_all_single"):
        return bool(call.split_rows()[late][rank] > 0 and math.prod(call.shape) > 0)
    # value collectives: a message always carries bytes
    if op in ("all_gather_object",):
        return True
    if op in ("broadcast_object", "broadcast_tensor_dict", "scatter_object"):
        return bool(p["root"] == late)
    if op == "gather_object":
        return bool(p["root"] == rank)
    return False
