"""Validation: the local checks every operation passes before any byte is sent, and staging.

Everything here raises in the caller's thread (``TypeError``, ``ValueError``,
:class:`~pg_core.errors.NotSupportedError`) and talks to no peer. Staging gives a backend
the dense tensors the contract promises and copies results back into the user's layout.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from .backend import BackendSpec
from .errors import BackendUnavailableError, NotSupportedError
from .ops import ReduceOp

if TYPE_CHECKING:
    from .registry import Registry

__all__ = [
    "Staging",
    "Supported",
    "check_dict",
    "check_members",
    "check_peer",
    "check_rank",
    "check_tensor",
    "check_tensor_list",
    "dense",
    "device_arg",
    "same_numel",
    "split_sizes",
]


class Staging:
    """The tensors of one call, made ready for a backend: each checked, all on one device
    with one dtype (read back as :attr:`device` and :attr:`dtype`), and dense stand-ins for
    those that are not dense, with the copies back into the originals."""

    __slots__ = ("back", "device", "dtype", "op")

    def __init__(self, op: str) -> None:
        self.op = op
        #: (original, stand-in) of every staged output: non-empty means :meth:`finish` is due
        self.back: list[tuple[torch.Tensor, torch.Tensor]] = []
        #: the device and dtype of every tensor staged so far (``None`` before the first)
        self.device: torch.device | None = None
        self.dtype: torch.dtype | None = None

    def stage(self, t: torch.Tensor, what: str = "tensor", *, written: bool = False) -> torch.Tensor:
        """What a backend reads (``written=False``) or writes: ``t`` itself when dense
        (detached: communication is not differentiable, and a parameter is written in place),
        else a dense copy, which for a written tensor :meth:`finish` copies back.
        ``TypeError`` naming ``what`` if ``t`` is not a tensor; ``ValueError`` if its device
        or dtype differs from the tensors staged before it.

        Dense means laid out exactly as ``torch.empty(t.shape)`` would be, with no lazy
        negation or (complex) conjugation. That is stricter than ``is_contiguous()``, which
        ignores the strides of size-1 dimensions: a backend may ``view`` the tensor as bytes,
        and that needs the canonical strides and the values as they are in memory. (Torch
        sets the conjugate bit on complex tensors only.)"""
        if not isinstance(t, torch.Tensor):
            check_tensor(t, what)  # raises, naming what
        device, dtype = t.device, t.dtype
        if self.dtype is None:
            self.device, self.dtype = device, dtype
        elif device != self.device:
            raise ValueError(f"{self.op}: all tensors of one call must have one device, got {self.device} and {device}")
        elif dtype is not self.dtype:
            raise ValueError(f"{self.op}: all tensors of one call must have one dtype, got {self.dtype} and {dtype}")
        if t.requires_grad:
            t = t.detach()
        if dense(t):
            return t
        if t.layout is not torch.strided or t.is_nested:
            raise NotSupportedError(_not_strided(self.op, what, t))
        staged = t.clone(memory_format=torch.contiguous_format)  # (a clone applies lazy conjugation and negation)
        if written:
            self.back.append((t, staged))
        return staged

    def finish(self) -> None:
        with torch.no_grad():
            for original, staged in self.back:
                original.copy_(staged)


class Supported:
    """The capability check of one group: every (op, device type, dtype, reduce op) against the
    spec configured for that device type, and whether that backend can run here at all
    (``unavailable``: device type -> the reason it cannot, see :func:`pg_core.dispatch.unavailable`).
    Both are fixed for the group's life, so what passed once is remembered."""

    __slots__ = ("_allowed", "_group", "_specs", "_unavailable")

    def __init__(
        self, specs: Mapping[str, BackendSpec], group: str, unavailable: Mapping[str, str] | None = None
    ) -> None:
        self._specs = specs
        self._group = group
        self._unavailable = dict(unavailable or {})
        self._allowed: set[tuple[object, ...]] = set()

    def forget(self) -> None:
        """Drop what passed: the spec of a device type changed (the default fell back)."""
        self._allowed.clear()

    def spec(self, device_type: str) -> BackendSpec:
        try:
            return self._specs[device_type]
        except KeyError:
            configured = ", ".join(f"{d}:{s.name}" for d, s in self._specs.items())
            raise NotSupportedError(
                f"group {self._group!r} has no backend for device type {device_type!r} "
                f"(configured: {configured}); pass backends={{'{device_type}': NAME}} when creating the group"
            ) from None

    def target(self, device: torch.device | None) -> torch.device | None:
        """``device``, where received values are to go, unless the group's backend for its type
        cannot run here: then that backend's :class:`BackendUnavailableError`, before anything
        is received. A device type the group has no backend for is a plain destination."""
        if device is not None and device.type in self._unavailable:
            raise BackendUnavailableError(self._unavailable[device.type])
        return device

    def check_any_source(self, device: torch.device, size: int, registry: Registry | None) -> None:
        """A receive from any source on ``device`` in a group of ``size``: raise
        :class:`NotSupportedError` unless its backend declares ``recv_anysource`` (naming the
        backends of ``registry``, default the installed ones, that do), :class:`ValueError`
        where there is no other rank to receive from."""
        spec = self.spec(device.type)
        if not spec.capabilities_for(device.type).supports("recv_anysource"):
            from .registry import default_registry

            others = [
                s.name
                for s in (registry or default_registry()).available_for(device.type)
                if s.capabilities_for(device.type).supports("recv_anysource")
            ]
            raise NotSupportedError(
                f"recv with src=None (from any source): backend {spec.name!r} on {device.type} does not declare "
                "'recv_anysource'. Name the sender (src=RANK), or use a backend that declares it for "
                f"{device.type} (installed and available: {', '.join(others) or 'none'})"
            )
        if size == 1:
            raise ValueError(f"recv with src=None: group {self._group!r} has no rank but this one to receive from")

    def check(
        self, op: str, device: torch.device, dtype: torch.dtype | None, reduce_op: ReduceOp | None = None
    ) -> None:
        """Raise :class:`NotSupportedError` unless the backend declared this combination."""
        key = (op, device, dtype, None if reduce_op is None else reduce_op.type)
        if key in self._allowed:
            return
        device_type = device.type
        spec = self.spec(device_type)
        if device_type in self._unavailable:
            raise BackendUnavailableError(self._unavailable[device_type])
        reason = spec.capabilities_for(device_type).why_not(op, dtype, reduce_op)
        if reason is not None:
            raise NotSupportedError(f"backend {spec.name!r} on {device_type}: {reason}")
        self._allowed.add(key)


