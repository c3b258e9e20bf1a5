"""Hypothesis strategies that draw conformance examples from a backend's declared capabilities.

Everything drawn is declared (the undeclared probe draws the complement), so a
backend is never asked for what it did not promise. Draws are ordered so that
Hypothesis shrinks toward the simplest case: the smallest world size, small
contiguous tensors of the first declared dtype (in ``DTYPES`` order), blocking
calls, the first root.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import hypothesis.strategies as st
import torch

from ..backend import DTYPES, Capabilities
from ..ops import COLLECTIVE_OPS, RedOpType
from .cases import Call, Example, Lane, dtype_name
from .rank import BAD_INPUTS

__all__ = ["Target", "examples_for"]

_REDUCING = frozenset({"all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor"})
_FACTORS = (2.0, 0.5, -1.5, 3.0)
_TAGS = (0, 1, 7, 2**40)
_LAYOUTS = ("contig", "strided", "transposed")
#: A "large" piece is past the default algorithms' small-message threshold (64 KiB).
_LARGE_BYTES = (66 * 1024, 200 * 1024)


@dataclass(frozen=True)
class Target:
    """What the strategies draw from: the declared capabilities on one or more devices."""

    world_sizes: tuple[int, ...]
    devices: tuple[str, ...]
    caps: dict[str, Capabilities]

    def declared(self, op: str, device: str) -> list[tuple[torch.dtype, RedOpType | None]]:
        """``(dtype, reduce kind)`` pairs declared for ``op`` (reduce kind ``None`` for other ops)."""
        caps = self.caps[device]
        if op not in caps.ops:
            return []
        if op == "barrier":
            return [(torch.float32, None)]
        pairs: list[tuple[torch.dtype, RedOpType | None]] = []
        for dtype in DTYPES:
            if dtype not in caps.dtypes:
                continue
            if op in _REDUCING:
                pairs += [(dtype, kind) for kind in sorted(caps.reduce_ops_for(dtype), key=lambda k: k.value)]
            else:
                pairs.append((dtype, None))
        return pairs

    def p2p_dtypes(self, device: str) -> list[torch.dtype]:
        caps = self.caps[device]
        if not {"send", "recv"} <= caps.ops:
            return []
        return [d for d in DTYPES if d in caps.dtypes]

    def ops(self, device: str) -> list[str]:
        return [op for op in COLLECTIVE_OPS if self.declared(op, device)]

    def undeclared(self, device: str) -> list[tuple[str, torch.dtype, RedOpType | None]]:
        """Every (op, dtype, reduce kind) combination not declared for ``device``."""
        caps = self.caps[device]
        out: list[tuple[str, torch.dtype, RedOpType | None]] = []
        for op in (*COLLECTIVE_OPS, "send", "recv"):
            for dtype in DTYPES:
                if op in _REDUCING:
                    for kind in sorted(RedOpType, key=lambda k: k.value):
                        if not caps.supports(op, dtype, kind):
                            out.append((op, dtype, kind))
                elif not caps.supports(op, None if op == "barrier" else dtype):
                    out.append((op, dtype, None))
                    if op == "barrier":
                        break
        return out


def _piece(draw: Any, dtype: torch.dtype, *, allow_0d: bool = True, allow_large: bool = True) -> tuple[int, ...]:
    kinds = ["small", "small", "small", "empty", "medium"]
    if allow_0d:
        kinds.append("0-d")
    if allow_large:
        kinds.append("large")
    kind = draw(st.sampled_from(kinds))
    if kind == "0-d":
        return ()
    if kind == "empty":
        dims = draw(st.lists(st.integers(0, 4), min_size=1, max_size=3))
        zero_at = draw(st.integers(0, len(dims) - 1))
        dims[zero_at] = 0
        return tuple(dims)
    if kind == "medium":
        return (draw(st.integers(100, 3000)),)
    if kind == "large":
        nbytes = draw(st.integers(*_LARGE_BYTES))
        return (max(1, nbytes // torch.empty((), dtype=dtype).element_size()),)
    return tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))


def _layout(draw: Any, shape: Sequence[int]) -> str:
    choices = ["contig"]
    if len(shape) >= 1:
        choices.append("strided")
    if len(shape) >= 2:
        choices.append("transposed")
    return str(draw(st.sampled_from(choices)))


def _collective(draw: Any, target: Target, device: str, op: str, n: int, *, allow_large: bool = True) -> Call:
    dtype, kind = draw(st.sampled_from(target.declared(op, device)))
    params: dict[str, Any] = {}
    if kind is not None:
        params["reduce"] = kind.name
        if kind == RedOpType.PREMUL_SUM:
            params["factor"] = draw(st.sampled_from(_FACTORS))
    if op in ("broadcast", "reduce", "gather", "scatter"):
        params["root"] = draw(st.integers(0, n - 1))
    shape: tuple[int, ...] = ()
    if op in ("all_to_all", "all_to_all_single"):
        even = op == "all_to_all_single" and draw(st.booleans())
        if even:
            rows = draw(st.integers(0, 4))
            params["splits"] = [[rows] * n for _ in range(n)]
            params["even"] = True
        else:
            params["splits"] = [[draw(st.integers(0, 3)) for _ in range(n)] for _ in range(n)]
        shape = tuple(draw(st.lists(st.integers(0 if op == "all_to_all" else 1, 4), min_size=0, max_size=2)))
        if op == "all_to_all" and draw(st.booleans()):
            shape = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=2)))
    elif op != "barrier":
        shape = _piece(draw, dtype, allow_large=allow_large)
        if op in ("all_gather_into_tensor", "reduce_scatter_tensor"):
            params["out_form"] = draw(st.sampled_from(["stack", "concat"])) if shape else "stack"
    layout = _layout(draw, shape) if op != "barrier" else "contig"
    if op in ("all_to_all", "all_to_all_single") and layout == "transposed":
        layout = "contig"  # pieces are row blocks: a transposed layout would need two dims in every piece
    async_op = draw(st.booleans())
    late = draw(st.one_of(st.none(), st.integers(0, n - 1))) if async_op and n > 1 else None
    return Call(op, dtype_name(dtype), shape, layout, async_op, late, params)


def _p2p(draw: Any, target: Target, device: str, n: int) -> Call:
    dtypes = target.p2p_dtypes(device)
    count = draw(st.integers(1, 6))
    messages = []
    for _ in range(count):
        src = draw(st.integers(0, n - 1))
        dst = draw(st.integers(0, n - 2))
        dst = dst if dst < src else dst + 1
        tag = draw(st.sampled_from(_TAGS))
        dtype = draw(st.sampled_from(dtypes))
        shape = _piece(draw, dtype, allow_large=False)
        messages.append([src, dst, tag, list(shape), dtype_name(dtype)])
    # receivers post in a drawn order; messages with the same (src, dst, tag) keep theirs
    order = draw(st.permutations(range(count)))
    queues: dict[tuple[int, int, int], list[int]] = {}
    for m, msg in enumerate(messages):
        queues.setdefault((msg[0], msg[1], msg[2]), []).append(m)
    taken: dict[tuple[int, int, int], int] = {}
    recv_order = []
    for m in order:
        k = (messages[m][0], messages[m][1], messages[m][2])
        recv_order.append(queues[k][taken.get(k, 0)])
        taken[k] = taken.get(k, 0) + 1
    mode = draw(st.sampled_from(["blocking", "async", "batch"]))
    late = 0 if mode == "async" and draw(st.booleans()) else None
    shapes = [tuple(m[3]) for m in messages]
    layout = draw(st.sampled_from(["contig", "strided"])) if all(len(s) >= 1 for s in shapes) else "contig"
    params = {"messages": messages, "mode": mode, "recv_order": recv_order}
    return Call("p2p", "float32", (), layout, mode != "blocking", late, params)


def _lane_calls(draw: Any, target: Target, device: str, n: int, count: int, *, p2p: bool = True) -> list[Call]:
    ops = target.ops(device)
    kinds = list(ops)
    if p2p and n > 1 and target.p2p_dtypes(device):
        kinds.append("p2p")
    calls = []
    for _ in range(count):
        kind = draw(st.sampled_from(kinds))
        if kind == "p2p":
            calls.append(_p2p(draw, target, device, n))
        else:
            calls.append(_collective(draw, target, device, kind, n, allow_large=False))
    return calls


def _wait_order(draw: Any, calls: list[Call]) -> list[int]:
    pending = [i for i, c in enumerate(calls) if c.async_op]
    return list(draw(st.permutations(pending))) if pending else []


def _seed(draw: Any) -> int:
    return int(draw(st.integers(0, 2**31 - 1)))


def examples_for(test: str, target: Target) -> st.SearchStrategy[Example]:
    """The strategy behind conformance test ``test`` (an op name, or one of
    ``p2p``, ``sequences``, ``concurrent_groups``, ``undeclared``, ``bad_input``, ``timeouts``)."""

    @st.composite
    def draw_example(draw: Any) -> Example:
        device = draw(st.sampled_from(_devices_for(test, target)))
        sizes = list(target.world_sizes)
        if test in ("p2p", "concurrent_groups", "timeouts"):
            sizes = [s for s in sizes if s >= 2]
        n = draw(st.sampled_from(sizes))
        members = list(range(n))
        if test in COLLECTIVE_OPS:
            calls = [_collective(draw, target, device, test, n)]
        elif test == "p2p":
            calls = [_p2p(draw, target, device, n) for _ in range(draw(st.integers(1, 2)))]
        elif test == "sequences":
            calls = _lane_calls(draw, target, device, n, draw(st.integers(2, 6)))
        elif test == "concurrent_groups":
            return _concurrent(draw, target, device, n)
        elif test == "undeclared":
            calls = _undeclared(draw, target, device, n)
        elif test == "bad_input":
            calls = _bad(draw, target, device, n)
        elif test == "timeouts":
            calls = [_timeout(draw, target, device, n)]
        else:
            raise ValueError(f"unknown conformance test {test!r}")
        return Example(n, device, _seed(draw), [Lane(members, calls, _wait_order(draw, calls))])

    return draw_example()


def _devices_for(test: str, target: Target) -> list[str]:
    """The devices on which ``test`` has something to draw."""
    if test in COLLECTIVE_OPS:
        found = [d for d in target.devices if target.declared(test, d)]
    elif test in ("p2p", "timeouts"):
        found = [d for d in target.devices if target.p2p_dtypes(d) or target.ops(d)]
    else:
        found = [d for d in target.devices if target.ops(d) or target.p2p_dtypes(d)]
    return found or list(target.devices)


def _concurrent(draw: Any, target: Target, device: str, n: int) -> Example:
    """Two groups on overlapping ranks, each running its own calls from its own thread."""
    first = list(draw(st.permutations(range(n))))
    size_b = draw(st.integers(max(1, min(2, n)), n))
    shared = draw(st.sampled_from(first))
    rest = [r for r in range(n) if r != shared]
    others = draw(st.permutations(rest))
    second = [shared, *others[: size_b - 1]]
    second = list(draw(st.permutations(second)))
    lanes = []
    for members in (first, second):
        calls = _lane_calls(draw, target, device, len(members), draw(st.integers(1, 4)))
        lanes.append(Lane(members, calls, _wait_order(draw, calls)))
    return Example(n, device, _seed(draw), lanes)


def _follow_up(draw: Any, target: Target, device: str, n: int) -> list[Call]:
    """A declared call after a probe: it proves the probe sent nothing."""
    ops = target.ops(device)
    if ops:
        call = _collective(draw, target, device, draw(st.sampled_from(ops)), n, allow_large=False)
        call.async_op, call.late = False, None
        return [call]
    if n > 1 and target.p2p_dtypes(device):
        call = _p2p(draw, target, device, n)
        call.params["mode"], call.async_op, call.late = "blocking", False, None
        return [call]
    return []


def _undeclared(draw: Any, target: Target, device: str, n: int) -> list[Call]:
    combos = target.undeclared(device)
    choices: list[tuple[str, torch.dtype, RedOpType | None, str | None]] = [
        (op, dtype, kind, None) for op, dtype, kind in combos
    ]
    choices.append(("all_reduce", torch.float32, None, "meta"))  # a device type the group has no backend for
    op, dtype, kind, other_device = draw(st.sampled_from(choices))
    if n == 1 and op in ("send", "recv"):
        op, dtype, kind, other_device = "all_reduce", torch.float32, None, "meta"
    params: dict[str, Any] = {
        "target": op,
        "caller": draw(st.integers(0, n - 1)),
        "reduce": kind.name if kind else None,
    }
    if other_device:
        params["device"] = other_device
    probe = Call("undeclared", dtype_name(dtype), (), "contig", False, None, params)
    return [probe, *_follow_up(draw, target, device, n)]


def _bad(draw: Any, target: Target, device: str, n: int) -> list[Call]:
    caps = target.caps[device]
    needs = {
        "root_out_of_range": "broadcast",
        "negative_root": "reduce",
        "list_too_long": "all_gather",
        "list_too_short": "reduce_scatter",
        "into_tensor_numel": "all_gather_into_tensor",
        "reduce_scatter_numel": "reduce_scatter_tensor",
        "mixed_dtypes": "all_gather",
        "bad_splits": "all_to_all_single",
        "not_a_tensor": "all_reduce",
        "negative_tag": "send",
        "self_send": "send",
        "peer_out_of_range": "recv",
        "bool_root": "broadcast",
        "unknown_reduce_op": "all_reduce",
    }
    assert set(needs) == set(BAD_INPUTS)
    kinds = [k for k, op in needs.items() if op in caps.ops and not (op in ("send", "recv") and n == 1)]
    if not kinds:
        return _follow_up(draw, target, device, n)
    kind = draw(st.sampled_from(kinds))
    dtypes = [d for d, _ in target.declared(needs[kind], device)] or [torch.float32]
    dtype = draw(st.sampled_from(sorted(set(dtypes), key=str)))
    probe = Call(
        "bad_input", dtype_name(dtype), (), "contig", False, None, {"kind": kind, "caller": draw(st.integers(0, n - 1))}
    )
    return [probe, *_follow_up(draw, target, device, n)]


def _timeout(draw: Any, target: Target, device: str, n: int) -> Call:
    caps = target.caps[device]
    choices = [op for op in ("all_reduce", "barrier", "all_gather", "broadcast") if target.declared(op, device)]
    if target.p2p_dtypes(device):
        choices.append("recv")
    op = draw(st.sampled_from(choices))
    caller = draw(st.integers(0, n - 1))
    peer = draw(st.sampled_from([r for r in range(n) if r != caller]))
    dtypes = [d for d, _ in target.declared(op, device)] if op != "recv" else target.p2p_dtypes(device)
    if op == "all_reduce":
        dtypes = [d for d in dtypes if caps.supports("all_reduce", d, RedOpType.SUM)] or dtypes
    dtype = draw(st.sampled_from(sorted(set(dtypes), key=str)))
    seconds = draw(st.sampled_from([0.3, 0.8]))
    params = {"target": op, "caller": caller, "peer": peer, "seconds": seconds, "tag": draw(st.sampled_from(_TAGS))}
    return Call("timeout", dtype_name(dtype), (), "contig", False, None, params)
