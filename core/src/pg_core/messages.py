"""Messages: objects, tensors of unknown shape and tensor dicts, written once for every backend.

A *message* is what ``send_object``, ``send_tensor``, ``send_tensor_dict`` and the
object collectives move: a value the receiver knows nothing about in advance.
This module turns a value into one message and back, and moves messages over a
backend, whatever the backend can carry:

* **Encoding.** A message is a 32-byte head, a table describing every tensor
  (dtype, shape, device, where its bytes are), a body, and the tensors' bytes::

      head | table | body | pad | tensor 0 bytes | pad | tensor 1 bytes | ... | buffers

  For a single tensor (``send_tensor``) the body is empty: the table says it all,
  packed with :mod:`struct`, no pickle. For an object or a tensor dict the body is
  a pickle stream, protocol 5, in which every tensor is a *persistent id* (an
  index into the table) and every protocol-5 buffer (a NumPy array, a
  ``PickleBuffer``) is out of band. So no tensor byte is ever copied into the
  pickle stream: on the sending side the message's parts point into the tensors'
  own memory (scatter-gather), and on the receiving side every CPU tensor is a
  view into the one buffer the message arrived in. Each tensor's bytes start at
  a 64-byte offset, so the views are aligned for vectorised kernels.

* **Where tensors travel.** A CPU tensor rides *inline*, in the message. A tensor
  on another device type for which the group has a backend (``cuda`` with NCCL)
  is *separate*: the table describes it, and after the message it is sent by its
  own device's backend with a plain ``send`` of known shape, straight into a
  buffer the receiver allocated from the table. A tensor on a device the group
  has no backend for is copied to the CPU, rides inline, and is restored to its
  device type on arrival (as ``pickle`` would do).

* **Moving bytes.** A message goes to the backend of the group's message device
  (its ``cpu`` backend, else the first one configured). Where that backend
  carries variable-size messages (``send_bytes``/``recv_bytes``, as pg-tcp does),
  a message is exactly one backend message, its parts handed over as a list
  (scatter-gather, no concatenation). Otherwise it is emulated on ``send``/``recv``
  of ``uint8`` tensors the eager way MPI libraries send small messages: a first
  chunk of fixed size (:data:`EAGER_BYTES`) carries the length and the start of
  the message, and only a message that does not fit sends the rest as a second
  tensor whose size the first chunk announced. Never the three steps (size,
  metadata, data) that ``torch.distributed`` users write by hand.

Messages travel on tags of their own (:mod:`pg_core.tags`), so object and tensor
messages never mix with a user's ``send``/``recv`` traffic on the same tag.
"""

from __future__ import annotations

import builtins
import collections
import io
import mmap
import pickle
import struct
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import torch

from .algorithms import binomial_tree
from .backend import tensor_bytes
from .dtypes import dtype_code, dtype_from_code
from .errors import CollectiveMismatchError, ForbiddenObjectError
from .instance import Instance
from .timeouts import Deadline
from .validation import Staging

__all__ = [
    "EAGER_BYTES",
    "KIND_NAMES",
    "OBJECT",
    "OBJECTS_ENV",
    "PICKLE",
    "TENSOR",
    "TENSOR_DICT",
    "Buffer",
    "Encoded",
    "Endpoint",
    "Incoming",
    "Loader",
    "ObjectsArg",
    "Outgoing",
    "Progress",
    "Received",
    "check_collective",
    "encode",
    "loader",
    "parse",
    "parse_tensor",
    "tree_broadcast",
]

#: A part of a message, as backends receive them in ``send_bytes``.
Buffer = bytes | bytearray | memoryview | mmap.mmap
#: A received message: writable, owned by the receiver (``recv_bytes`` may hand over an mmap).
Received = bytearray | mmap.mmap

# -- the wire format --------------------------------------------------------------------------

MAGIC: Final = b"PGm\x01"
#: magic, kind, op, flags, seq (the collective's sequence number; 0 for point to point),
#: tensors in the table, out-of-band buffers, table bytes, body bytes
_HEAD: Final = struct.Struct("<4sBBHQHHII")
_SPEC: Final = struct.Struct("<BBBB")  # dtype code, ndim, flags, length of the device string
_DIM: Final = struct.Struct("<q")
_BUFLEN: Final = struct.Struct("<Q")
_ALIGN: Final = 64
_ZEROS: Final = bytes(_ALIGN)

