"""What a conformance example is, how its tensors are made, and what it must produce.

An :class:`Example` is plain data (JSON round-trips it exactly, which is what the
one-line reproduction carries): a world size, a device type, a seed, and one or
more *lanes*. A lane is a group formed by some of the ranks (all of them, or an
overlapping subset for the concurrent-groups check) and the :class:`Call` s it
runs in order. Every tensor is derived from ``(seed, lane, step, rank, role)``,
so the rank processes and the controller build bit-identical inputs without
sending them anywhere, and the controller computes every expected output itself,
in float64 (:func:`expected`).

This module is imported by the rank processes and by the controller; it needs
torch and pg_core, not hypothesis or pytest.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..dtypes import NAMES
from ..ops import RedOpType, ReduceOp

__all__ = [
    "DTYPE_NAMES",
    "EXTREME",
    "VALUE_OPS",
    "Bufs",
    "Call",
    "Example",
    "Expected",
    "Lane",
    "dtype_of",
    "expected",
    "extreme_tensor",
    "fill",
    "prepare",
    "tolerance_note",
]

#: The declarable dtypes by name: :data:`pg_core.dtypes.NAMES`, the one table.
DTYPE_NAMES: dict[str, torch.dtype] = NAMES


#: Ops whose calls move values (objects, tensors of unknown shape, tensor dicts) or
#: form subgroups: described by value specs, judged by :mod:`pg_core.testing.values`.
VALUE_OPS: frozenset[str] = frozenset(
    {
        "messages",
        "broadcast_object",
        "all_gather_object",
        "gather_object",
        "scatter_object",
        "broadcast_tensor_dict",
        "split",
        "new_group",
    }
)


def dtype_of(name: str) -> torch.dtype:
    return DTYPE_NAMES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


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
        from .values import describe_spec

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


# -- deterministic tensors ---------------------------------------------------------


def _generator(*key: object) -> torch.Generator:
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    g = torch.Generator()
    g.manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
    return g


def _ranged(kind: str | None, dtype: torch.dtype) -> tuple[int, int]:
    """Integer value range for a reduce kind: sums and products of up to 8 ranks must not overflow."""
    info = torch.iinfo(dtype)
    if dtype == torch.int64:
        return -(2**62), 2**62  # randint's bounds are int64 themselves
    if kind in ("SUM", "AVG", "PREMUL_SUM"):
        return (0, 16) if info.min == 0 else (-8, 9)
    if kind == "PRODUCT":
        return (0, 2) if info.min == 0 else (-1, 2)
    return info.min, info.max + 1  # MIN/MAX/bitwise and copies: the full range


def random_tensor(key: tuple[object, ...], shape: Sequence[int], dtype: torch.dtype, kind: str | None) -> torch.Tensor:
    """Deterministic values for ``key``: floats in [-2, 2) (products stay in range),
    integers in a range where the reduce ``kind`` cannot overflow, random bools."""
    g = _generator(*key)
    shape = tuple(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g, dtype=torch.int64).bool()
    if dtype.is_complex:
        parts = torch.rand((*shape, 2), generator=g, dtype=torch.float64) * 4 - 2
        return torch.view_as_complex(parts).to(dtype)
    if dtype.is_floating_point:
        span = 4.0 if kind is not None else 2000.0  # copies: wider values, still exact in every float dtype
        values = torch.rand(shape, generator=g, dtype=torch.float64) * span - span / 2
        return values.to(dtype)
    lo, hi = _ranged(kind, dtype)
    return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(dtype)


#: ``Call.params["values"]``: ``"extreme"`` draws from each dtype's whole range
#: (:func:`extreme_tensor`); absent, the comfortable ranges of :func:`random_tensor`.
EXTREME = "extreme"


def _log_uniform(g: torch.Generator, shape: Sequence[int], lo: float, hi: float) -> torch.Tensor:
    """float64 values of random sign whose magnitudes are spread evenly over the binary
    exponents from ``lo`` to below ``hi``. Built from their bits with integer operations
    only, so every process makes exactly the same values (a vectorised ``exp2`` may differ
    in the last bit between a loop's body and its tail)."""
    shape = tuple(shape)
    first = max(1, math.frexp(lo)[1] + 1022)  # biased exponents (1: the smallest normal; 0: subnormals)
    last = math.frexp(hi)[1] + 1022 - 1
    biased = torch.randint(first - 1, max(first, last) + 1, shape, generator=g, dtype=torch.int64)
    mantissa = torch.randint(0, 2**52, shape, generator=g, dtype=torch.int64)
    sign = torch.randint(0, 2, shape, generator=g, dtype=torch.int64) << 63
    return (sign | (biased << 52) | mantissa).view(torch.float64)


def _float_range(dtype: torch.dtype, kind: str | None, n: int) -> tuple[float, float]:
    """Magnitudes a float ``dtype`` can hold in a reduction ``kind`` of ``n`` ranks without
    overflowing in any order: from a subnormal up to a share of the largest finite value."""
    info = torch.finfo(dtype)
    tiny = info.smallest_normal * info.eps  # the smallest subnormal
    top = float(info.max) * 0.99
    if kind in ("SUM", "AVG", "PREMUL_SUM"):
        return tiny, top / (4 * n)  # |premul factor| <= 3
    if kind == "PRODUCT":
        root = top ** (1 / n) / 2  # no partial product overflows; none underflows below the normals
        return max(float(info.smallest_normal) ** (1 / n) * 2, 1 / root), root
    return tiny, top


def extreme_tensor(
    key: tuple[object, ...], shape: Sequence[int], dtype: torch.dtype, kind: str | None, *, rank: int, n: int
) -> torch.Tensor:
    """Values from ``dtype``'s whole range, for rank ``rank`` of ``n``, with special values at
    positions that every rank agrees on (the flat index ``i`` decides):

    * integers: uniform over the whole range (past 2**53 for int64, 128-255 for uint8), with
      the minimum and the maximum planted; SUM and PRODUCT results wrap around as torch's CPU
      ops on that dtype do. (AVG and PREMUL_SUM, declared for an integer dtype, keep the
      comfortable range: their integer result is not defined past it.)
    * floats: magnitudes spread over every exponent from the smallest subnormal up to what a
      reduction of ``n`` ranks cannot overflow (copies, MIN and MAX: up to the largest finite
      value, so bfloat16 holds values that float16 cannot); ``-0.0`` on every rank at ``i % 7
      == 3`` (a SUM of them is ``-0.0``); for copies, SUM, AVG, PREMUL_SUM and PRODUCT, NaN on
      one rank at ``i % 11 == 5``, ``inf`` on one rank at ``i % 13 == 6``, and ``inf`` on one
      rank with ``-inf`` (SUM kinds) or ``0`` (PRODUCT) on the next at ``i % 17 == 8``. MIN
      and MAX get ``inf`` and ``-inf`` but no NaN: the contract leaves NaN there undefined.
    * complex: each part as a float of the same width, the quadrant chosen by ``i % 4``;
      non-finite parts only in copies.
    """
    g = _generator(*key, "extreme")
    shape = tuple(shape)
    count = math.prod(shape)
    index = torch.arange(count, dtype=torch.int64)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g, dtype=torch.int64).bool()
    if not (dtype.is_floating_point or dtype.is_complex):
        if kind in ("AVG", "PREMUL_SUM"):
            return random_tensor(key, shape, dtype, kind)
        info = torch.iinfo(dtype)
        flat = torch.randint(info.min, info.max, (count,), generator=g, dtype=torch.int64)
        flat[index % 5 == 0] = info.min
        flat[index % 5 == 1] = info.max
        if dtype == torch.int64:  # just past float64's exact integers
            flat[index % 5 == 2] = 2**53 + 1 + rank
        return flat.to(dtype).reshape(shape)
    real_dtype = dtype.to_real() if dtype.is_complex else dtype
    lo, hi = _float_range(real_dtype, kind, n)
    parts = 2 if dtype.is_complex else 1
    # finite values first, converted once; the special values are written in the dtype itself
    # (converting a NaN is not reproducible: torch's vectorised and scalar paths differ in its bits)
    flat = _log_uniform(g, (count, parts), lo, hi).to(real_dtype)
    specials = kind is None or (kind in ("SUM", "AVG", "PREMUL_SUM", "PRODUCT") and not dtype.is_complex)
    ordered = kind in ("MIN", "MAX")
    mine = index % n == rank
    nxt = index % n == (rank - 1) % n if n > 1 else torch.zeros_like(mine)
    for part in range(parts):
        values = flat[:, part]
        if dtype.is_complex:  # quadrant i % 4: (+,+), (-,+), (-,-), (+,-)
            negative = ((index % 4 == 1) | (index % 4 == 2)) if part == 0 else (index % 4 >= 2)
            values.copy_(torch.where(negative, -values.abs(), values.abs()))
        if not ordered:
            values[index % 7 == 3] = -0.0
        if specials or ordered:
            values[(index % 13 == 6) & mine] = math.inf if ordered or kind is not None else -math.inf
            if ordered:
                values[(index % 17 == 8) & mine] = -math.inf
        if specials:
            values[(index % 11 == 5) & mine] = math.nan
            pair = index % 17 == 8
            values[pair & mine] = math.inf
            values[pair & nxt] = 0.0 if kind == "PRODUCT" else -math.inf
    if dtype.is_complex:
        return torch.view_as_complex(flat.contiguous()).reshape(shape)
    return flat[:, 0].reshape(shape)


