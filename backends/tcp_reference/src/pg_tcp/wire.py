"""pg-tcp's wire format: what the bytes on a connection mean, once its handshake is over.

This module holds data and pure functions only (no sockets, no locks, no state): the frame
header, the kinds of frames, and how a collective's opcode, argument and dtype are encoded
in it and described in error messages. :mod:`pg_tcp.transport` writes and reads frames in
this format; :mod:`pg_tcp.handshake` owns the bytes that come before the first frame.

Frames
======

Every message is a 32-byte header (:data:`HEADER`, little-endian) followed by ``nbytes`` of
payload::

    magic u16 | kind u8 | opcode u8 | dtype u8 | pad 3 | tag i64 | seq u64 | nbytes u64

``magic`` is :data:`MAGIC`; a header with another one, or an unknown ``kind``, means the
stream is unusable (the peer is dropped as if it crashed). ``kind`` separates the traffic
that shares a connection:

* :data:`TENSOR`: a point-to-point tensor, matched on (peer, tag) in FIFO order; ``dtype``
  and ``nbytes`` must equal the receive's;
* :data:`BYTES`: a variable-size byte message (the same matching, a separate namespace;
  ``dtype`` is :data:`RAW`);
* :data:`COLL`: a collective's frame, matched FIFO per peer and checked against the
  receiver's expectation: ``seq`` (the collective's sequence number), ``opcode``
  (:data:`OPCODE`), ``tag`` (the op's argument, :func:`encode_arg`), ``dtype`` and
  ``nbytes``. Because every collective frame says what it is, ranks that call different
  things get :class:`~pg_core.errors.CollectiveMismatchError` instead of reading each
  other's bytes as data;
* control frames, whose payload is at most :data:`MAX_CONTROL_BYTES`: :data:`ARRIVED`
  (I am blocked in collective #seq, this opcode and argument), :data:`ABORT` (collective
  #seq failed here; ``opcode`` is a reason code of :data:`REASON_CLASS`, the payload says
  why), :data:`BYE` (I shut down cleanly, nothing follows; a nonzero ``opcode`` and the
  payload say why my collectives had stopped), :data:`RETIRE` (nothing more from me on this
  connection: my frames continue on my other one, see :mod:`pg_tcp.handshake`) and
  :data:`ABORTED` (I aborted, nothing follows; ``seq`` is the first collective I will not
  finish, 0 if unknown, and the payload may say why).

``dtype`` is 0 for none, :func:`pg_core.dtypes.dtype_code` of the tensor's dtype
(:data:`DTYPE_CODE`), or :data:`RAW` for bytes. The payload of a tensor is its memory as it
is (native byte order: the ranks of a job share one architecture).

:data:`PROTOCOL_VERSION` versions everything here and in the handshake; both ends of a
connection must speak the same one (the hello says which).
"""

from __future__ import annotations

import struct
from typing import Final

import torch
from pg_core.backend import DTYPES
from pg_core.dtypes import dtype_code, dtype_from_code, dtype_name
from pg_core.errors import CollectiveMismatchError, PeerFailureError, PGError
from pg_core.ops import COLLECTIVE_OPS, RedOpType

__all__ = [
    "ABORT",
    "ABORTED",
    "ARRIVED",
    "BYE",
    "BYTES",
    "COLL",
    "DTYPE_CODE",
    "HEADER",
    "HEADER_SIZE",
    "MAGIC",
    "MAX_CONTROL_BYTES",
    "OPCODE",
    "PROTOCOL_VERSION",
    "RAW",
    "REASON_CLASS",
    "REASON_CODE",
    "RETIRE",
    "TENSOR",
    "Frame",
    "describe_arg",
    "describe_dtype",
    "describe_op",
    "encode_arg",
    "reason_code",
]

HEADER: Final = struct.Struct("<HBBB3xqQQ")  # magic, kind, opcode, dtype, tag, seq, nbytes
HEADER_SIZE: Final = HEADER.size  # 32
MAGIC: Final = 0x5054  # "TP"
#: 2: connections made on first use (hello flags, RETIRE); 3: the CROSSED answer; 4: authenticated hellos;
#: 5: the ABORTED goodbye
PROTOCOL_VERSION: Final = 5