OBJECT: Final = 1
TENSOR: Final = 2
TENSOR_DICT: Final = 3
KIND_NAMES: Final = {OBJECT: "an object", TENSOR: "a tensor", TENSOR_DICT: "a tensor dict"}

_SEPARATE: Final = 1  # sent after the message by the tensor's own device backend
_REQUIRES_GRAD: Final = 2
_PARAMETER: Final = 4

#: The first chunk of an emulated message (a backend without ``send_bytes``): the length
#: and the start of the message. Messages up to ``EAGER_BYTES - 8`` bytes take one send.
EAGER_BYTES: Final = 1024
_LENGTH: Final = struct.Struct("<Q")


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` detached, lazy conjugation/negation applied, laid out densely: what its
    bytes must look like on the wire (the tensor a backend would be handed)."""
    return Staging("send").stage(tensor)


# -- sending side ---------------------------------------------------------------------------


@dataclass
class _TensorEntry:
    tensor: torch.Tensor  # what goes on the wire (cpu for inline entries)
    flags: int
    device: str  # where it came from / lands: "cpu", "cuda", ...


class _Pickler(pickle.Pickler):
    """Protocol 5 with every tensor as a persistent id and buffers out of band."""

    def __init__(self, file: io.BytesIO, out: Outgoing) -> None:
        super().__init__(file, protocol=5, buffer_callback=out._buffer)
        self._out = out

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._out._tensor_id(obj)
        return None


@dataclass
class Outgoing:
    """One encoded message: its parts (a head packed at send time, then zero-copy
    views of the tensors) and the tensors that travel separately after it."""

    kind: int
    separate_devices: frozenset[str]
    entries: list[_TensorEntry] = field(default_factory=list)
    buffers: list[memoryview] = field(default_factory=list)
    body: bytes = b""
    _ids: dict[int, int] = field(default_factory=dict)

    # pickling hooks
    def _tensor_id(self, obj: torch.Tensor) -> int | None:
        if type(obj) not in (torch.Tensor, torch.nn.Parameter):
            return None  # subclasses pickle themselves, in band
        if obj.layout != torch.strided or obj.is_quantized or obj.is_nested or obj.device.type == "meta":
            return None
        if dtype_code(obj.dtype) is None:
            return None
        known = self._ids.get(id(obj))
        if known is not None:
            return known
        index = self.add_tensor(obj)
        self._ids[id(obj)] = index
        return index

    def _buffer(self, buf: pickle.PickleBuffer) -> bool:
        try:
            view = buf.raw()
        except BufferError:  # not contiguous: let pickle copy it in band
            return True
        self.buffers.append(view)
        return False

    def add_tensor(self, tensor: torch.Tensor) -> int:
        """Describe ``tensor`` in the table; returns its index."""
        if dtype_code(tensor.dtype) is None:
            raise TypeError(f"tensors of dtype {tensor.dtype} cannot be sent as a message")
        if tensor.dim() > 255:
            raise ValueError(f"a tensor with {tensor.dim()} dimensions cannot be sent as a message (at most 255)")
        flags = (_REQUIRES_GRAD if tensor.requires_grad else 0) | (
            _PARAMETER if isinstance(tensor, torch.nn.Parameter) else 0
        )
        device = tensor.device.type
        t = _plain(tensor)
        if device in self.separate_devices:
            flags |= _SEPARATE
        elif device != "cpu":
            t = t.cpu()  # no backend for it: ride inline, restored to its device type on arrival
        self.entries.append(_TensorEntry(t, flags, device))
        return len(self.entries) - 1

    @property
    def separate(self) -> list[torch.Tensor]:
        return [e.tensor for e in self.entries if e.flags & _SEPARATE]

    def parts(self, *, op: int = 0, seq: int = 0) -> list[Buffer]:
        """The message as a list of buffers, head first; tensor parts are views of the tensors."""
        table = bytearray()
        for e in self.entries:
            dev = e.device.encode()
            table += _SPEC.pack(dtype_code(e.tensor.dtype), e.tensor.dim(), e.flags, len(dev))
            table += dev
            for size in e.tensor.shape:
                table += _DIM.pack(size)
        for b in self.buffers:
            table += _BUFLEN.pack(b.nbytes)
        head = _HEAD.pack(
            MAGIC, self.kind, op, 0, seq, len(self.entries), len(self.buffers), len(table), len(self.body)
        )
        parts: list[Buffer] = [head, table, self.body]
        offset = len(head) + len(table) + len(self.body)
        for view in self._payloads():
            if not view.nbytes:
                continue
            pad = _aligned(offset) - offset
            if pad:
                parts.append(_ZEROS[:pad])
            parts.append(view)
            offset += pad + view.nbytes
        return parts

    def _payloads(self) -> Iterator[memoryview]:
        for e in self.entries:
            if not e.flags & _SEPARATE:
                yield tensor_bytes(e.tensor)
        yield from self.buffers


class Encoded(Protocol):
    """What :func:`encode` returns: the message's parts, and the tensors sent after it."""

    @property
    def separate(self) -> list[torch.Tensor]: ...

    def parts(self, *, op: int = 0, seq: int = 0) -> list[Buffer]: ...


class _CpuTensor:
    """The fast path of :func:`encode` for the common case of ``send_tensor``: one dense
    CPU tensor without autograd flags. The same bytes as the general path, packed with
    one precompiled ``struct`` per number of dimensions."""

    __slots__ = ("_code", "_tensor")
    separate: list[torch.Tensor] = []

    def __init__(self, tensor: torch.Tensor, code: int) -> None:
        self._tensor = tensor
        self._code = code

    def parts(self, *, op: int = 0, seq: int = 0) -> list[Buffer]:
        t = self._tensor
        ndim = t.dim()
        head, table = _CPU_TENSOR_HEADS[ndim] if ndim < len(_CPU_TENSOR_HEADS) else _cpu_tensor_head(ndim)
        data = head.pack(MAGIC, TENSOR, op, 0, seq, 1, 0, table, 0, self._code, ndim, 0, 3, b"cpu", *t.shape)
        return [data, tensor_bytes(t)] if t.numel() else [data]


def _cpu_tensor_head(ndim: int) -> tuple[struct.Struct, int]:
    """The head, the table of one cpu tensor of ``ndim`` dimensions and the padding to the
    payload, as one struct; and the table's length."""
    table = _SPEC.size + 3 + 8 * ndim
    pad = _aligned(_HEAD.size + table) - _HEAD.size - table
    return struct.Struct(f"<4sBBHQHHII4B3s{ndim}q{pad}x"), table


_CPU_TENSOR_HEADS: Final = tuple(_cpu_tensor_head(n) for n in range(9))


def encode(kind: int, value: Any, *, separate_devices: frozenset[str] = frozenset()) -> Encoded:
    """Encode ``value`` (a tensor for :data:`TENSOR`, anything picklable otherwise).

    Raises what pickling raises (``TypeError``, ``pickle.PicklingError``, ...)
    before anything is sent.
    """
    if kind == TENSOR:
        code = dtype_code(value.dtype)
        if (
            code is not None
            and type(value) is torch.Tensor
            and value.device.type == "cpu"
            and "cpu" not in separate_devices
            and not value.requires_grad
            and value.is_contiguous()  # contiguous memory is all _raw needs (any strides of size-1 dims)
            and not value.is_conj()
            and not value.is_neg()
        ):
            return _CpuTensor(value, code)
    out = Outgoing(kind, separate_devices)
    if kind == TENSOR:
        out.add_tensor(value)
        return out
    f = io.BytesIO()
    _Pickler(f, out).dump(value)
    out.body = f.getvalue()
    return out


# -- receiving side ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    dtype: torch.dtype
    shape: tuple[int, ...]
    flags: int
    device: str
    offset: int  # of its bytes in the message (inline tensors)

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n

    @property
    def separate(self) -> bool:
        return bool(self.flags & _SEPARATE)


@dataclass
class Incoming:
    """A received message, parsed: its head fields, its tensor table and its buffers."""

    kind: int
    op: int
    seq: int
    specs: list[TensorSpec]
    data: Received
    body: memoryview
    buffers: list[memoryview]

    def separate_specs(self) -> list[tuple[int, TensorSpec]]:
        return [(i, s) for i, s in enumerate(self.specs) if s.separate]

    def value(
        self, separate: dict[int, torch.Tensor], device: torch.device | None, loader: Loader | None = None
    ) -> Any:
        """Decode: every inline CPU tensor is a view into the message (no copy); the rest as
        ``loader`` allows (default: pickle)."""
        tensors = [self._tensor(i, spec, separate, device) for i, spec in enumerate(self.specs)]
        if self.kind == TENSOR:
            return tensors[0]
        unpickler = _Unpickler(io.BytesIO(self.body), tensors, self.buffers, loader or PICKLE)
        return unpickler.load()

    def _tensor(
        self, index: int, spec: TensorSpec, separate: dict[int, torch.Tensor], device: torch.device | None
    ) -> torch.Tensor:
        if spec.separate:
            t = separate[index]
        elif spec.nbytes == 0:
            t = torch.empty(spec.shape, dtype=spec.dtype)
        else:
            raw = torch.frombuffer(self.data, dtype=torch.uint8, count=spec.nbytes, offset=spec.offset)
            t = raw.view(spec.dtype).view(spec.shape)
        target = device if device is not None else (None if spec.separate else torch.device(spec.device))
        if target is not None and t.device != target:
            t = t.to(target)
        if spec.flags & _PARAMETER:
            return torch.nn.Parameter(t, requires_grad=bool(spec.flags & _REQUIRES_GRAD))
        if spec.flags & _REQUIRES_GRAD:
            t.requires_grad_(True)
        return t


class _Unpickler(pickle.Unpickler):
    def __init__(
        self, file: io.BytesIO, tensors: list[torch.Tensor], buffers: list[memoryview], loader: Loader
    ) -> None:
        super().__init__(file, buffers=buffers)
        self._tensors = tensors
        self._loader = loader

    def persistent_load(self, pid: Any) -> Any:
        if not isinstance(pid, int) or not 0 <= pid < len(self._tensors):
            raise pickle.UnpicklingError(f"message refers to tensor {pid!r}, which its table does not have")
        return self._tensors[pid]

    def find_class(self, module: str, name: str) -> Any:
        if self._loader.mode == "pickle":
            return super().find_class(module, name)
        return self._loader.find(module, name)


# -- how objects are loaded --------------------------------------------------------------

OBJECTS_ENV: Final = "PG_CORE_OBJECTS"

#: What ``restricted`` loading finds by name besides the classes a group allows: plain
#: containers and scalars (most of which pickle without naming any class at all).
_SAFE_BUILTINS: Final = frozenset(
    {"bool", "bytearray", "bytes", "complex", "dict", "float", "frozenset", "int", "list", "range", "set"}
    | {"slice", "str", "tuple"}
)
_SAFE_TORCH: Final = (torch.Size, torch.device, torch.dtype, torch.layout, torch.memory_format)


@dataclass(frozen=True)
class Loader:
    """How a group loads the objects it receives. ``mode="pickle"``: as :mod:`pickle` does
    (a sender can make the receiver run any code: trusted peers only). ``mode="restricted"``:
    a global the stream names is found only if it is a plain builtin container or scalar,
    ``collections.OrderedDict``, a torch ``dtype``, ``device``, ``Size``, ``layout`` or
    ``memory_format``, or one of ``allowed`` (the group's ``objects=[...]``); anything else
    raises :class:`~pg_core.errors.ForbiddenObjectError` naming it, before it is called.
    Tensors travel beside the stream in either mode and are never unpickled."""

    mode: str = "pickle"
    allowed: frozenset[type] = frozenset()

    def find(self, module: str, name: str) -> Any:
        if module == "builtins" and name in _SAFE_BUILTINS:
            return getattr(builtins, name)
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if module == "torch" and "." not in name:
            found = getattr(torch, name, None)
            if isinstance(found, _SAFE_TORCH) or any(found is cls for cls in _SAFE_TORCH):
                return found
        for cls in self.allowed:
            if cls.__module__ == module and cls.__qualname__ == name:
                return cls
        raise ForbiddenObjectError(
            f"a received object names {module}.{name}, which this group's restricted object loading does not "
            "allow (nothing was called); if the sender is trusted to send it, allow the class: "
            f"objects=[{name.rpartition('.')[2]}, ...] when forming the group",
            name=f"{module}.{name}",
        )


PICKLE: Final = Loader()

#: ``objects=`` of a group: ``"pickle"``, ``"restricted"``, classes to allow besides the
#: restricted set, a :class:`Loader`, or ``None`` (``PG_CORE_OBJECTS``, else ``"pickle"``).
ObjectsArg = str | Iterable[type] | Loader | None


def loader(objects: ObjectsArg | Loader, env: Mapping[str, str]) -> Loader:
    """The :class:`Loader` of ``objects=`` (``None``: ``PG_CORE_OBJECTS`` of ``env``)."""
    if isinstance(objects, Loader):
        return objects
    if objects is None:
        objects = env.get(OBJECTS_ENV, "").strip().lower() or "pickle"
        if objects not in ("pickle", "restricted"):
            raise ValueError(f"{OBJECTS_ENV}={objects!r}: use pickle or restricted")
    if isinstance(objects, str):
        if objects == "pickle":
            return PICKLE
        if objects == "restricted":
            return Loader("restricted")
        raise ValueError(f"objects={objects!r}: use 'pickle', 'restricted', or a list of classes to allow")
    classes = tuple(objects)
    wrong = [c for c in classes if not isinstance(c, type)]
    if wrong:
        raise TypeError(f"objects=: {wrong[0]!r} is not a class; pass the classes received objects may be")
    return Loader("restricted", frozenset(classes))


_ONE_CPU_HEAD: Final = struct.Struct("<4sBBHQHHII4B3s")  # the head, then the spec of one cpu tensor
_ONE_CPU_SPEC_SIZE: Final = _ONE_CPU_HEAD.size - _HEAD.size
_SHAPES: Final = tuple(f"<{n}q" for n in range(9))


def parse_tensor(data: Received) -> torch.Tensor | None:
    """The fast path of :func:`parse` and :meth:`Incoming.value` for what
    :class:`_CpuTensor` sends (``None`` for anything else): one ``frombuffer``."""
    if len(data) < _ONE_CPU_HEAD.size:
        return None
    magic, kind, _, _, _, ntensors, nbuffers, table_len, body_len, code, ndim, flags, devlen, dev = (
        _ONE_CPU_HEAD.unpack_from(data)
    )
    if magic != MAGIC or kind != TENSOR or ntensors != 1 or nbuffers or body_len:
        return None
    dtype = dtype_from_code(code)
    if flags or devlen != 3 or dev != b"cpu" or dtype is None or table_len != _ONE_CPU_SPEC_SIZE + 8 * ndim:
        return None
    shape = struct.unpack_from(_SHAPES[ndim], data, _ONE_CPU_HEAD.size) if ndim < len(_SHAPES) else None
    if shape is None:
        shape = struct.unpack_from(f"<{ndim}q", data, _ONE_CPU_HEAD.size)
    numel = 1
    for size in shape:
        numel *= size
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    offset = _aligned(_HEAD.size + table_len)
    if offset + numel * dtype.itemsize != len(data):
        return None
    return torch.frombuffer(data, dtype=dtype, count=numel, offset=offset).view(shape)


def parse(data: Received, *, src: int) -> Incoming:
    """Parse a received message (``ValueError`` if it is not one)."""
    view = memoryview(data)
    if len(data) < _HEAD.size or bytes(view[:4]) != MAGIC:
        raise ValueError(f"rank {src} sent {len(data)} bytes that are not a pg-core message (a foreign sender?)")
    _, kind, op, _, seq, ntensors, nbuffers, table_len, body_len = _HEAD.unpack_from(data)
    pos = _HEAD.size
    end_table = pos + table_len
    shapes: list[tuple[torch.dtype, tuple[int, ...], int, str]] = []
    for _ in range(ntensors):
        code, ndim, flags, devlen = _SPEC.unpack_from(data, pos)
        pos += _SPEC.size
        device = bytes(view[pos : pos + devlen]).decode()
        pos += devlen
        shape = struct.unpack_from(f"<{ndim}q", data, pos)
        pos += 8 * ndim
        dtype = dtype_from_code(code)
        if dtype is None:
            raise ValueError(f"rank {src} sent a tensor of dtype code {code}, unknown to this torch")
        shapes.append((dtype, shape, flags, device))
    buflens = []
    for _ in range(nbuffers):
        buflens.append(_BUFLEN.unpack_from(data, pos)[0])
        pos += _BUFLEN.size
    if pos != end_table:
        raise ValueError(f"rank {src} sent a message whose table is malformed")
    body = view[pos : pos + body_len]
    offset = pos + body_len
    specs = []
    for dtype, shape, flags, device in shapes:
        spec = TensorSpec(dtype, shape, flags, device, 0)
        if not flags & _SEPARATE and spec.nbytes:
            offset = _aligned(offset)
            spec = TensorSpec(dtype, shape, flags, device, offset)
            offset += spec.nbytes
        specs.append(spec)
    buffers = []
    for n in buflens:
        if n:
            offset = _aligned(offset)
        buffers.append(view[offset : offset + n])
        offset += n
    if offset > len(data):
        raise ValueError(f"rank {src} sent a truncated message ({len(data)} bytes, its table needs {offset})")
    return Incoming(kind, op, seq, specs, data, body, buffers)


# -- moving messages ----------------------------------------------------------------------------


class Progress(Protocol):
    """Whether a message's first transmission happened (see :meth:`Endpoint.stream`)."""

    started: bool


class Endpoint:
    """How messages travel over one backend instance: one ``send_bytes`` each where the
    backend has it, the eager emulation on ``send``/``recv`` otherwise (a message's parts
    joined where its ``send_bytes`` predates lists, contract 1.0)."""

    def __init__(self, instance: Instance) -> None:
        self.instance = instance
        self.backend = instance.backend
        self.device = instance.device
        self.native = instance.native_bytes
        self.scatter_gather = instance.scatter_gather
        #: a send above this many bytes may wait for its receiver (None: none does; API 1.10)
        self.eager_limit = instance.spec.capabilities_for(instance.device.type).eager_limit_bytes
        self._locks: dict[tuple[str, int, int], threading.Lock] = {}
        self._broken: dict[tuple[str, int, int], str] = {}
        self._guard = threading.Lock()
        self.checked: set[str] = set()  # directions whose capabilities the group checked

    def stream(self, direction: str, peer: int, tag: int, op: str) -> _Stream:
        """One point-to-point message on (direction, peer, tag), as a context manager that
        yields its :class:`Progress`: its transmissions do not interleave with another
        thread's on the same stream, and a message that fails after its first transmission
        (a timeout halfway) stops the stream, whose next bytes would otherwise be read as
        the start of a message."""
        key = (direction, peer, tag)
        lock = self._locks.get(key)
        if lock is None:
            with self._guard:
                lock = self._locks.setdefault(key, threading.Lock())
        return _Stream(self, key, lock, op)

    def may_wait(self, nbytes: int) -> bool:
        """Whether sending a message of ``nbytes`` may wait for its receiver to post the
        receive: one of its backend sends (one ``send_bytes``, or the emulation's first chunk
        and rest) is above the backend's declared eager limit."""
        limit = self.eager_limit
        if limit is None:
            return False
        if self.native:
            return nbytes > limit
        cap = EAGER_BYTES - _LENGTH.size
        return limit < EAGER_BYTES or nbytes - cap > limit

    def send_one(self, parts: list[Buffer], peer: int, tag: int, seconds: float, op: str) -> None:
        """Send a message that is one ``send_bytes`` (a native endpoint, no separate tensors):
        atomic, so it needs no stream lock; only a stream stopped earlier refuses it."""
        if self._broken:
            self._refuse_broken(("send", peer, tag), op)
        self.backend.send_bytes(parts if self.scatter_gather else b"".join(parts), peer, tag, timeout=seconds)

    def recv_one(self, peer: int, tag: int, seconds: float, op: str) -> Received:
        """Receive a message that is one ``recv_bytes`` (the group sends no separate tensors)."""
        if self._broken:
            self._refuse_broken(("recv", peer, tag), op)
        return self._owned(self.backend.recv_bytes(peer, tag, timeout=seconds))

    def _owned(self, data: Received) -> Received:
        """What ``recv_bytes`` returned, held to the contract: a writable buffer the receiver
        owns (received tensors are views into it, and a user may write to them)."""
        if memoryview(data).readonly:
            raise TypeError(
                f"{type(self.backend).__name__}.recv_bytes returned a read-only {type(data).__name__}; the contract "
                "asks for a writable buffer that the receiver owns (a bytearray, or an mmap)"
            )
        return data

    def _refuse_broken(self, key: tuple[str, int, int], op: str) -> None:
        why = self._broken.get(key)
        if why is not None:
            direction, peer, _ = key
            way = "to" if direction == "send" else "from"
            raise CollectiveMismatchError(
                f"{op}: messages {way} rank {peer} on this tag stopped after one failed halfway ({why}); the "
                "two ranks are out of step there, so form the group again (other tags and peers still work)",
                peers=(peer,),
            )

    def send(
        self, parts: Sequence[Buffer], peer: int, tag: int, deadline: Deadline, progress: Progress | None = None
    ) -> None:
        if self.native:
            data: Any = list(parts) if self.scatter_gather else b"".join(parts)
            self.backend.send_bytes(data, peer, tag, timeout=deadline.left())
            if progress is not None:
                progress.started = True
            return
        joined = bytearray().join(parts)
        total = len(joined)
        cap = EAGER_BYTES - _LENGTH.size
        first = bytearray(EAGER_BYTES)
        _LENGTH.pack_into(first, 0, total)
        first[_LENGTH.size : _LENGTH.size + min(total, cap)] = memoryview(joined)[:cap]
        self.backend.send(self._tensor(first, 0), peer, tag, timeout=deadline.left())
        if progress is not None:
            progress.started = True
        if total > cap:
            self.backend.send(self._tensor(joined, cap), peer, tag, timeout=deadline.left())

    def recv(self, peer: int, tag: int, deadline: Deadline, progress: Progress | None = None) -> Received:
        if self.native:
            data = self._owned(self.backend.recv_bytes(peer, tag, timeout=deadline.left()))
            if progress is not None:
                progress.started = True
            return data
        first = torch.empty(EAGER_BYTES, dtype=torch.uint8, device=self.device)
        self.backend.recv(first, peer, tag, timeout=deadline.left())
        if progress is not None:
            progress.started = True
        head = _to_bytes(first)
        (total,) = _LENGTH.unpack_from(head)
        cap = EAGER_BYTES - _LENGTH.size
        data = bytearray(total)
        data[: min(total, cap)] = head[_LENGTH.size : _LENGTH.size + min(total, cap)]
        if total > cap:
            rest = total - cap
            if self.device.type == "cpu":
                self.backend.recv(
                    torch.frombuffer(data, dtype=torch.uint8, count=rest, offset=cap),
                    peer,
                    tag,
                    timeout=deadline.left(),
                )
            else:
                tail = torch.empty(rest, dtype=torch.uint8, device=self.device)
                self.backend.recv(tail, peer, tag, timeout=deadline.left())
                data[cap:] = _to_bytes(tail)
        return data

    def _tensor(self, data: bytearray, offset: int) -> torch.Tensor:
        """``data[offset:]`` as a uint8 tensor on the endpoint's device (a view on the cpu)."""
        t = torch.frombuffer(data, dtype=torch.uint8, offset=offset)
        return t if self.device.type == "cpu" else t.to(self.device)


class _Stream:
    """The context manager of :meth:`Endpoint.stream`; it is also the message's progress."""

    __slots__ = ("_endpoint", "_key", "_lock", "_op", "started")

    def __init__(self, endpoint: Endpoint, key: tuple[str, int, int], lock: threading.Lock, op: str) -> None:
        self._endpoint, self._key, self._lock, self._op = endpoint, key, lock, op
        self.started = False

    def __enter__(self) -> _Stream:
        self._lock.acquire()
        try:
            self._endpoint._refuse_broken(self._key, self._op)
        except BaseException:
            self._lock.release()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        try:
            if exc is not None and self.started:
                self._endpoint._broken[self._key] = f"{type(exc).__name__}: {exc}"
        finally:
            self._lock.release()


def _to_bytes(t: torch.Tensor) -> bytes:
    t = t.cpu()
    return bytes(tensor_bytes(t))


# -- collectives of messages ------------------------------------------------------------------


def tree_broadcast(
    root_parts: Sequence[Buffer] | None,
    *,
    rank: int,
    size: int,
    src: int,
    send: Callable[[Sequence[Buffer], int], None],
    recv: Callable[[int], Received],
) -> Sequence[Buffer]:
    """Binomial-tree broadcast of one message from ``src`` (the tree of
    :func:`pg_core.algorithms.binomial_tree`); returns what this rank has. A rank forwards
    the message exactly as it arrived (no re-encoding), so every rank ends with the same bytes.
    """
    parent, children = binomial_tree((rank - src) % size, size)
    parts = root_parts if parent is None else [recv((parent + src) % size)]
    assert parts is not None
    for child in reversed(children):  # largest subtree first
        send(parts, (child + src) % size)
    return parts


def check_collective(incoming: Incoming, *, op: int, seq: int, src: int, what: str, names: dict[int, str]) -> None:
    """A collective's message must be the collective this rank is in."""
    if (incoming.op, incoming.seq) != (op, seq):
        theirs = names.get(incoming.op, f"op#{incoming.op}")
        raise CollectiveMismatchError(
            f"{what} (collective #{seq}): rank {src} sent a message of {theirs} (collective #{incoming.seq}); every "
            "rank must call the same collectives in the same order",
            peers=(src,),
        )
