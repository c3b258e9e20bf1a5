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


def parts_of(data: object) -> Payload:
    """``send_bytes``' argument as byte views."""
    seq: Sequence[Any] = data if isinstance(data, list | tuple) else [data]
    return [memoryview(p).cast("B") for p in seq]


def tensor_parts(tensor: torch.Tensor) -> Payload:
    return [tensor_bytes(tensor)] if tensor.numel() else []
