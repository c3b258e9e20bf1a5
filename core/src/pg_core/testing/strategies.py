"""Hypothesis strategies that draw conformance examples from a backend's declared capabilities.

Everything drawn is declared (the undeclared probe draws the complement), so a
backend is never asked for what it did not promise. Draws are ordered so that
Hypothesis shrinks toward the simplest case: the smallest world size, small
contiguous tensors of the first declared dtype (in ``DTYPES`` order), blocking
calls, the first root, ``None`` for a value.

Value operations (objects, tensors of unknown shape, tensor dicts, and the
``split``/``new_group`` behind subgroups, which exchanges objects) are drawn
where the backend can carry messages (:meth:`Target.messages`): ``send`` and
``recv`` declared on the device, and either native ``send_bytes``/``recv_bytes``
or ``uint8`` declared, since pg-core then emulates messages on ``uint8`` tensors.
Tensors inside values have the dtypes declared for both ``send`` and ``recv``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import hypothesis.strategies as st
import torch

from ..backend import DTYPES, Capabilities
from ..dtypes import dtype_name
from ..objects import OBJECT_COLLECTIVES, VALUE_COLLECTIVES
from ..ops import COLLECTIVE_OPS, OPTIONAL_OPS, RedOpType
from ..tags import TagMap
from .cases import EXTREME, Call, Example, Lane
from .rank import BAD_INPUTS

__all__ = ["Target", "any_source_plan", "examples_for"]

_REDUCING = frozenset({"all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor"})
_FACTORS = (2.0, 0.5, -1.5, 3.0)
#: User tags worth drawing, where the declared range has them: small ones, both sides of 2**31
#: and 2**32 (a backend that keeps 32 bits of a tag aliases them), far out, and the top of the
#: range (see :meth:`Target.tags`).
_TAGS = (0, 1, 7, 2**31 - 1, 2**31, 2**32 + 1, 2**40)
_LAYOUTS = ("contig", "bucket", "strided", "transposed")
#: A "large" piece is past the default algorithms' small-message threshold (64 KiB).
_LARGE_BYTES = (66 * 1024, 200 * 1024)
#: Byte counts where transports and algorithms change paths (small-message limits, eager
#: buffers, socket reads): a "threshold" piece is one element below or above one of them.
THRESHOLD_BYTES = (1024, 4 * 1024, 64 * 1024)
_SPECIAL_FLOATS = (math.nan, math.inf, -math.inf, -0.0, 5e-324, 1.7976931348623157e308)
_TEXTS = ("", "é", "日本語", "🙂 ok", "a\x00b", "\u200b\ufeff\U0010fffd", "x" * 300)
_DICT_NAMES = ("k", "v", "layer.0", "block_table", "é", "")


@dataclass(frozen=True)
class Target:
    """What the strategies draw from: the declared capabilities on one or more devices."""

    world_sizes: tuple[int, ...]
    devices: tuple[str, ...]
    caps: dict[str, Capabilities]
    carries_bytes: bool = False  # the backend implements send_bytes/recv_bytes

    def messages(self, device: str) -> bool:
        """Whether values (objects, unknown shapes, tensor dicts) can travel on ``device``'s
        backend: natively, or emulated by pg-core on ``uint8`` sends."""
        caps = self.caps[device]
        if not {"send", "recv"} <= caps.ops:
            return False
        return self.carries_bytes or torch.uint8 in caps.dtypes

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

    def tags(self, device: str) -> list[int]:
        """The user tags drawn on ``device``: those of ``_TAGS`` within the declared range,
        and the range's two highest (just ``[0]`` for a backend without tags)."""
        limit = TagMap(self.caps[device].max_tag, "").limit  # user tags are 0 .. limit - 1
        wanted = [*_TAGS, limit - 2, limit - 1]
        return sorted({t for t in wanted if 0 <= t < limit}, key=wanted.index)

    def p2p_dtypes(self, device: str) -> list[torch.dtype]:
        caps = self.caps[device]
        if not {"send", "recv"} <= caps.ops:
            return []
        return [d for d in DTYPES if d in caps.dtypes]

    def any_source(self, device: str) -> list[torch.dtype]:
        """The dtypes a receive from any source takes: those of point to point, where
        ``recv_anysource`` is declared."""
        return self.p2p_dtypes(device) if "recv_anysource" in self.caps[device].ops else []

    def ops(self, device: str) -> list[str]:
        return [op for op in COLLECTIVE_OPS if self.declared(op, device)]

    def undeclared(self, device: str) -> list[tuple[str, torch.dtype, RedOpType | None]]:
        """Every (op, dtype, reduce kind) combination not declared for ``device``."""
        caps = self.caps[device]
        out: list[tuple[str, torch.dtype, RedOpType | None]] = []
        for op in (*COLLECTIVE_OPS, "send", "recv", *OPTIONAL_OPS):
            for dtype in DTYPES:
                if op in _REDUCING:
                    for kind in sorted(RedOpType, key=lambda k: k.value):
                        if not caps.supports(op, dtype, kind):
                            out.append((op, dtype, kind))
                elif not caps.supports(op, None if op == "barrier" else dtype):
                    out.append((op, dtype, None))
                    if op == "barrier":
                        break
        if not self.messages(device):  # values ride on messages: they must be refused too
            out += [("send_object", torch.uint8, None), ("broadcast_object", torch.uint8, None)]
        return out