# kinds
TENSOR: Final = 1  # point-to-point tensor, matched on (peer, tag)
BYTES: Final = 2  # point-to-point variable-size message, matched on (peer, tag)
COLL: Final = 3  # collective frame, matched FIFO per peer, checked against (seq, opcode, tag, dtype, nbytes)
ARRIVED: Final = 4  # control: "I am blocked in collective #seq", with its opcode and argument
ABORT: Final = 5  # control: "collective #seq failed here"; opcode = reason code, payload = reason
BYE: Final = 6  # control: clean shutdown, nothing follows; opcode/payload: why its collectives stopped, if they did
RETIRE: Final = 7  # control: nothing more from me on this connection (my frames continue on my other one)
ABORTED: Final = 8  # control: I aborted, nothing follows; seq: the first collective I will not finish; payload: why

#: A header's fields after ``magic``, as the reader keeps them: kind, opcode, dtype, tag, seq, nbytes.
Frame = tuple[int, int, int, int, int, int]

#: What a control frame may carry: an ABORT's or a BYE's reason; ARRIVED and RETIRE carry nothing.
MAX_CONTROL_BYTES: Final = 1 << 16

# dtype codes: 0 = none, 1.. = pg_core.dtypes' wire codes, 255 = raw bytes
DTYPE_CODE: Final[dict[torch.dtype, int]] = {dtype: dtype_code(dtype) or 0 for dtype in DTYPES}
RAW: Final = 255
#: A collective's opcode: its position in :data:`pg_core.ops.COLLECTIVE_OPS`, from 1.
OPCODE: Final[dict[str, int]] = {name: i + 1 for i, name in enumerate(COLLECTIVE_OPS)}

_REDOP_CODE: Final[dict[RedOpType, int]] = {kind: i + 1 for i, kind in enumerate(RedOpType)}
_REDOP_NAME: Final[dict[int, str]] = {code: kind.name for kind, code in _REDOP_CODE.items()}

#: Why collectives stopped: the ``opcode`` of an ABORT frame, or of a BYE sent after they
#: did, and the error class a receiving rank raises for it.
REASON_CLASS: Final[dict[int, type[PGError]]] = {1: CollectiveMismatchError, 2: PeerFailureError}
REASON_CODE: Final[dict[type[PGError], int]] = {cls: code for code, cls in REASON_CLASS.items()}


def reason_code(cls: type[PGError]) -> int:
    """The reason code an ABORT frame carries for a failure of class ``cls``: a peer's
    failure (any :class:`~pg_core.errors.PeerFailureError`) or, for anything else, a mismatch."""
    if issubclass(cls, PeerFailureError):
        return REASON_CODE[PeerFailureError]
    return REASON_CODE.get(cls, REASON_CODE[CollectiveMismatchError])


def encode_arg(*, root: int = -1, op: RedOpType | None = None) -> int:
    """A collective's argument as it travels in its frames' ``tag``: root and reduce op."""
    return (root + 1) << 8 | (0 if op is None else _REDOP_CODE[op])


def describe_arg(arg: int) -> str:
    """An encoded argument (:func:`encode_arg`) in words, for error messages."""
    root, op = (arg >> 8) - 1, arg & 0xFF
    parts = ([f"root {root}"] if root >= 0 else []) + ([_REDOP_NAME.get(op, f"op#{op}")] if op else [])
    return ", ".join(parts) or "no root or reduce op"


def describe_dtype(code: int) -> str:
    """A frame's ``dtype`` code in words, for error messages."""
    if code == RAW:
        return "bytes"
    dtype = dtype_from_code(code)
    return f"dtype#{code}" if dtype is None else dtype_name(dtype)


def describe_op(opcode: int) -> str:
    """A frame's ``opcode`` as the collective's name, for error messages."""
    return COLLECTIVE_OPS[opcode - 1] if 1 <= opcode <= len(COLLECTIVE_OPS) else f"op#{opcode}"
