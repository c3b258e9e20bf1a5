"""Values of drawn structure for the message operations: objects, tensors of unknown shape, tensor dicts.

``send_object``, ``send_tensor``, ``send_tensor_dict`` and the object collectives
move *values*, not buffers the receiver prepared. The suite describes each value
by a **spec**, plain JSON data that an :class:`~pg_core.testing.cases.Example`
carries, so a replay line rebuilds it exactly:

=================================  ==============================================
spec                               value
=================================  ==============================================
``["none"]``                       ``None``
``["bool", true]``                 ``True``
``["int", 12]``                    ``12`` (any size)
``["float", "-0x0.0p+0"]``         ``-0.0`` (``float.hex``: ``nan``, ``inf`` too)
``["str", "é"]``                   ``"é"``
``["bytes", "00ff"]``              ``b"\\x00\\xff"``
``["list", [s, ...]]``             a list (``"tuple"``: a tuple)
``["dict", [[k, v], ...]]``        a dict, in that key order
``["tensor", dt, shape, layout,    a tensor: values from the example's seed,
special]``                         ``nan``/``inf``/``-0.0`` planted when ``special``,
                                   laid out ``contig``, ``bucket``, ``strided``
                                   or ``transposed``
=================================  ==============================================

:func:`build` makes the value on a rank (the sender) and on the controller (the
reference); the tensors' values come from the same ``(seed, lane, step, rank,
role)`` key as every other conformance tensor. :func:`observe` turns what a rank
holds into plain, picklable data (tensors as dtype, shape, device and raw bytes;
floats as ``float.hex``, so ``nan`` equals ``nan`` and ``-0.0`` differs from
``0.0``), and :func:`difference` names the first place where two observations
differ. Equality is structural: types exactly (a tuple is not a list, ``True`` is
not ``1``), dict order, and tensors bitwise with their dtype and shape.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import torch

from ..dtypes import NAMES, dtype_name
from .tensors import generator_for, laid_out, moved, random_tensor

__all__ = ["Observed", "build", "describe_spec", "difference", "observe", "spec_dtypes", "tensor_of"]

#: What :func:`observe` returns: nested tuples of str, int, bool, bytes.
Observed = tuple[Any, ...]

_SPECIALS = (math.nan, math.inf, -math.inf, -0.0)


def build(spec: list[Any], key: tuple[object, ...], device: torch.device | str = "cpu") -> Any:
    """The value ``spec`` describes; its tensors derive from ``key`` (and their order in ``spec``)."""
    counter = itertools.count()
    where = torch.device(device)

    def go(s: list[Any]) -> Any:
        kind = s[0]
        if kind == "none":
            return None
        if kind == "bool":
            return bool(s[1])
        if kind == "int":
            return int(s[1])
        if kind == "float":
            return float.fromhex(s[1])
        if kind == "str":
            return str(s[1])
        if kind == "bytes":
            return bytes.fromhex(s[1])
        if kind == "list":
            return [go(c) for c in s[1]]
        if kind == "tuple":
            return tuple(go(c) for c in s[1])
        if kind == "dict":
            return {go(k): go(v) for k, v in s[1]}
        if kind == "tensor":
            return tensor_of(s, (*key, ("t", next(counter))), where)
        raise ValueError(f"unknown value spec {s!r}")

    return go(spec)


def tensor_of(spec: list[Any], key: tuple[object, ...], device: torch.device) -> torch.Tensor:
    """The tensor of a ``["tensor", dtype, shape, layout, special]`` spec (a view, for a
    non-contiguous layout, of a wider buffer)."""
    _, dname, shape, layout, special = spec
    dtype = NAMES[dname]
    values = random_tensor(key, shape, dtype, None)
    if special and values.numel() and (dtype.is_floating_point or dtype.is_complex):
        flat = values.view(-1)
        g = generator_for(*key, "special")
        picks = torch.randint(0, flat.numel(), (min(4, flat.numel()),), generator=g)
        for value, at in zip(_SPECIALS, picks.tolist(), strict=False):
            flat[at] = torch.tensor(complex(value, -value) if dtype.is_complex else value, dtype=dtype)
    view, base = laid_out(values, layout, key)
    if device.type == "cpu":
        return view
    return moved(view, base, device)[0]


def observe(value: Any, *, device: str | None = None) -> Observed:
    """``value`` as plain data (see the module docstring); ``device`` overrides the device
    type recorded for tensors (the controller builds its references on the cpu)."""
    if value is None:
        return ("none",)
    kind = type(value)
    if kind is bool:
        return ("bool", value)
    if kind is int:
        return ("int", value)
    if kind is float:
        return ("float", value.hex())
    if kind is str:
        return ("str", value)
    if kind is bytes:
        return ("bytes", value)
    if kind is list or kind is tuple:
        return (kind.__name__, tuple(observe(v, device=device) for v in value))
    if kind is dict:
        return ("dict", tuple((observe(k, device=device), observe(v, device=device)) for k, v in value.items()))
    if isinstance(value, torch.Tensor) and kind in (torch.Tensor, torch.nn.Parameter):
        t = value.detach().cpu().resolve_conj().resolve_neg()
        dense = torch.empty(t.shape, dtype=t.dtype).copy_(t)  # canonical strides, 1-element views included
        raw = dense.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return ("tensor", dtype_name(t.dtype), tuple(t.shape), device or value.device.type, raw)
    return ("other", f"{kind.__module__}.{kind.__qualname__}", repr(value)[:200])


def summary(obs: Observed) -> str:
    """A short description of an observed value."""
    kind = obs[0]
    if kind == "none":
        return "None"
    if kind in ("bool", "int", "str"):
        text = repr(obs[1])
        return text if len(text) <= 60 else text[:57] + "..."
    if kind == "float":
        return repr(float.fromhex(obs[1])) + f" ({obs[1]})"
    if kind == "bytes":
        return f"bytes of length {len(obs[1])}"
    if kind in ("list", "tuple", "dict"):
        return f"a {kind} of {len(obs[1])}"
    if kind == "tensor":
        return f"a tensor {obs[1]}{list(obs[2])} on {obs[3]}"
    return f"a {obs[1]} {obs[2]}"


def difference(got: Observed, want: Observed, path: str = "") -> str | None:
    """Where and how ``got`` differs from ``want`` first, or ``None`` if they are equal."""
    at = path or "the value"
    if got == want:
        return None
    if got[0] != want[0] or got[0] in ("none", "bool", "int", "float", "str", "bytes", "other"):
        return f"{at}: got {summary(got)}, expected {summary(want)}"
    if got[0] in ("list", "tuple"):
        if len(got[1]) != len(want[1]):
            return f"{at}: got {summary(got)}, expected {summary(want)}"
        for i, (g, w) in enumerate(zip(got[1], want[1], strict=True)):
            found = difference(g, w, f"{path}[{i}]")
            if found is not None:
                return found
        return None
    if got[0] == "dict":
        gkeys = [k for k, _ in got[1]]
        wkeys = [k for k, _ in want[1]]
        if gkeys != wkeys:
            return f"{at}: got keys {[summary(k) for k in gkeys]}, expected {[summary(k) for k in wkeys]} (in order)"
        for (k, g), (_, w) in zip(got[1], want[1], strict=True):
            found = difference(g, w, f"{path}[{summary(k)}]")
            if found is not None:
                return found
        return None
    return _tensor_difference(got, want, at)


def _tensor_difference(got: Observed, want: Observed, at: str) -> str:
    _, gdt, gshape, gdev, graw = got
    _, wdt, wshape, wdev, wraw = want
    if (gdt, gshape, gdev) != (wdt, wshape, wdev) or len(graw) != len(wraw):
        return f"{at}: got {summary(got)}, expected {summary(want)}"
    dtype = NAMES[wdt]
    size = torch.empty((), dtype=dtype).element_size()
    g = torch.frombuffer(bytearray(graw), dtype=torch.uint8).view(-1, size)
    w = torch.frombuffer(bytearray(wraw), dtype=torch.uint8).view(-1, size)
    bad = (g != w).any(1)
    first = int(bad.nonzero()[0])
    index = list(_unravel(first, wshape))
    gv = g[first].view(dtype).item()
    wv = w[first].view(dtype).item()
    return (
        f"{at} (a tensor {wdt}{list(wshape)}): {int(bad.sum())} of {bad.numel()} elements differ bitwise; "
        f"first at index {index}: got {gv!r}, expected {wv!r}"
    )


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for dim in reversed(shape):
        out.append(flat % dim)
        flat //= dim
    return tuple(reversed(out))


def walk(spec: list[Any], fn: Callable[[list[Any]], None]) -> None:
    """Call ``fn`` on every node of ``spec``, parents first."""
    fn(spec)
    kind = spec[0]
    if kind in ("list", "tuple"):
        for child in spec[1]:
            walk(child, fn)
    elif kind == "dict":
        for k, v in spec[1]:
            walk(k, fn)
            walk(v, fn)


def spec_dtypes(spec: list[Any]) -> set[str]:
    """The dtypes of the tensors in ``spec``."""
    found: set[str] = set()
    walk(spec, lambda s: found.add(s[1]) if s[0] == "tensor" else None)
    return found


def describe_spec(spec: list[Any], depth: int = 0) -> str:
    """A short description of ``spec`` for example listings."""
    kind = spec[0]
    if kind == "tensor":
        _, dname, shape, layout, special = spec
        extra = (f" {layout}" if layout != "contig" else "") + (" +nan/inf" if special else "")
        return f"tensor {dname}{list(shape)}{extra}"
    if kind in ("list", "tuple", "dict"):
        items = spec[1]
        if depth >= 1 or not items:
            return f"{kind}({len(items)})"
        if kind == "dict":
            inner = ", ".join(f"{describe_spec(k, 1)}: {describe_spec(v, depth + 1)}" for k, v in items[:4])
        else:
            inner = ", ".join(describe_spec(c, depth + 1) for c in items[:4])
        more = ", ..." if len(items) > 4 else ""
        return f"{kind}({inner}{more})"
    if kind == "none":
        return "None"
    if kind == "float":
        return repr(float.fromhex(spec[1]))
    if kind == "bytes":
        return f"bytes({len(spec[1]) // 2})"
    text = repr(spec[1])
    return text if len(text) <= 20 else text[:17] + "..."