def threshold_pieces(dtype: torch.dtype, *, allow_large: bool = True) -> list[tuple[int, ...]]:
    """1-d pieces of ``dtype`` one element below and above each of :data:`THRESHOLD_BYTES`
    (64 KiB only where large pieces are allowed)."""
    item = torch.empty((), dtype=dtype).element_size()
    limits = [b for b in THRESHOLD_BYTES if allow_large or b < 64 * 1024]
    return [(b // item + delta,) for b in limits for delta in (-1, 1)]


def _piece(draw: Any, dtype: torch.dtype, *, allow_0d: bool = True, allow_large: bool = True) -> tuple[int, ...]:
    """A piece of one size class: small, one element (any number of dimensions), 0-element,
    0-d, medium, one element below or above a threshold (:func:`threshold_pieces`), or large."""
    kinds = ["small", "small", "small", "one", "empty", "medium", "threshold"]
    if allow_0d:
        kinds.append("0-d")
    if allow_large:
        kinds.append("large")
    kind = draw(st.sampled_from(kinds))
    if kind == "0-d":
        return ()
    if kind == "one":
        return (1,) * draw(st.integers(1, 3))
    if kind == "threshold":
        return tuple(draw(st.sampled_from(threshold_pieces(dtype, allow_large=allow_large))))
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
    """``contig`` (a fresh tensor), ``bucket`` (a view into a flat storage, between sentinels;
    drawn twice as often as the others, since every op must meet it), ``strided`` (1-d and up)
    or ``transposed`` (2-d and up)."""
    choices = ["contig", "bucket", "bucket"]
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
    if op != "barrier" and draw(st.booleans()):
        params["values"] = EXTREME  # the whole range at every size class, not only coverage's
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
        tag = draw(st.sampled_from(target.tags(device)))
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
    layout = draw(st.sampled_from(["contig", "bucket", *(["strided"] if all(len(s) >= 1 for s in shapes) else [])]))
    params: dict[str, Any] = {"messages": messages, "mode": mode, "recv_order": recv_order}
    if draw(st.booleans()):
        params["values"] = EXTREME
    return Call("p2p", "float32", (), layout, mode != "blocking", late, params)


def any_source_plan(messages: Sequence[Sequence[int]], order: Sequence[int], named: Sequence[bool]) -> list[list[Any]]:
    """The receives of an ``any_source`` call: one per message, on the tags of ``order`` (a
    permutation of the messages' indices, read for their tags), each from any source unless
    ``named[i]`` asks to name a sender and some sender can be named there: one whose messages
    on that tag cannot all have been taken by the receives before it, so the plan never waits
    for a message another receive may have taken (every sender's message count on the tag is
    above its named receives there so far plus the tag's any-source receives so far)."""
    count: dict[tuple[int, int], int] = {}
    for src, tag in messages:
        count[(src, tag)] = count.get((src, tag), 0) + 1
    taken: dict[tuple[int, int], int] = {}
    anyone: dict[int, int] = {}
    plan: list[list[Any]] = []
    for i, m in enumerate(order):
        tag = messages[m][1]
        can = sorted(src for (src, t), c in count.items() if t == tag and c > taken.get((src, t), 0) + anyone.get(t, 0))
        if named[i] and can:
            src = can[i % len(can)]
            taken[(src, tag)] = taken.get((src, tag), 0) + 1
            plan.append([src, tag])
        else:
            anyone[tag] = anyone.get(tag, 0) + 1
            plan.append([None, tag])
    return plan


def _any_source(draw: Any, target: Target, device: str, n: int) -> Call:
    """Every rank but a drawn receiver sends it one to three messages on one or two drawn tags;
    the receiver takes them in a drawn order, from any source or (blocking) naming a sender,
    or (async) posts any-source receives all at once. One dtype and shape per call: a
    receive from any source must fit whichever message it gets."""
    dtype = draw(st.sampled_from(target.any_source(device)))
    shape = _piece(draw, dtype, allow_large=False)
    receiver = draw(st.integers(0, n - 1))
    tags = draw(st.lists(st.sampled_from(target.tags(device)), min_size=1, max_size=2, unique=True))
    messages = [
        [src, draw(st.sampled_from(tags))]
        for src in range(n)
        if src != receiver
        for _ in range(draw(st.integers(1, 3)))
    ]
    mode = draw(st.sampled_from(["blocking", "async"]))
    order = draw(st.permutations(range(len(messages))))
    named = [mode == "blocking" and draw(st.booleans()) for _ in messages]
    layout = draw(st.sampled_from(["contig", "bucket", *(["strided"] if len(shape) >= 1 else [])]))
    params = {"receiver": receiver, "messages": messages, "plan": any_source_plan(messages, order, named), "mode": mode}
    if draw(st.booleans()):
        params["values"] = EXTREME
    return Call("any_source", dtype_name(dtype), shape, layout, mode == "async", None, params)


def _lane_calls(draw: Any, target: Target, device: str, n: int, count: int, *, p2p: bool = True) -> list[Call]:
    ops = target.ops(device)
    kinds = list(ops)
    if p2p and n > 1 and target.p2p_dtypes(device):
        kinds.append("p2p")
    if target.messages(device):
        kinds.append("value_collective")
        if n > 1:
            kinds.append("messages")
    calls = []
    for _ in range(count):
        kind = draw(st.sampled_from(kinds))
        if kind == "p2p":
            calls.append(_p2p(draw, target, device, n))
        elif kind == "value_collective":
            op = draw(st.sampled_from(VALUE_COLLECTIVES))
            calls.append(_value_collective(draw, target, device, op, n, allow_large=False))
        elif kind == "messages":
            calls.append(_messages(draw, target, device, n, ("object", "tensor", "tensor_dict", "plain")))
        else:
            calls.append(_collective(draw, target, device, kind, n, allow_large=False))
    return calls


def _coalesced_calls(draw: Any, target: Target, device: str, n: int, count: int) -> list[Call]:
    """What a coalescing block takes: declared tensor collectives but barrier, and point to
    point as ``batch_isend_irecv`` (which joins the block's batch); nobody calls late."""
    kinds = [op for op in target.ops(device) if op != "barrier"]
    if n > 1 and target.p2p_dtypes(device):
        kinds.append("p2p")
    calls = []
    for _ in range(count):
        kind = draw(st.sampled_from(kinds))
        if kind == "p2p":
            call = _p2p(draw, target, device, n)
            call.params["mode"], call.async_op = "batch", True
        else:
            call = _collective(draw, target, device, kind, n, allow_large=False)
        call.late = None
        calls.append(call)
    return calls


# -- values: objects, tensors of unknown shape, tensor dicts -----------------------------------


def _leaf_spec() -> st.SearchStrategy[list[Any]]:
    return st.one_of(
        st.just(["none"]),
        st.booleans().map(lambda b: ["bool", b]),
        st.integers(-(2**100), 2**100).map(lambda i: ["int", i]),
        st.one_of(st.sampled_from(_SPECIAL_FLOATS), st.floats()).map(lambda f: ["float", float(f).hex()]),
        st.one_of(st.sampled_from(_TEXTS), st.text(max_size=12)).map(lambda t: ["str", t]),
        st.binary(max_size=24).map(lambda b: ["bytes", b.hex()]),
    )


@st.composite
def _tensor_spec(draw: Any, dtypes: Sequence[torch.dtype], allow_large: bool, often_large: bool = False) -> list[Any]:
    """A tensor of a declared dtype; ``often_large``: past 64 KiB one time in four."""
    dtype = draw(st.sampled_from(list(dtypes)))
    if often_large and draw(st.integers(0, 3)) == 3:
        shape: tuple[int, ...] = (draw(st.integers(*_LARGE_BYTES)) // torch.empty((), dtype=dtype).element_size(),)
    else:
        shape = _piece(draw, dtype, allow_large=allow_large)
    layout = _layout(draw, shape)
    special = bool((dtype.is_floating_point or dtype.is_complex) and draw(st.booleans()))
    return ["tensor", dtype_name(dtype), list(shape), layout, special]


def _object_spec(dtypes: Sequence[torch.dtype]) -> st.SearchStrategy[list[Any]]:
    """Nested lists, tuples and dicts of ints, floats, strings, bytes, None, bools and tensors."""
    leaves = [_leaf_spec()]
    if dtypes:
        leaves.append(_tensor_spec(dtypes, False))
    keys = st.one_of(
        st.one_of(st.sampled_from(_DICT_NAMES), st.text(max_size=6)).map(lambda t: ["str", t]),
        st.integers(-3, 1000).map(lambda i: ["int", i]),
    )
    return st.recursive(
        st.one_of(*leaves),
        lambda kids: st.one_of(
            st.lists(kids, max_size=4).map(lambda xs: ["list", xs]),
            st.lists(kids, max_size=4).map(lambda xs: ["tuple", xs]),
            st.lists(st.tuples(keys, kids).map(list), max_size=4).map(lambda kv: ["dict", kv]),
        ),
        max_leaves=8,
    )


def _tensor_dict_spec(dtypes: Sequence[torch.dtype]) -> st.SearchStrategy[list[Any]]:
    """A dict (str keys) of tensors, plain values and nested dicts, as a kv-cache transfer carries."""
    names = st.one_of(st.sampled_from(_DICT_NAMES), st.text(max_size=6)).map(lambda t: ["str", t])
    plain = st.one_of(
        _leaf_spec(),
        st.lists(st.integers(-5, 5000).map(lambda i: ["int", i]), max_size=4).map(lambda xs: ["list", xs]),
    )
    leaf = st.one_of(_tensor_spec(dtypes, False), plain) if dtypes else plain
    entry = st.recursive(
        leaf,
        lambda kids: st.lists(st.tuples(names, kids).map(list), max_size=3).map(lambda kv: ["dict", kv]),
        max_leaves=6,
    )
    return st.lists(st.tuples(names, entry).map(list), max_size=4).map(lambda kv: ["dict", kv])


def _value_collective(draw: Any, target: Target, device: str, op: str, n: int, *, allow_large: bool = True) -> Call:
    """One of the value collectives, with a drawn root and drawn values (one per rank where
    every rank contributes)."""
    dtypes = target.p2p_dtypes(device)
    params: dict[str, Any] = {}
    if op != "all_gather_object":
        params["root"] = draw(st.integers(0, n - 1))
    if op == "broadcast_object":
        params["obj"] = draw(_object_spec(dtypes))
    elif op == "broadcast_tensor_dict":
        params["obj"] = draw(_tensor_dict_spec(dtypes))
        if allow_large and dtypes and draw(st.booleans()):  # a kv-cache block past 64 KiB
            dtype = draw(st.sampled_from(list(dtypes)))
            size = torch.empty((), dtype=dtype).element_size()
            block = ["tensor", dtype_name(dtype), [draw(st.integers(*_LARGE_BYTES)) // size], "contig", False]
            params["obj"] = ["dict", [*params["obj"][1], [["str", "big"], block]]]
        params["device"] = draw(st.sampled_from([None, device]))
    else:
        params["objs"] = [draw(_object_spec(dtypes)) for _ in range(n)]
    async_op = draw(st.booleans())
    late = draw(st.one_of(st.none(), st.integers(0, n - 1))) if async_op and n > 1 else None
    return Call(op, "float32", (), "contig", async_op, late, params)


def _messages(draw: Any, target: Target, device: str, n: int, kinds: Sequence[str]) -> Call:
    """Value messages between drawn pairs, on drawn tags, each received the way it draws
    (``recv_object`` takes anything; ``recv_tensor``/``recv_tensor_dict`` with or without
    ``device``). ``plain`` messages are tensor ``send``/``recv`` of a known shape on the same
    tags: a namespace of their own, so they must not meet the value messages."""
    dtypes = target.p2p_dtypes(device)
    usable = [k for k in kinds if dtypes or k not in ("tensor", "plain")]
    msgs: list[list[Any]] = []
    for _ in range(draw(st.integers(1, 5))):
        src = draw(st.integers(0, n - 1))
        dst = draw(st.integers(0, n - 2))
        dst = dst if dst < src else dst + 1
        tag = draw(st.sampled_from(target.tags(device)))
        kind = draw(st.sampled_from(usable))
        if kind == "object":
            spec, recv_as = draw(_object_spec(dtypes)), "recv_object"
        elif kind == "tensor":
            spec = draw(_tensor_spec(dtypes, True, True))
            recv_as = draw(st.sampled_from(["recv_tensor", f"recv_tensor@{device}", "recv_object"]))
        elif kind == "tensor_dict":
            spec = draw(_tensor_dict_spec(dtypes))
            recv_as = draw(st.sampled_from(["recv_tensor_dict", f"recv_tensor_dict@{device}", "recv_object"]))
        else:
            spec, recv_as = draw(_tensor_spec(dtypes, False)), "recv"
        msgs.append([src, dst, tag, kind, recv_as, spec])
    # receivers take their messages in a drawn order; per (sender, receiver, tag, namespace) in send order
    order = draw(st.permutations(range(len(msgs))))
    queues: dict[tuple[int, int, int, bool], list[int]] = {}
    for m, msg in enumerate(msgs):
        queues.setdefault((msg[0], msg[1], msg[2], msg[3] == "plain"), []).append(m)
    taken: dict[tuple[int, int, int, bool], int] = {}
    recv_order = []
    for m in order:
        k = (msgs[m][0], msgs[m][1], msgs[m][2], msgs[m][3] == "plain")
        recv_order.append(queues[k][taken.get(k, 0)])
        taken[k] = taken.get(k, 0) + 1
    mode = draw(st.sampled_from(["blocking", "async"]))
    late = 0 if mode == "async" and draw(st.booleans()) else None
    params = {"messages": msgs, "mode": mode, "recv_order": recv_order}
    return Call("messages", "float32", (), "contig", mode == "async", late, params)


def _value_calls(
    draw: Any, target: Target, device: str, n: int, *, ops: Sequence[str], kinds: Sequence[str]
) -> list[Call]:
    choices = list(ops) + (["messages", "messages"] if n > 1 else [])
    calls = []
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(choices))
        if op == "messages":
            calls.append(_messages(draw, target, device, n, kinds))
        else:
            calls.append(_value_collective(draw, target, device, op, n))
    return calls


# -- subgroups -------------------------------------------------------------------------------


def _subgroups(draw: Any, target: Target, device: str, n: int) -> Example:
    """A group of every rank (in a drawn order) that forms subgroups with ``split`` (drawn
    colors, ``None`` among them, and keys) and ``new_group`` (drawn members in a drawn order,
    called by them only), runs calls on them, one level deeper at most, and goes on after."""
    lanes = [Lane(list(draw(st.permutations(range(n)))), [])]
    _grow(draw, target, device, lanes, 0, depth=0)
    return Example(n, device, _seed(draw), lanes)


def _grow(draw: Any, target: Target, device: str, lanes: list[Lane], li: int, *, depth: int) -> None:
    size = len(lanes[li].members)
    calls: list[Call] = []
    if depth > 0:
        calls += _lane_calls(draw, target, device, size, draw(st.integers(1, 2)))
    elif draw(st.booleans()):
        calls += _lane_calls(draw, target, device, size, 1)
    forms = draw(st.integers(1, 2)) if depth == 0 else draw(st.integers(0, 1))
    for _ in range(forms):
        calls.append(_form(draw, target, device, lanes, li, depth=depth))
    if draw(st.booleans()):
        calls += _lane_calls(draw, target, device, size, 1)
    lanes[li].calls = calls
    lanes[li].wait_order = _wait_order(draw, calls)


def _form(draw: Any, target: Target, device: str, lanes: list[Lane], li: int, *, depth: int) -> Call:
    parent = lanes[li].members
    size = len(parent)
    hows = ["new_group", "split"] if target.messages(device) else ["new_group"]  # split exchanges objects
    how = draw(st.sampled_from(hows))
    name = draw(st.sampled_from([None, f"sub{len(lanes)}"]))
    if how == "new_group":
        ranks = list(draw(st.permutations(range(size))))[: draw(st.integers(1, size))]
        child = len(lanes)
        lanes.append(Lane([parent[r] for r in ranks], [], parent=li))
        _grow(draw, target, device, lanes, child, depth=depth + 1)
        return Call("new_group", params={"ranks": ranks, "lane": child, "name": name})
    colors = [draw(st.one_of(st.sampled_from([0, 1, 2, 2**31]), st.none())) for _ in range(size)]
    keys = [draw(st.integers(-2, 2)) for _ in range(size)]
    pairs = []
    for color in sorted({c for c in colors if c is not None}):
        ranks = sorted((r for r in range(size) if colors[r] == color), key=lambda r: (keys[r], r))
        child = len(lanes)
        lanes.append(Lane([parent[r] for r in ranks], [], parent=li))
        pairs.append([color, child])
        _grow(draw, target, device, lanes, child, depth=depth + 1)
    return Call("split", params={"colors": colors, "keys": keys, "lanes": pairs, "name": name})


def _wait_order(draw: Any, calls: list[Call]) -> list[int]:
    pending = [i for i, c in enumerate(calls) if c.async_op]
    return list(draw(st.permutations(pending))) if pending else []


def _seed(draw: Any) -> int:
    return int(draw(st.integers(0, 2**31 - 1)))


def examples_for(test: str, target: Target) -> st.SearchStrategy[Example]:
    """The strategy behind conformance test ``test`` (an op name, or one of ``p2p``,
    ``any_source``, ``objects``, ``unknown_shape``, ``subgroups``, ``sequences``, ``coalescing``,
    ``concurrent_groups``, ``undeclared``, ``bad_input``, ``timeouts``)."""

    @st.composite
    def draw_example(draw: Any) -> Example:
        device = draw(st.sampled_from(_devices_for(test, target)))
        sizes = list(target.world_sizes)
        if test in ("p2p", "any_source", "concurrent_groups", "timeouts"):
            sizes = [s for s in sizes if s >= 2]
        elif test in ("objects", "unknown_shape"):  # one rank only sends to itself: a few examples at most
            sizes = [s for s in sizes if s >= 2] or sizes
        n = draw(st.sampled_from(sizes))
        members = list(range(n))
        if test in COLLECTIVE_OPS:
            calls = [_collective(draw, target, device, test, n)]
        elif test == "p2p":
            calls = [_p2p(draw, target, device, n) for _ in range(draw(st.integers(1, 2)))]
        elif test == "any_source":  # one call: a later one's messages could meet this one's receives
            calls = [_any_source(draw, target, device, n)]
        elif test == "objects":
            calls = _value_calls(
                draw, target, device, n, ops=OBJECT_COLLECTIVES, kinds=("object", "object", "plain", "tensor")
            )
        elif test == "unknown_shape":
            kinds = ("tensor", "tensor", "tensor_dict", "plain", "object")
            calls = _value_calls(draw, target, device, n, ops=("broadcast_tensor_dict",), kinds=kinds)
        elif test == "subgroups":
            return _subgroups(draw, target, device, n)
        elif test == "sequences":
            calls = _lane_calls(draw, target, device, n, draw(st.integers(2, 6)))
        elif test == "coalescing":
            calls = _coalesced_calls(draw, target, device, n, draw(st.integers(1, 5)))
            lane = Lane(
                members, calls, _wait_order(draw, calls), coalesced=draw(st.sampled_from(["blocking", "async"]))
            )
            return Example(n, device, _seed(draw), [lane])
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
    elif test == "any_source":
        found = [d for d in target.devices if target.any_source(d)]
    elif test in ("objects", "unknown_shape"):
        found = [d for d in target.devices if target.messages(d)]
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
    if n == 1 and op in ("send", "recv", "send_object", "recv_anysource"):
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


#: What each bad input needs: an op declared, ``"messages"`` (values can travel), or
#: nothing (``None``); and whether it needs a peer (world size >= 2).
_BAD_VALUE_NEEDS: dict[str, tuple[str | None, bool]] = {
    "scatter_object_wrong_length": ("messages", False),
    "scatter_object_not_a_list": ("messages", False),
    "broadcast_object_root_out_of_range": ("messages", False),
    "gather_object_negative_root": ("messages", False),
    "send_object_to_self": ("messages", False),
    "send_object_negative_tag": ("messages", True),
    "send_object_unpicklable": ("messages", True),
    "recv_object_out_of_range": ("messages", False),
    "send_tensor_not_a_tensor": ("messages", True),
    "recv_tensor_from_self": ("messages", False),
    "send_tensor_dict_not_a_dict": ("messages", True),
    "broadcast_tensor_dict_off_root": ("messages", True),
    "new_group_out_of_range": (None, False),
    "new_group_duplicate": (None, False),
    "new_group_non_member": (None, True),
    "split_negative_color": (None, False),
    "split_key_not_int": (None, False),
}


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
    assert set(needs) | set(_BAD_VALUE_NEEDS) == set(BAD_INPUTS)
    kinds = [k for k, op in needs.items() if op in caps.ops and not (op in ("send", "recv") and n == 1)]
    for k, (need, peer) in _BAD_VALUE_NEEDS.items():
        if (need is None or target.messages(device)) and not (peer and n == 1):
            kinds.append(k)
    if not kinds:
        return _follow_up(draw, target, device, n)
    kind = draw(st.sampled_from(kinds))
    if kind in _BAD_VALUE_NEEDS:
        dtypes = target.p2p_dtypes(device) or [torch.float32]
    else:
        dtypes = [d for d, _ in target.declared(needs[kind], device)] or [torch.float32]
    dtype = draw(st.sampled_from(sorted(set(dtypes), key=str)))
    caller = draw(st.integers(0, n - 1))
    probe = Call("bad_input", dtype_name(dtype), (), "contig", False, None, {"kind": kind, "caller": caller})
    follow = _follow_up(draw, target, device, n)
    if target.messages(device) and (
        _BAD_VALUE_NEEDS.get(kind, (None, False))[0] == "messages" or kind.startswith("split")
    ):
        follow += _value_follow_up(n, caller)
    return [probe, *follow]


def _value_follow_up(n: int, caller: int) -> list[Call]:
    """After a value probe: an object collective, and objects between the caller and every
    other rank on tag 0 both ways; either would read a message the probe had sent."""
    gather = Call("all_gather_object", params={"objs": [["list", [["int", r], ["str", "é"]]] for r in range(n)]})
    msgs = []
    for r in range(n):
        if r != caller:
            msgs += [
                [caller, r, 0, "object", "recv_object", ["int", r]],
                [r, caller, 0, "object", "recv_object", ["none"]],
            ]
    if not msgs:
        return [gather]
    params = {"messages": msgs, "mode": "blocking", "recv_order": list(range(len(msgs)))}
    return [gather, Call("messages", params=params)]


def _timeout(draw: Any, target: Target, device: str, n: int) -> Call:
    caps = target.caps[device]
    choices = [op for op in ("all_reduce", "barrier", "all_gather", "broadcast") if target.declared(op, device)]
    if target.p2p_dtypes(device):
        choices.append("recv")
    if target.any_source(device):
        choices.append("recv_anysource")
    if target.messages(device):
        choices += ["recv_object", "broadcast_object"]
    op = draw(st.sampled_from(choices))
    caller = draw(st.integers(0, n - 1))
    peer = draw(st.sampled_from([r for r in range(n) if r != caller]))
    if op in ("recv_object", "broadcast_object"):
        dtypes = [torch.float32]
    else:
        dtypes = (
            [d for d, _ in target.declared(op, device)]
            if op not in ("recv", "recv_anysource")
            else target.p2p_dtypes(device)
        )
    if op == "all_reduce":
        dtypes = [d for d in dtypes if caps.supports("all_reduce", d, RedOpType.SUM)] or dtypes
    dtype = draw(st.sampled_from(sorted(set(dtypes), key=str)))
    seconds = draw(st.sampled_from([0.3, 0.8]))
    params = {
        "target": op,
        "caller": caller,
        "peer": peer,
        "seconds": seconds,
        "tag": draw(st.sampled_from(target.tags(device))),
    }
    return Call("timeout", dtype_name(dtype), (), "contig", False, None, params)