#: How many sentinel elements sit before and after a ``bucket`` view in its storage: at least
#: one on each side, so a write one element past the view, a read from the storage's start and
#: a write over the whole storage all meet a sentinel.
BUCKET_MARGIN = (1, 6)


def bucket_margins(key: tuple[object, ...], count: int) -> tuple[int, int]:
    """``(before, after)``: the sentinel elements around a ``bucket`` view of ``count`` elements
    made for ``key``. They depend on the buffer's role (the key's last part) and size, not on
    the rank: every rank's buffer of one role has the same shape, as fresh ones do."""
    g = _generator(key[-1], count, "bucket")
    lo, hi = BUCKET_MARGIN
    before, after = torch.randint(lo, hi + 1, (2,), generator=g).tolist()
    return int(before), int(after)


def _laid_out(values: torch.Tensor, layout: str, key: tuple[object, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(view, base)``: ``view`` holds ``values`` with ``layout``; ``base`` is the
    whole buffer behind it, its other elements filled with junk that must survive.

    ``bucket`` is how parameters and gradients live in a flat bucket: a contiguous view at a
    non-zero storage offset of a flat 1-d storage, with sentinel elements before and after it
    (:func:`bucket_margins`). It is dense, so pg-core hands it to the backend as it is: the
    backend must read and write exactly the view's bytes."""
    if layout == "bucket":
        count = values.numel()
        before, after = bucket_margins(key, count)
        base = random_tensor((*key, "sentinel"), (before + count + after,), values.dtype, None)
        view = base[before : before + count].view(values.shape)
        view.copy_(values)
        return view, base
    if layout == "strided" and values.dim() >= 1:
        wide = (*values.shape[:-1], values.shape[-1] * 2)
        base = random_tensor((*key, "gap"), wide, values.dtype, None)
        view = base[..., ::2]
        view.copy_(values)
        return view, base
    if layout == "transposed" and values.dim() >= 2:
        base = values.transpose(-1, -2).contiguous()
        view = base.transpose(-1, -2)
        return view, base
    base = values.clone()
    return base, base


@dataclass
class Bufs:
    """The tensors one rank passes to one call: ``ins`` must come back unchanged,
    ``outs`` receive the results. ``*_bases`` are the whole buffers behind them."""

    ins: list[torch.Tensor] = field(default_factory=list)
    outs: list[torch.Tensor] = field(default_factory=list)
    in_bases: list[torch.Tensor] = field(default_factory=list)
    out_bases: list[torch.Tensor] = field(default_factory=list)

    def add_in(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        self.ins.append(pair[0])
        self.in_bases.append(pair[1])
        return pair[0]

    def add_out(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        self.outs.append(pair[0])
        self.out_bases.append(pair[1])
        return pair[0]

    def to(self, device: torch.device) -> Bufs:
        """The same buffers on ``device`` (views rebuilt on the moved bases)."""
        if device.type == "cpu":
            return self

        def move(views: list[torch.Tensor], bases: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
            new_bases = [b.to(device) for b in bases]
            new_views = []
            for v, b, nb in zip(views, bases, new_bases, strict=True):
                offset = v.storage_offset() - b.storage_offset()
                new_views.append(nb.as_strided(v.shape, v.stride(), nb.storage_offset() + offset))
            return new_views, new_bases

        ins, in_bases = move(self.ins, self.in_bases)
        outs, out_bases = move(self.outs, self.out_bases)
        return Bufs(ins, outs, in_bases, out_bases)


def _key(ex_seed: int, lane: int, step: int, rank: int, role: object) -> tuple[object, ...]:
    return (ex_seed, lane, step, rank, role)


def _value_kind(call: Call) -> str | None:
    reduce = call.params.get("reduce")
    return str(reduce) if reduce is not None else None


def _out_shape(call: Call, n: int) -> tuple[int, ...]:
    """Shape of the ``*_into_tensor`` / ``reduce_scatter_tensor`` big tensor: stacked or concatenated."""
    s = call.shape
    if call.params.get("out_form") == "concat" and len(s) >= 1:
        return (n * s[0], *s[1:])
    return (n, *s)


def _split_rows(call: Call) -> list[list[int]]:
    splits: list[list[int]] = call.params["splits"]
    return splits


def prepare(call: Call, where: tuple[int, int, int], rank: int, n: int) -> Bufs:
    """The cpu tensors rank ``rank`` (of ``n``) passes to ``call``; ``where`` is
    ``(example seed, lane, step)``."""
    seed, lane, step = where
    dtype, kind, layout = call.torch_dtype, _value_kind(call), call.layout

    def key(role: object) -> tuple[object, ...]:
        return _key(seed, lane, step, rank, role)

    extreme = call.params.get("values") == EXTREME

    def make(role: object, shape: Sequence[int], value_kind: str | None = kind) -> tuple[torch.Tensor, torch.Tensor]:
        if extreme:
            values = extreme_tensor(key(role), shape, dtype, value_kind, rank=rank, n=n)
        else:
            values = random_tensor(key(role), shape, dtype, value_kind)
        return _laid_out(values, layout, key(role))

    def junk(role: object, shape: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return _laid_out(random_tensor(key(("junk", role)), shape, dtype, None), layout, key(role))

    b = Bufs()
    op = call.op
    if op in ("all_reduce", "reduce"):
        b.add_out(make("x", call.shape))
    elif op == "broadcast":
        b.add_out(make("x", call.shape) if rank == call.params["root"] else junk("x", call.shape))
    elif op == "all_gather":
        b.add_in(make("x", call.shape))
        for j in range(n):
            b.add_out(junk(("o", j), call.shape))
    elif op == "all_gather_into_tensor":
        b.add_in(make("x", call.shape))
        b.add_out(junk("o", _out_shape(call, n)))
    elif op == "reduce_scatter":
        for j in range(n):
            b.add_in(make(("x", j), call.shape))
        b.add_out(junk("o", call.shape))
    elif op == "reduce_scatter_tensor":
        b.add_in(make("x", _out_shape(call, n)))
        b.add_out(junk("o", call.shape))
    elif op == "all_to_all":
        splits = _split_rows(call)
        tail = call.shape
        for j in range(n):
            b.add_in(make(("x", j), (splits[rank][j], *tail)))
        for i in range(n):
            b.add_out(junk(("o", i), (splits[i][rank], *tail)))
    elif op == "all_to_all_single":
        splits = _split_rows(call)
        tail = call.shape
        b.add_in(make("x", (sum(splits[rank]), *tail)))
        b.add_out(junk("o", (sum(row[rank] for row in splits), *tail)))
    elif op == "gather":
        b.add_in(make("x", call.shape))
        if rank == call.params["root"]:
            for j in range(n):
                b.add_out(junk(("o", j), call.shape))
    elif op == "scatter":
        if rank == call.params["root"]:
            for j in range(n):
                b.add_in(make(("x", j), call.shape))
        b.add_out(junk("o", call.shape))
    elif op == "any_source":
        # the sender's messages (in list order), and a buffer per receive on the receiver
        for m, (src, _tag) in enumerate(call.params["messages"]):
            if rank == src:
                b.add_in(make(("m", m), call.shape))
        if rank == call.params["receiver"]:
            for i in range(len(call.params["plan"])):
                b.add_out(junk(("r", i), call.shape))
    elif op == "p2p":
        for m, (src, dst, _tag, shape, dname) in enumerate(call.params["messages"]):
            mdtype = dtype_of(dname)
            if rank == src:
                mkey = _key(seed, lane, step, src, ("m", m))
                if extreme:
                    values = extreme_tensor(mkey, shape, mdtype, None, rank=src, n=n)
                else:
                    values = random_tensor(mkey, shape, mdtype, None)
                b.add_in(_laid_out(values, layout, key(("m", m))))
            if rank == dst:
                values = random_tensor(_key(seed, lane, step, dst, ("junk-m", m)), shape, mdtype, None)
                b.add_out(_laid_out(values, layout, key(("r", m))))
    return b


# -- what must come out ------------------------------------------------------------


@dataclass
class Expected:
    """What one output base must hold: ``value`` exactly where ``tol`` is 0, within
    ``tol`` (elementwise, in the wide dtype) elsewhere; non-finite values exactly (NaN
    matches NaN). The sign of a zero must match wherever the comparison is exact, and where
    ``signs`` is true (a reduction whose zero has a defined sign)."""

    value: torch.Tensor
    tol: torch.Tensor | None = None
    mask: torch.Tensor | None = None  # True where the output view is (the rest is the buffer's own junk)
    signs: torch.Tensor | None = None


_EPS = {
    torch.float16: 2.0**-10,
    torch.bfloat16: 2.0**-7,
    torch.float32: 2.0**-23,
    torch.float64: 2.0**-52,
    torch.complex64: 2.0**-23,
    torch.complex128: 2.0**-52,
}
_TINY = {
    torch.float16: 2.0**-14,
    torch.bfloat16: 2.0**-126,
    torch.float32: 2.0**-126,
    torch.float64: 2.0**-1022,
    torch.complex64: 2.0**-126,
    torch.complex128: 2.0**-1022,
}


def tolerance_note() -> str:
    return (
        "float and complex results of SUM, AVG, PREMUL_SUM and PRODUCT must be within "
        "2 * (n + 2) * eps(dtype) * scale + eps(dtype) * |reference| + tiny(dtype) of a float64 reference, "
        "elementwise, where n is the world size and scale is the sum of the inputs' magnitudes (the product of "
        "them for PRODUCT); "
        "everything else (integers, bool, MIN, MAX, bitwise ops, and every copy) must be exact"
    )


def _wide(dtype: torch.dtype) -> torch.dtype:
    if dtype.is_complex:
        return torch.complex128
    if dtype.is_floating_point:
        return torch.float64
    if dtype == torch.bool:
        return torch.bool
    return torch.int64


def reduce_reference(
    xs: list[torch.Tensor], call: Call
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(reference in the wide dtype, elementwise tolerance or None if exact, where the sign
    of a zero result is defined or None)``.

    Floats fold from the first rank's value, one IEEE operation at a time, as any order of a
    real reduction does: NaN and infinities propagate as IEEE says, and a SUM of zeros is
    ``-0.0`` exactly when every term is. Integer SUM and PRODUCT wrap around as torch's CPU
    ops on the dtype do (computed exactly in int64, then narrowed)."""
    dtype = xs[0].dtype
    wide = _wide(dtype)
    ws = [x.to(wide) for x in xs]
    kind = RedOpType[call.params["reduce"]]
    n = len(xs)
    stacked = torch.stack(ws)
    if dtype == torch.bool:
        if kind in (RedOpType.MIN, RedOpType.BAND):
            return stacked.all(0), None, None
        if kind in (RedOpType.MAX, RedOpType.BOR):
            return stacked.any(0), None, None
        if kind == RedOpType.BXOR:
            return (stacked.to(torch.int64).sum(0) % 2).bool(), None, None
        if kind == RedOpType.SUM:
            return stacked.any(0), None, None  # torch's bool sum saturates
        if kind == RedOpType.PRODUCT:
            return stacked.all(0), None, None
        raise ValueError(f"no reference for {kind.name} on bool")
    floating = dtype.is_floating_point or dtype.is_complex
    if kind == RedOpType.MIN:
        return stacked.amin(0), None, None
    if kind == RedOpType.MAX:
        return stacked.amax(0), None, None
    if kind in (RedOpType.BAND, RedOpType.BOR, RedOpType.BXOR):
        acc = ws[0].clone()
        for w in ws[1:]:
            acc = {RedOpType.BAND: acc & w, RedOpType.BOR: acc | w, RedOpType.BXOR: acc ^ w}[kind]
        return acc, None, None
    signs: torch.Tensor | None
    if kind == RedOpType.PRODUCT:
        acc = ws[0].clone()
        for w in ws[1:]:
            acc = acc * w
        scale = stacked.abs().prod(0) if floating else None
        signs = (stacked == 0).any(0)  # a zero product's sign is the product of the signs
    else:
        factor = float(call.params["factor"]) if kind == RedOpType.PREMUL_SUM else 1.0
        terms = [w * factor for w in ws] if kind == RedOpType.PREMUL_SUM else ws
        acc = terms[0].clone()
        for w in terms[1:]:
            acc = acc + w
        scale = stacked.abs().sum(0) * abs(factor) if floating else None
        signs = (stacked == 0).all(0)  # -0.0 exactly when every term is
        if kind == RedOpType.AVG:
            if floating:
                acc = acc / n
                scale = scale / n if scale is not None else None
            else:
                acc = torch.div(acc, n, rounding_mode="trunc")
    if scale is None:
        return acc.to(dtype).to(wide), None, None  # integers wrap around in their own width
    tol = 2 * (n + 2) * _EPS[dtype] * scale.to(torch.float64) + _TINY[dtype]
    # the result is rounded to dtype once more at the end
    tol = tol + _EPS[dtype] * acc.abs().to(torch.float64)
    return acc, tol, None if dtype.is_complex else signs


def fill(
    base_dtype: torch.dtype,
    bufs: Bufs,
    index: int,
    value: torch.Tensor,
    tol: torch.Tensor | None,
    *,
    signs: torch.Tensor | None = None,
) -> Expected:
    """The expected base of output ``index``: its junk everywhere but the view, which holds ``value``."""
    base = bufs.out_bases[index].to(_wide(base_dtype)).clone()
    view = bufs.outs[index]
    offset = view.storage_offset() - bufs.out_bases[index].storage_offset()

    def placed(fill: torch.Tensor, into: torch.Tensor) -> torch.Tensor:
        into.as_strided(view.shape, view.stride(), into.storage_offset() + offset).copy_(fill.reshape(view.shape))
        return into

    placed(value, base)
    mask = placed(torch.ones(view.shape, dtype=torch.bool), torch.zeros(base.shape, dtype=torch.bool))
    if tol is None:
        return Expected(base, None, mask)
    tol_base = placed(tol, torch.zeros(base.shape, dtype=torch.float64))
    sign_base = None if signs is None else placed(signs, torch.zeros(base.shape, dtype=torch.bool))
    return Expected(base, tol_base, mask, sign_base)


def expected(call: Call, seed: int, lane: int, step: int, n: int) -> list[list[Expected] | None]:
    """Per rank of the lane: the expected output bases of ``call`` (``None``: unspecified)."""
    bufs = [prepare(call, (seed, lane, step), r, n) for r in range(n)]
    op = call.op
    dtype = call.torch_dtype
    out: list[list[Expected] | None] = []
    if op in ("all_reduce", "reduce"):
        value, tol, signs = reduce_reference([b.outs[0] for b in bufs], call)
        for r in range(n):
            if op == "reduce" and r != call.params["root"]:
                # pg-core's decision (docs/decisions.md): non-root inputs are left unchanged
                out.append([fill(dtype, bufs[r], 0, bufs[r].outs[0], None)])
            else:
                out.append([fill(dtype, bufs[r], 0, value, tol, signs=signs)])
    elif op == "broadcast":
        src = bufs[call.params["root"]].outs[0]
        out = [[fill(dtype, bufs[r], 0, src, None)] for r in range(n)]
    elif op == "all_gather":
        out = [[fill(dtype, bufs[r], j, bufs[j].ins[0], None) for j in range(n)] for r in range(n)]
    elif op == "all_gather_into_tensor":
        pieces = [b.ins[0].reshape(call.shape) for b in bufs]
        whole = torch.cat(pieces) if call.params.get("out_form") == "concat" and call.shape else torch.stack(pieces)
        out = [[fill(dtype, bufs[r], 0, whole, None)] for r in range(n)]
    elif op == "reduce_scatter":
        for r in range(n):
            value, tol, signs = reduce_reference([b.ins[r] for b in bufs], call)
            out.append([fill(dtype, bufs[r], 0, value, tol, signs=signs)])
    elif op == "reduce_scatter_tensor":
        for r in range(n):
            blocks = [b.ins[0].reshape(n, -1)[r].reshape(call.shape) for b in bufs]
            value, tol, signs = reduce_reference(blocks, call)
            out.append([fill(dtype, bufs[r], 0, value, tol, signs=signs)])
    elif op == "all_to_all":
        out = [[fill(dtype, bufs[r], i, bufs[i].ins[r], None) for i in range(n)] for r in range(n)]
    elif op == "all_to_all_single":
        splits = _split_rows(call)
        for r in range(n):
            pieces = []
            for i in range(n):
                start = sum(splits[i][:r])
                pieces.append(bufs[i].ins[0][start : start + splits[i][r]])
            out.append([fill(dtype, bufs[r], 0, torch.cat(pieces), None)])
    elif op == "gather":
        root = call.params["root"]
        for r in range(n):
            out.append([fill(dtype, bufs[r], j, bufs[j].ins[0], None) for j in range(n)] if r == root else [])
    elif op == "scatter":
        root = call.params["root"]
        out = [[fill(dtype, bufs[r], 0, bufs[root].ins[r], None)] for r in range(n)]
    elif op == "p2p":
        msgs = call.params["messages"]
        for r in range(n):
            mine: list[Expected] = []
            for m, (src, dst, *_rest) in enumerate(msgs):
                if dst != r:
                    continue
                sent_index = [k for k, msg in enumerate(msgs) if msg[0] == src].index(m)
                received_index = len(mine)
                mdtype = dtype_of(msgs[m][4])
                mine.append(fill(mdtype, bufs[r], received_index, bufs[src].ins[sent_index], None))
            out.append(mine)
    else:
        out = [[] for _ in range(n)]
    return out


def input_bases(call: Call, seed: int, lane: int, step: int, n: int) -> list[list[torch.Tensor]]:
    """Per rank: the input bases as they were before the call (they must come back unchanged)."""
    return [prepare(call, (seed, lane, step), r, n).in_bases for r in range(n)]


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
        return bool(_split_rows(call)[late][rank] > 0 and math.prod(call.shape) > 0)
    # value collectives: a message always carries bytes
    if op in ("all_gather_object",):
        return True
    if op in ("broadcast_object", "broadcast_tensor_dict", "scatter_object"):
        return bool(p["root"] == late)
    if op == "gather_object":
        return bool(p["root"] == rank)
    return False