def _not_strided(op: str, what: str, t: torch.Tensor) -> str:
    """Why a tensor without strides (sparse, nested, mkldnn) cannot be communicated, and what to do."""
    if t.is_nested:
        return (
            f"{op}: {what} is a nested tensor; pg-core communicates dense strided tensors: send its components "
            "(t.unbind()), or a padded dense one (t.to_padded_tensor(0.0))"
        )
    kind = "sparse" if "sparse" in str(t.layout) else str(t.layout).removeprefix("torch.")
    return (
        f"{op}: {what} is a {kind} tensor (layout {t.layout}); pg-core communicates dense strided tensors: "
        "call t.to_dense() first, or send its parts (a sparse COO tensor's indices() and values())"
    )


def dense(t: torch.Tensor) -> bool:
    """Whether a backend may be handed ``t`` as it is (see :meth:`Staging.stage`): laid out
    exactly as ``torch.empty(t.shape)`` would be, with no lazy negation or conjugation."""
    if t.is_neg() or (t.dtype.is_complex and t.is_conj()):
        return False
    try:
        strides = t.stride()
    except RuntimeError:  # sparse, nested, mkldnn: no strides (Staging.stage says so)
        return False
    if strides == (1,) or not strides:  # the common case first: 1-D with unit stride, or 0-D
        return True
    expected = 1  # the strides torch.empty gives (canonical strides imply contiguous memory)
    for size, stride in zip(reversed(t.shape), reversed(strides)):  # noqa: B905 - equal lengths
        if stride != expected:
            return False
        expected *= size
    return True


def check_tensor(t: object, what: str = "tensor") -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    return t


def check_tensor_list(ts: object, what: str, length: int | None) -> list[torch.Tensor]:
    if not isinstance(ts, (list, tuple)):
        raise TypeError(f"{what} must be a list of tensors, got {type(ts).__name__}")
    if length is not None and len(ts) != length:
        raise ValueError(f"{what} must have one tensor per rank ({length}), got {len(ts)}")
    return [check_tensor(t, f"{what}[{i}]") for i, t in enumerate(ts)]


def same_numel(tensors: Sequence[torch.Tensor], numel: int, op: str, what: str) -> None:
    for i, t in enumerate(tensors):
        if t.numel() != numel:
            raise ValueError(f"{op}: {what}[{i}] has {t.numel()} elements, expected {numel}")


def check_rank(value: object, size: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int group rank, got {value!r}")
    if not 0 <= value < size:
        raise ValueError(f"{what}={value} is out of range for a group of size {size} (valid: 0..{size - 1})")
    return value


def check_peer(value: object, size: int, rank: int, what: str, op: str) -> int:
    """A point-to-point peer: a rank of the group other than this one."""
    peer = check_rank(value, size, what)
    if peer == rank:
        way = "send to" if what == "dst" else "receive from"
        raise ValueError(f"{op}: {what}={peer} is this rank; a rank cannot {way} itself")
    return peer


def split_sizes(sizes: Sequence[int] | None, rows: int, size: int, what: str) -> list[int]:
    """``all_to_all_single``'s split sizes for ``rows`` rows: given, or even (``ValueError`` if not even)."""
    if sizes is None or len(sizes) == 0:
        if rows % size:
            raise ValueError(
                f"all_to_all_single: {what} has {rows} rows, not divisible by the group size {size}; "
                f"pass {what}_split_sizes"
            )
        return [rows // size] * size
    out = list(sizes)
    if len(out) != size:
        raise ValueError(f"all_to_all_single: {what}_split_sizes has {len(out)} entries, expected {size}")
    for s in out:
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise ValueError(f"all_to_all_single: {what}_split_sizes must be non-negative ints, got {out}")
    if sum(out) != rows:
        raise ValueError(f"all_to_all_single: {what}_split_sizes sum to {sum(out)} but {what} has {rows} rows")
    return out


def check_members(ranks: object, size: int) -> list[int]:
    """``new_group``'s ``ranks``: distinct ranks of the parent, at least one."""
    if not isinstance(ranks, (list, tuple, range)):
        raise TypeError(f"new_group: ranks must be a list of group ranks, got {type(ranks).__name__}")
    members = [check_rank(r, size, "new_group rank") for r in ranks]
    if not members:
        raise ValueError("new_group: ranks is empty")
    if len(set(members)) != len(members):
        raise ValueError(f"new_group: ranks {members} lists a rank twice")
    return members


def check_dict(value: object, op: str) -> None:
    if not isinstance(value, Mapping):
        raise TypeError(f"{op}: expected a dict of tensors and values, got {type(value).__name__}")


def device_arg(device: str | torch.device | None) -> torch.device | None:
    if device is None:
        return None
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
    try:
        return torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"device={device!r} is not a device: {exc}") from None
