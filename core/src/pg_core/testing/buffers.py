"""What a rank passes to a conformance call: its buffers, or the values it sends.

:func:`prepare` makes the cpu tensors one rank passes to a buffer call (:class:`Bufs`:
inputs that must come back unchanged, outputs that receive the results, and the whole
buffers behind them, for the non-contiguous layouts); :func:`collective_input`,
:func:`message_value` and :func:`plain_buffer` do the same for the value operations. Every
rank and the controller make the same ones from the example alone
(:mod:`pg_core.testing.tensors`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .cases import EXTREME, Call, dtype_of
from .tensors import extreme_tensor, laid_out, moved, random_tensor, tensor_key
from .values import build

__all__ = ["Bufs", "collective_input", "input_bases", "message_value", "plain_buffer", "prepare"]


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
            pairs = [moved(v, b, device) for v, b in zip(views, bases, strict=True)]
            return [v for v, _ in pairs], [b for _, b in pairs]

        ins, in_bases = move(self.ins, self.in_bases)
        outs, out_bases = move(self.outs, self.out_bases)
        return Bufs(ins, outs, in_bases, out_bases)


def _value_kind(call: Call) -> str | None:
    reduce = call.params.get("reduce")
    return str(reduce) if reduce is not None else None


def _out_shape(call: Call, n: int) -> tuple[int, ...]:
    """Shape of the ``*_into_tensor`` / ``reduce_scatter_tensor`` big tensor: stacked or concatenated."""
    s = call.shape
    if call.params.get("out_form") == "concat" and len(s) >= 1:
        return (n * s[0], *s[1:])
    return (n, *s)


def prepare(call: Call, where: tuple[int, int, int], rank: int, n: int) -> Bufs:
    """The cpu tensors rank ``rank`` (of ``n``) passes to ``call``; ``where`` is
    ``(example seed, lane, step)``."""
    seed, lane, step = where
    dtype, kind, layout = call.torch_dtype, _value_kind(call), call.layout

    def key(role: object) -> tuple[object, ...]:
        return tensor_key(seed, lane, step, rank, role)

    extreme = call.params.get("values") == EXTREME

    def make(role: object, shape: Sequence[int], value_kind: str | None = kind) -> tuple[torch.Tensor, torch.Tensor]:
        if extreme:
            values = extreme_tensor(key(role), shape, dtype, value_kind, rank=rank, n=n)
        else:
            values = random_tensor(key(role), shape, dtype, value_kind)
        return laid_out(values, layout, key(role))

    def junk(role: object, shape: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return laid_out(random_tensor(key(("junk", role)), shape, dtype, None), layout, key(role))

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
        splits = call.split_rows()
        tail = call.shape
        for j in range(n):
            b.add_in(make(("x", j), (splits[rank][j], *tail)))
        for i in range(n):
            b.add_out(junk(("o", i), (splits[i][rank], *tail)))
    elif op == "all_to_all_single":
        splits = call.split_rows()
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
                mkey = tensor_key(seed, lane, step, src, ("m", m))
                if extreme:
                    values = extreme_tensor(mkey, shape, mdtype, None, rank=src, n=n)
                else:
                    values = random_tensor(mkey, shape, mdtype, None)
                b.add_in(laid_out(values, layout, key(("m", m))))
            if rank == dst:
                values = random_tensor(tensor_key(seed, lane, step, dst, ("junk-m", m)), shape, mdtype, None)
                b.add_out(laid_out(values, layout, key(("r", m))))
    return b


def input_bases(call: Call, seed: int, lane: int, step: int, n: int) -> list[list[torch.Tensor]]:
    """Per rank: the input bases as they were before the call (they must come back unchanged)."""
    return [prepare(call, (seed, lane, step), r, n).in_bases for r in range(n)]


# -- the value operations --------------------------------------------------------------------


def collective_input(call: Call, where: tuple[int, int, int], rank: int, device: torch.device | str = "cpu") -> Any:
    """What ``rank`` passes to the value collective ``call``: its object, the list of
    objects on the root of ``scatter_object``, ``None`` where the op takes none."""
    seed, lane, step = where
    p, op = call.params, call.op
    if op in ("broadcast_object", "broadcast_tensor_dict"):
        return build(p["obj"], tensor_key(seed, lane, step, rank, "obj"), device) if rank == p["root"] else None
    if op in ("all_gather_object", "gather_object"):
        return build(p["objs"][rank], tensor_key(seed, lane, step, rank, "obj"), device)
    if op == "scatter_object":
        if rank != p["root"]:
            return None
        return [build(s, tensor_key(seed, lane, step, rank, ("obj", i)), device) for i, s in enumerate(p["objs"])]
    raise ValueError(f"{op} is not a value collective")


def message_value(call: Call, where: tuple[int, int, int], m: int, device: torch.device | str = "cpu") -> Any:
    """The value message ``m`` of a ``messages`` call carries (built by its sender)."""
    seed, lane, step = where
    src, _dst, _tag, _kind, _recv_as, spec = call.params["messages"][m]
    return build(spec, tensor_key(seed, lane, step, src, ("m", m)), device)


def plain_buffer(call: Call, where: tuple[int, int, int], m: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The receive buffer of the ``plain`` message ``m`` (tensor ``recv`` of a known shape),
    filled with junk that the message must overwrite."""
    seed, lane, step = where
    _src, dst, _tag, _kind, _recv_as, spec = call.params["messages"][m]
    junk = random_tensor(tensor_key(seed, lane, step, dst, ("junk-m", m)), spec[2], dtype_of(spec[1]), None)
    return junk.to(device)
