"""Check mode: every rank's fingerprint of a collective, compared before its backend runs it.

A backend that cannot see a mismatch (Gloo aborts the process on a size or dtype it did not
expect; MPI returns wrong results) must never be handed one. With check mode on
(``ProcessGroup(..., check=True)`` or ``PG_CORE_CHECK=1``), each collective is first
described by a fixed-size fingerprint (op, sequence number, device type, dtype, root, reduce
op, the shape every rank must agree on; for all-to-all, the elements sent to and expected
from each peer), and where any differ every rank raises
:class:`~pg_core.errors.CollectiveMismatchError` naming each side, before a byte of the
collective itself is sent.

**How ranks compare.** Each rank reduces its fingerprint to a digest ``h`` below ``M``
(``2**(62 - bits(size))``, so a sum of ``size`` of them is exact in int64) and the group
all-reduces one int64, ``h`` plus the rank's all-to-all balance (``sum over peers of
H(me, peer, sent) - H(peer, me, expected)``, mod ``M``: the balances of every rank cancel
exactly when what each sends is what its peer expects), with SUM, over its message
backend. Every rank's own check is ``total == size * h (mod M)``: equal fingerprints always
pass, and different ones pass on a rank only by a coincidence of their digests (a chance of
the order of ``2**-50`` per check), so every rank reaches the same verdict. The common case is thus one
one-element all_reduce, the cheapest collective there is, whatever the ranks called: it
cannot mismatch itself. Only after a mismatch do the ranks all-gather their full
fingerprints (and all-to-all counts) to say who called what. The group runs the check in
the executor's order, so a mismatch latches like any other and its collectives stop. What
it costs, measured: docs/faults.md.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

import torch

from .dtypes import dtype_code, dtype_from_code, dtype_name
from .errors import CollectiveMismatchError
from .ops import COLLECTIVE_OPS, RedOpType, ReduceOp

if TYPE_CHECKING:
    from .instance import Instance

__all__ = ["ENV", "Checker", "batch_fingerprint", "check_mode", "describe", "fingerprint"]

_ONE: Final = struct.Struct("<q")

#: the environment variable that turns check mode on for groups that do not say
ENV: Final = "PG_CORE_CHECK"

_TRUE: Final = frozenset({"1", "true", "yes", "on"})
_FALSE: Final = frozenset({"", "0", "false", "no", "off"})

#: the collectives a fingerprint names by code (index + 1); another name travels as its CRC-32
_OPS: Final[tuple[str, ...]] = (*COLLECTIVE_OPS, "coalesced")
_REDUCE: Final[tuple[RedOpType, ...]] = tuple(RedOpType)
_DEVICES: Final[tuple[str, ...]] = ("cpu", "cuda", "xpu", "mps", "hpu", "mtia", "meta", "privateuseone")

#: a fingerprint: magic, op, seq, device, dtype, root, reduce op, ndim, shape digest, the first 7 dims
_MAGIC: Final = 0x70_67_63_68_6B_01  # "pgchk", version 1
_DIMS: Final = 7
_WIDTH: Final = 9 + _DIMS


def _crc(name: str) -> int:
    return zlib.crc32(name.encode()) + 1000  # past every table's codes


_OP_CODE: Final[dict[str, int]] = {op: i for i, op in enumerate(_OPS, start=1)}
_REDUCE_CODE: Final[dict[RedOpType, int]] = {r: i for i, r in enumerate(_REDUCE, start=1)}
_DEVICE_CODE: dict[str, int] = {d: i for i, d in enumerate(_DEVICES, start=1)}
_OP_NAME: Final[dict[int, str]] = {c: op for op, c in _OP_CODE.items()}


def check_mode(check: bool | None, env: Mapping[str, str]) -> bool:
    """Whether a group checks its collectives: ``check`` where given, else :data:`ENV` of
    ``env`` (``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off``/unset); any other
    value is a ``ValueError`` naming the variable."""
    if check is not None:
        if not isinstance(check, bool):
            raise TypeError(f"check must be True, False or None (then {ENV} decides), got {check!r}")
        return check
    value = env.get(ENV, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{ENV}={env[ENV]!r} is neither on (1, true, yes, on) nor off (0, false, no, off, unset)")


# -- what a collective is, as every rank must agree ------------------------------------------------
def _agreed(op: str, args: Sequence[Any]) -> tuple[Any, int, RedOpType | None, tuple[int, ...] | None, list[int]]:
    """``(tensor, root, reduce op, shape, counts)`` of collective ``op`` called with the backend's
    ``args``: the tensor whose dtype and ``shape`` every rank must agree on, the root (``-1``:
    none) and reduce op; for all-to-all, ``counts`` is the elements sent to each peer and then
    those expected from each (``shape`` is then what lies beyond dim 0, or ``None``)."""
    if op in ("all_reduce", "reduce_scatter", "reduce_scatter_tensor"):
        return args[0], -1, args[-1].type, tuple(args[0].shape), []
    if op == "reduce":
        return args[0], args[1], args[2].type, tuple(args[0].shape), []
    if op in ("broadcast", "gather", "scatter"):
        return args[0], args[-1], None, tuple(args[0].shape), []
    if op in ("all_gather", "all_gather_into_tensor"):
        return args[1], -1, None, tuple(args[1].shape), []
    if op == "all_to_all":
        outs, ins = args
        return ins[0], -1, None, None, [t.numel() for t in ins] + [t.numel() for t in outs]
    if op == "all_to_all_single":
        _, inp, out_splits, in_splits = args
        row = math.prod(inp.shape[1:])
        return inp, -1, None, (-1, *inp.shape[1:]), [s * row for s in in_splits] + [s * row for s in out_splits]
    if op == "barrier":
        return None, -1, None, None, []
    raise ValueError(f"check mode: no fingerprint for collective {op!r}")


def fingerprint(op: str, seq: int, device_type: str, args: Sequence[Any]) -> tuple[list[int], list[int]]:
    """The fingerprint row of collective ``op`` number ``seq`` on ``device_type`` (the backend's
    ``args``), and the all-to-all counts to exchange after it (empty for other ops)."""
    tensor, root, reduce, shape, counts = _agreed(op, args)
    dtype = None if tensor is None else tensor.dtype
    return _row(op, seq, device_type, dtype=dtype, root=root, reduce=reduce, shape=shape), counts


def batch_fingerprint(
    seq: int, device_type: str, calls: Sequence[tuple[str, Sequence[Any]]]
) -> tuple[list[int], list[int]]:
    """The fingerprint of a coalesced batch of collectives ``calls`` (``(op, args)`` each): its
    first sequence number, and a digest of every call's own fingerprint; the counts of its
    all-to-all ops, one after another."""
    parts: list[tuple[int, ...]] = []
    counts: list[int] = []
    for op, args in calls:
        tensor, root, reduce, shape, more = _agreed(op, args)
        dtype = None if tensor is None else tensor.dtype
        parts.append(tuple(_row(op, 0, device_type, dtype=dtype, root=root, reduce=reduce, shape=shape)))
        counts.extend(more)
    shape = (len(calls),)
    row = _row("coalesced", seq, device_type, dtype=None, root=-1, reduce=None, shape=shape)
    row[8] = hash(tuple(parts))
    return row, counts


def _row(
    op: str,
    seq: int,
    device_type: str,
    *,
    dtype: torch.dtype | None,
    root: int,
    reduce: RedOpType | None,
    shape: tuple[int, ...] | None,
) -> list[int]:
    device = _DEVICE_CODE.get(device_type)
    if device is None:
        device = _DEVICE_CODE[device_type] = _crc(device_type)
    dims = [] if shape is None else list(shape[:_DIMS])
    return [
        _MAGIC,
        _OP_CODE.get(op) or _crc(op),
        seq,
        device,
        0 if dtype is None else (dtype_code(dtype) or _crc(str(dtype))),
        root,
        0 if reduce is None else _REDUCE_CODE[reduce],
        -1 if shape is None else len(shape),
        0 if shape is None else hash(shape),  # ints hash alike in every process
        *dims,
        *[0] * (_DIMS - len(dims)),
    ]


def describe(row: Sequence[int]) -> str:
    """A fingerprint as a person reads it: ``all_reduce #5 float32[4, 2] SUM on cpu``."""
    if len(row) != _WIDTH or row[0] != _MAGIC:
        return "something else than a check-mode fingerprint (is check mode on for every rank of the group?)"
    _, op, seq, device, dtype, root, reduce, ndim, digest, *dims = row
    name = _OP_NAME.get(op, f"op#{op}")
    words = [f"{name} #{seq}"]
    if name == "coalesced":
        words.append(f"batch of {dims[0]} collectives (digest {digest & 0xFFFFFFFF:08x})")
    elif dtype:
        known = dtype_from_code(dtype)
        shown = "?" if ndim < 0 else ", ".join("*" if d < 0 else str(d) for d in dims[: min(ndim, _DIMS)])
        more = ", ..." if ndim > _DIMS else ""
        words.append(f"{dtype_name(known) if known is not None else f'dtype#{dtype}'}[{shown}{more}]")
    if reduce:
        words.append(_REDUCE[reduce - 1].name if 0 < reduce <= len(_REDUCE) else f"reduce#{reduce}")
    if root >= 0:
        words.append(f"root {root}")
    words.append(f"on {_device_name(device)}")
    return " ".join(words)


