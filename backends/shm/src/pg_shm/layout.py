"""Where everything sits in a member's segment, and who writes each word.

Every member creates one segment (:class:`~pg_shm.segment.Segment`) and maps every other
member's. A member's segment holds, one cache line per word so writers never share a line:

* the **control block**: its ``pid``; its ``state`` (:data:`LIVE`, :data:`SHUT_DOWN`,
  :data:`ABORTED`); its ``doorbell`` (the futex its drainer thread sleeps on; nobody writes
  it, senders only wake it); its collective ``step`` counter and ``coll_sleeps`` flag;
* one **ring** per peer, carrying the messages *this* member sends to that peer: the
  sender writes ``head`` (bytes published), ``sender_sleeps`` and ``want_drain``; the
  receiver writes ``tail`` (bytes consumed), ``recv_sleeps`` and ``refused``; then the ring's bytes;
* two **collective slots** (sequence parity), where this member puts its contributions.

Every word has one writing process, so no lock lives in shared memory and a member that
dies holds nothing the others need. Messages in a ring start at multiples of
:data:`ALIGN` with a :data:`HEADER` (kind, dtype code, tag, payload bytes); the payload
follows and may wrap around the ring's end.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final

__all__ = [
    "ABORTED",
    "ALIGN",
    "HEADER",
    "KIND_BYTES",
    "KIND_TENSOR",
    "LIVE",
    "SHUT_DOWN",
    "Layout",
    "message_span",
]

LINE: Final = 64
ALIGN: Final = 64
#: kind u32 | dtype code u32 | tag i64 | nbytes u64 | pad u64
HEADER: Final = struct.Struct("<IIqQ8x")

KIND_TENSOR: Final = 1
KIND_BYTES: Final = 2

LIVE: Final = 0
SHUT_DOWN: Final = 1
ABORTED: Final = 2

# control block
PID: Final = 0
STATE: Final = LINE
DOORBELL: Final = 2 * LINE
STEP: Final = 3 * LINE
COLL_SLEEPS: Final = 4 * LINE
CONTROL_BYTES: Final = 8 * LINE

# a ring's words, from the ring's start
HEAD: Final = 0
SENDER_SLEEPS: Final = LINE
WANT_DRAIN: Final = 2 * LINE
BROKEN: Final = 3 * LINE
TAIL: Final = 4 * LINE
RECV_SLEEPS: Final = 5 * LINE
#: the receiver's drainer left a message in the ring: its member's budget of held messages is spent
REFUSED: Final = 6 * LINE
RING_META: Final = 8 * LINE


def message_span(nbytes: int) -> int:
    """Ring bytes a message of ``nbytes`` payload takes: header and payload, rounded up."""
    return (HEADER.size + nbytes + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class Layout:
    """Offsets in the segment of a member of a group of ``size`` with rings of ``ring_bytes``
    and collective slots of ``slot_bytes`` (each of two)."""

    size: int
    ring_bytes: int
    slot_bytes: int

    def ring(self, owner: int, peer: int) -> int:
        """Offset, in ``owner``'s segment, of the ring carrying ``owner``'s messages to ``peer``."""
        index = peer if peer < owner else peer - 1
        return CONTROL_BYTES + index * (RING_META + self.ring_bytes)

    def slot(self, parity: int) -> int:
        return CONTROL_BYTES + (self.size - 1) * (RING_META + self.ring_bytes) + parity * self.slot_bytes

    @property
    def total(self) -> int:
        return self.slot(2)
