"""What a conformance call must produce: the reference results the controller judges by.

The controller computes every expected output itself from the inputs that
:mod:`pg_core.testing.buffers` makes, never from a backend: reductions in the wide dtype
(float64, complex128, int64) folded one IEEE operation at a time, with the elementwise
tolerance of :func:`tolerance_note` for float and complex SUM, AVG, PREMUL_SUM and
PRODUCT; copies exactly, bit for bit. :func:`expected` gives each rank's output buffers
as they must be after a buffer call (the junk outside the views unchanged);
:func:`collective_result`, the value a rank must get from a value collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..ops import RedOpType
from .buffers import Bufs, collective_input, prepare
from .cases import Call, dtype_of

__all__ = ["Expected", "collective_result", "expected", "fill", "reduce_reference", "tolerance_note"]


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
        splits = call.split_rows()
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


def collective_result(call: Call, where: tuple[int, int, int], rank: int, n: int) -> Any:
    """What ``rank`` (of ``n``) must get back from the value collective ``call``."""
    p, op = call.params, call.op
    if op in ("broadcast_object", "broadcast_tensor_dict"):
        return collective_input(call, where, p["root"])
    if op == "all_gather_object" or (op == "gather_object" and rank == p["root"]):
        return [collective_input(call, where, j) for j in range(n)]
    if op == "gather_object":
        return None
    if op == "scatter_object":
        return collective_input(call, where, p["root"])[rank]
    raise ValueError(f"{op} is not a value collective")