def _device_name(code: int) -> str:
    return _DEVICES[code - 1] if 0 < code <= len(_DEVICES) else f"device#{code}"


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


class Checker:
    """Check mode of one group: :meth:`verify` before each collective, in the executor's order.

    ``endpoint`` gives the group's message backend instance (created on first use): the
    digests travel as its int64 ``all_reduce`` (SUM), and after a mismatch the fingerprints
    as its int64 ``all_gather_into_tensor``. Buffers are the checker's own, reused by every
    call: collectives of a group run one at a time."""

    __slots__ = ("_endpoint", "_modulus", "_name", "_one", "_one_buf", "_rank", "_size")

    def __init__(self, *, rank: int, size: int, name: str, endpoint: Callable[[], Instance]) -> None:
        self._rank, self._size, self._name, self._endpoint = rank, size, name, endpoint
        self._modulus = 1 << (62 - size.bit_length())
        self._one_buf = bytearray(_ONE.size)
        self._one = torch.frombuffer(self._one_buf, dtype=torch.int64)

    def verify(self, op: str, seq: int, device_type: str, args: Sequence[Any], timeout: float) -> None:
        """Raise :class:`CollectiveMismatchError` (on every rank alike) unless every rank's
        collective number ``seq`` is ``op`` with the same agreed arguments (see :func:`fingerprint`)."""
        row, counts = fingerprint(op, seq, device_type, args)
        self._compare(row, counts, timeout)

    def verify_batch(
        self, seq: int, device_type: str, calls: Sequence[tuple[str, Sequence[Any]]], timeout: float
    ) -> None:
        """:meth:`verify` for a coalesced batch of collectives (see :func:`batch_fingerprint`)."""
        row, counts = batch_fingerprint(seq, device_type, calls)
        self._compare(row, counts, timeout)

    def _compare(self, row: list[int], counts: list[int], timeout: float) -> None:
        m = self._modulus
        h = hash(tuple(row)) % m  # a tuple of ints hashes alike in every process
        _ONE.pack_into(self._one_buf, 0, (h + self._balance(counts)) % m if counts else h)
        inst = self._endpoint()
        if inst.device.type == "cpu":
            inst.backend.all_reduce(self._one, _SUM, timeout=timeout)
            total = _ONE.unpack_from(self._one_buf)[0]
        else:
            one = self._one.to(inst.device)
            inst.backend.all_reduce(one, _SUM, timeout=timeout)
            total = int(one.item())
        if (total - self._size * h) % m:
            raise self._explain(row, counts, timeout)

    def _balance(self, counts: list[int]) -> int:
        """What this rank adds for its all-to-alls (``counts``: per all-to-all, the elements it
        sends each peer, then those it expects from each): the digests of the (sender, receiver,
        part, elements) it sends, less those it expects; every rank's cancel out when they agree."""
        n, me, m = self._size, self._rank, self._modulus
        balance = 0
        for part in range(0, len(counts), 2 * n):
            for peer in range(n):
                balance += hash((me, peer, part, counts[part + peer])) - hash((peer, me, part, counts[part + n + peer]))
        return balance % m

    def _gather(self, mine: list[int], timeout: float) -> list[list[int]]:
        """Every rank's ``mine`` (of one length on every rank), in rank order."""
        inst = self._endpoint()
        row = torch.tensor(mine, dtype=torch.int64, device=inst.device)
        table = torch.empty(self._size * len(mine), dtype=torch.int64, device=inst.device)
        inst.backend.all_gather_into_tensor(table, row, timeout=timeout)
        return table.view(self._size, len(mine)).tolist()  # type: ignore[no-any-return]

    def _explain(self, row: list[int], counts: list[int], timeout: float) -> CollectiveMismatchError:
        """The error after a mismatch: every rank's fingerprint (of one width everywhere), and
        where those agree, the all-to-all counts (then of one length everywhere too)."""
        rows = [tuple(r) for r in self._gather(row, timeout)]
        if any(r != rows[0] for r in rows):
            return self._mismatch(rows)
        wrong, involved = self._split_mismatches(self._gather(counts, timeout)) if counts else ([], set())
        what = "; ".join(wrong) or "their digests differ although the fingerprints read alike"
        return CollectiveMismatchError(
            f"group {self._name!r}: {describe(row)}: the ranks' split sizes do not agree: {what}. {_AFTER}",
            peers=sorted(involved - {self._rank}),
        )

    def _mismatch(self, rows: list[tuple[int, ...]]) -> CollectiveMismatchError:
        sides: dict[tuple[int, ...], list[int]] = {}
        for rank, row in enumerate(rows):
            sides.setdefault(row, []).append(rank)
        mine = rows[self._rank]
        told = "; ".join(f"{_ranks(ranks)}: {describe(row)}" for row, ranks in sides.items())
        return CollectiveMismatchError(
            f"group {self._name!r}: the ranks called different collectives at collective #{mine[2]} (rank "
            f"{self._rank} is in {describe(mine)}): {told}. {_AFTER}",
            peers=[r for r, row in enumerate(rows) if row != mine],
        )

    def _split_mismatches(self, got: list[list[int]]) -> tuple[list[str], set[int]]:
        """All-to-all: each pair where what a rank sends is not what its peer expects."""
        n = self._size
        wrong: list[str] = []
        involved: set[int] = set()
        for part in range(0, len(got[0]), 2 * n):  # one all-to-all after another (a batch may hold several)
            for i in range(n):
                for j in range(n):
                    sent, expected = got[i][part + j], got[j][part + n + i]
                    if sent != expected:
                        wrong.append(
                            f"rank {i} sends rank {j} {sent} elements, rank {j} expects {expected} from rank {i}"
                        )
                        involved.update((i, j))
        return wrong, involved


_SUM: Final = ReduceOp.SUM
_AFTER: Final = (
    "Check mode caught it before the backend ran it, so nothing of it was sent; the group's collectives stop: "
    "form the group again after fixing the program"
)
