"""Point to point over per-pair rings in shared memory: the ring and what both ends share.

Each ordered pair of members has a ring in the sender's segment (:mod:`pg_shm.layout`).
A message is a header (kind, dtype code, tag, payload bytes) and its payload; the sender
publishes bytes by moving ``head``, the receiver frees them by moving ``tail``. The sending
end is :mod:`pg_shm.sending`, the receiving end :mod:`pg_shm.receiving`.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any, Final

import torch
from pg_core.backend import DTYPES, tensor_bytes
from pg_core.dtypes import dtype_code

from .layout import BROKEN, HEAD, RECV_SLEEPS, REFUSED, SENDER_SLEEPS, TAIL, WANT_DRAIN, message_span
from .segment import Segment

__all__ = [
    "CODES",
    "EAGER_LIMIT",
    "RING_BYTES",
    "STREAM_CHUNK",
    "Payload",
    "Ring",
    "TensorViews",
    "parts_bytes",
    "parts_of",
    "tensor_parts",
]

#: The declared eager limit (``Capabilities.eager_limit_bytes``): 1 MiB.
EAGER_LIMIT: Final = 1 << 20
#: A ring's bytes: one message of :data:`EAGER_LIMIT` bytes with its header fits an empty ring.
RING_BYTES: Final = message_span(EAGER_LIMIT)
#: The most bytes of a message larger than the ring that either end copies before it moves
#: its word (``head`` or ``tail``): a quarter of the ring, so that the receiver copies one
#: piece out while the sender copies the next in, on two CPUs at once. (Copying all the room
#: there is made the two ends take turns: each waited for the other's whole ring.)
STREAM_CHUNK: Final = EAGER_LIMIT // 4

Payload = list[memoryview]

#: The wire code a tensor message's header carries for each dtype (0: none), read without a call.
CODES: Final[dict[torch.dtype, int]] = {dtype: dtype_code(dtype) or 0 for dtype in DTYPES}


def parts_bytes(parts: Payload) -> int:
    return sum(p.nbytes for p in parts)


class Ring:
    """The words and bytes of one ring, as either end maps them."""

    def __init__(self, segment: Segment, offset: int, meta: int, capacity: int) -> None:
        self.head = segment.word(offset + HEAD)
        self.tail = segment.word(offset + TAIL)
        self.sender_sleeps = segment.word(offset + SENDER_SLEEPS, 32)
        self.recv_sleeps = segment.word(offset + RECV_SLEEPS, 32)
        self.want_drain = segment.word(offset + WANT_DRAIN, 32)
        self.broken = segment.word(offset + BROKEN, 32)
        self.refused = segment.word(offset + REFUSED, 32)
        self.capacity = capacity
        self.data = segment.view[offset + meta : offset + meta + capacity]
        self.base = segment.address + offset + meta

    def move_in(self, pos: int, address: int, n: int) -> None:
        """Copy ``n`` bytes at ``address`` into the ring at ``pos`` (wrapping)."""
        cap = self.capacity
        off = pos % cap
        first = min(n, cap - off)
        ctypes.memmove(self.base + off, address, first)
        if n > first:
            ctypes.memmove(self.base, address + first, n - first)

    def move_out(self, pos: int, address: int, n: int) -> None:
        """Copy ``n`` bytes of the ring at ``pos`` (wrapping) to ``address``."""
        cap = self.capacity
        off = pos % cap
        first = min(n, cap - off)
        ctypes.memmove(address, self.base + off, first)
        if n > first:
            ctypes.memmove(address + first, self.base, n - first)

    def release(self) -> None:
        self.data.release()


class TensorViews(dict[tuple[int, int], "memoryview | None"]):
    """Byte views of the memory that one end of a ring copies tensors from or into, by
    (address, bytes), for the common case's copy: assigning a view costs 0.06-0.12 us up to
    4 KiB, where ``ctypes.memmove`` costs about 0.4 us for its call alone (2026-12-07, this
    project's machine); a program sends from and receives into the same few tensors, so both
    ends of a 4-byte one way saved about 0.6 us.

    A view is made the second time an (address, bytes) is copied (the first is noted, as
    ``None``): a program that never copies from one place twice pays a dictionary entry, not a
    view, per call. At most :data:`VIEWS_KEPT` are kept, then all are forgotten.

    A view is used only for a tensor whose memory starts at its address and spans its bytes
    now, so it never reaches memory that tensor does not hold (the tensor it was made for may
    be long gone)."""

    __slots__ = ()

    def note(self, address: int, nbytes: int) -> None:
        """A copy of ``nbytes`` at ``address`` found no view: make one if it was noted before."""
        key = (address, nbytes)
        if key in self:
            self[key] = memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")
            return
        if len(self) >= VIEWS_KEPT:
            self.clear()
        self[key] = None


#: The most (address, bytes) a :class:`TensorViews` keeps.
VIEWS_KEPT: Final = 64


def parts_of(data: object) -> Payload:
    """``send_bytes``' argument as byte views."""
    seq: Sequence[Any] = data if isinstance(data, list | tuple) else [data]
    return [memoryview(p).cast("B") for p in seq]


def tensor_parts(tensor: torch.Tensor) -> Payload:
    return [tensor_bytes(tensor)] if tensor.numel() else []
