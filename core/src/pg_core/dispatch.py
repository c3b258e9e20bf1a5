"""Device dispatch: which backend serves which device type, created when first used,
and the local validation every operation passes before any byte is sent.

A :class:`Dispatcher` belongs to one :class:`~pg_core.group.ProcessGroup`. It
resolves the user's ``backends=`` at construction (so a wrong name fails there),
creates each backend instance on first use of its device type, and checks every
call against the backend's declared :class:`~pg_core.backend.Capabilities`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .backend import Backend, BackendContext, BackendSpec, Capabilities
from .errors import BackendNotFoundError, CollectiveMismatchError, GroupClosedError, NotSupportedError
from .ops import ReduceOp
from .store import PrefixStore, Store, wait_for

if TYPE_CHECKING:
    from .registry import Registry

__all__ = ["BackendsArg", "Dispatcher", "parse_backends"]

BackendValue = str | BackendSpec | type[Backend] | Callable[[BackendContext], Backend]
BackendsArg = None | str | BackendValue | Mapping[str, BackendValue]

_MAX_TAG = 2**62


def parse_backends(backends: BackendsArg) -> dict[str, BackendValue] | str | BackendValue | None:
    """Normalise the string form ``"cpu:gloo, cuda:nccl"`` to a dict; other forms pass through.

    A string without ``:`` is a single backend name (every device it declares).
    """
    if isinstance(backends, str):
        text = backends.strip()
        if not text:
            raise ValueError("backends='' names no backend; pass None to pick the defaults")
        if ":" not in text:
            return text
        mapping: dict[str, BackendValue] = {}
        for item in text.split(","):
            if not item.strip():
                continue
            device, sep, name = (part.strip() for part in item.partition(":"))
            if not sep or not device or not name:
                raise ValueError(f"cannot parse {item.strip()!r} in backends={backends!r}: expected 'device:backend'")
            if device in mapping:
                raise ValueError(f"device {device!r} appears twice in backends={backends!r}")
            mapping[device] = name
        return mapping
    if isinstance(backends, Mapping):
        for device in backends:
            if not isinstance(device, str):
                raise TypeError(f"backends keys are device types such as 'cpu', got {device!r}")
        return dict(backends)
    return backends


def _adhoc_spec(value: Any, devices: Sequence[str]) -> BackendSpec:
    """A spec for a Backend subclass or factory given directly (tests, notebooks)."""
    name = getattr(value, "name", None) or getattr(value, "__name__", None) or type(value).__name__
    caps = getattr(value, "capabilities", None)
    if not isinstance(caps, Capabilities):
        caps = Capabilities()
    return BackendSpec(name=str(name).replace(" ", "_"), factory=value, devices=tuple(devices), capabilities=caps)


@dataclass
class _Slot:
    spec: BackendSpec
    device_type: str
    backend: Backend | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


class Dispatcher:
    """Backends of one group by device type; see the module docstring."""

    def __init__(
        self,
        backends: BackendsArg,
        *,
        registry: Registry | None,
        store: Store,
        rank: int,
        size: int,
        timeout: float,
        group_name: str,
        group_uid: str,
        options: Mapping[str, Mapping[str, Any]],
    ) -> None:
        self._store = store
        self._rank, self._size, self._timeout = rank, size, timeout
        self._group_name, self._group_uid = group_name, group_uid
        self._options = options
        self._slots: dict[str, _Slot] = {}
        self._allowed: set[tuple[object, ...]] = set()
        self._closed = False
        parsed = parse_backends(backends)
        if registry is None and (parsed is None or isinstance(parsed, (str, dict))):
            from .registry import default_registry

            registry = default_registry()
        if parsed is None:
            assert registry is not None
            self._resolve_defaults(registry)
        elif isinstance(parsed, dict):
            if not parsed:
                raise ValueError("backends={} names no backend; pass None to pick the defaults")
            for device, value in parsed.items():
                self._slots[device] = _Slot(self._resolve(registry, value, device), device)
        elif isinstance(parsed, str):
            assert registry is not None
            spec = registry.require(parsed)
            for device in spec.devices:
                self._slots[device] = _Slot(registry.require(parsed, device), device)
        else:
            devices = getattr(parsed, "devices", None) or ("cpu",)
            spec = parsed if isinstance(parsed, BackendSpec) else _adhoc_spec(parsed, devices)
            for device in spec.devices:
                self._slots[device] = _Slot(spec, device)

    def _resolve_defaults(self, registry: Registry) -> None:
        devices: list[str] = []
        for entry in registry.entries():
            for device in entry.devices:
                if device not in devices:
                    devices.append(device)
        for device in devices:
            candidates = registry.available_for(device)
            if candidates:
                self._slots[device] = _Slot(candidates[0], device)
        if "cpu" not in self._slots:
            registry.default_for("cpu")  # raises the error that says what to install
        if not self._slots:
            raise BackendNotFoundError("no backend is available")

    @staticmethod
    def _resolve(registry: Registry | None, value: BackendValue, device: str) -> BackendSpec:
        if isinstance(value, str):
            assert registry is not None
            return registry.require(value, device)
        if isinstance(value, BackendSpec):
            value.capabilities_for(device)  # raises if the spec does not declare it
            return value
        if callable(value):
            return _adhoc_spec(value, (device,))
        raise TypeError(f"backend for {device!r} must be a name, a BackendSpec or a Backend factory, got {value!r}")

    # -- queries ----------------------------------------------------------------
    @property
    def names(self) -> dict[str, str]:
        return {device: slot.spec.name for device, slot in self._slots.items()}

    def spec(self, device_type: str) -> BackendSpec:
        try:
            return self._slots[device_type].spec
        except KeyError:
            configured = ", ".join(f"{d}:{s.spec.name}" for d, s in self._slots.items())
            raise NotSupportedError(
                f"group {self._group_name!r} has no backend for device type {device_type!r} "
                f"(configured: {configured}); pass backends={{'{device_type}': NAME}} when creating the group"
            ) from None

    def capabilities(self, device_type: str) -> Capabilities:
        return self.spec(device_type).capabilities_for(device_type)

    def check(self, op: str, device_type: str, dtype: torch.dtype | None, reduce_op: ReduceOp | None = None) -> None:
        """Raise :class:`NotSupportedError` unless the backend declared this combination."""
        key = (op, device_type, dtype, None if reduce_op is None else reduce_op.type)
        if key in self._allowed:  # capabilities are immutable: remember what passed
            return
        spec = self.spec(device_type)
        reason = spec.capabilities_for(device_type).why_not(op, dtype, reduce_op)
        if reason is not None:
            raise NotSupportedError(f"backend {spec.name!r} on {device_type}: {reason}")
        self._allowed.add(key)

    def config(self) -> dict[str, BackendSpec]:
        """Device type -> the resolved spec: what a subgroup inherits."""
        return {device: slot.spec for device, slot in self._slots.items()}

    def device(self, device_type: str) -> torch.device:
        """Where tensors of ``device_type`` live for this group: its backend's device once
        created, else the type's current device."""
        slot = self._slots.get(device_type)
        if slot is not None and slot.backend is not None:
            return slot.backend.ctx.device
        return torch.device(device_type)

    def created(self) -> list[Backend]:
        return [slot.backend for slot in self._slots.values() if slot.backend is not None]

    def close(self) -> list[Backend]:
        """Refuse further creation; return the backends created so far (the caller closes them).

        A creation racing with this sees the flag under its slot lock and aborts
        what it just built, so no backend escapes being closed.
        """
        self._closed = True
        backends = []
        for slot in self._slots.values():
            with slot.lock:
                if slot.backend is not None:
                    backends.append(slot.backend)
        return backends

    # -- creation -------------------------------------------------------------
    def backend(self, device: torch.device) -> Backend:
        """The backend for ``device``'s type, created on first use."""
        slot = self._slots.get(device.type)
        if slot is None:
            self.spec(device.type)  # raises the explanatory error
            raise AssertionError("unreachable")
        if slot.backend is not None:
            return slot.backend
        with slot.lock:
            if self._closed:
                raise GroupClosedError(f"group {self._group_name!r} is closed")
            if slot.backend is None:
                backend = self._create(slot, device)
                if self._closed:  # closed while we were connecting: nobody else will close it
                    backend.abort()
                    backend._stop_helpers()
                    raise GroupClosedError(f"group {self._group_name!r} was closed while its backend was created")
                slot.backend = backend
            return slot.backend

    def _create(self, slot: _Slot, device: torch.device) -> Backend:
        spec = slot.spec
        store = PrefixStore(f"{slot.device_type}/{spec.name}", self._store)
        self._check_same_backend(slot)
        ctx = BackendContext(
            store=store,
            rank=self._rank,
            size=self._size,
            device=device,
            timeout=self._timeout,
            group_name=self._group_name,
            group_uid=self._group_uid,
            backend_name=spec.name,
            options=dict(self._options.get(spec.name, {})),
        )
        backend = spec.load_factory()(ctx)
        if not isinstance(backend, Backend):
            raise TypeError(f"backend {spec.name!r} factory returned {type(backend).__name__}, not a pg_core Backend")
        return backend

    def _check_same_backend(self, slot: _Slot) -> None:
        """Every rank must use the same backend for a device (``backends=None`` picks per host)."""
        key = f"choice/{slot.device_type}"
        mine = slot.spec.name
        if self._rank == 0:
            self._store.set(key, mine)
            return
        wait_for(self._store, [key], self._timeout)  # polled: other threads may share the store client
        theirs = self._store.get(key).decode()
        if theirs != mine:
            raise CollectiveMismatchError(
                f"group {self._group_name!r}: rank 0 uses backend {theirs!r} for {slot.device_type} but rank "
                f"{self._rank} chose {mine!r}; install the same backends everywhere or name one with backends=",
                peers=[0],
            )


# -- local validation -------------------------------------------------------------


def dense(t: torch.Tensor) -> bool:
    """Laid out exactly as ``torch.empty(t.shape)`` would be, with no lazy conjugation or
    negation. Stricter than ``is_contiguous()``, which ignores the strides of size-1
    dimensions: a backend may ``view`` the tensor as bytes, and that needs the canonical
    strides and the values as they are in memory."""
    if not t.is_contiguous() or t.is_conj() or t.is_neg():
        return False
    expected = 1
    for size, stride in zip(reversed(t.shape), reversed(t.stride()), strict=True):
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


def _one_of(tensors: Sequence[torch.Tensor], attr: str, op: str, what: str) -> Any:
    first = getattr(tensors[0], attr)
    for t in tensors[1:]:
        if getattr(t, attr) != first:
            raise ValueError(f"{op}: all tensors of one call must have one {what}, got {first} and {getattr(t, attr)}")
    return first


def one_device(tensors: Sequence[torch.Tensor], op: str) -> torch.device:
    """The single device of a call's tensors (``ValueError`` if they differ)."""
    device: torch.device = _one_of(tensors, "device", op, "device")
    return device


def same_dtype(tensors: Sequence[torch.Tensor], op: str) -> torch.dtype:
    """The single dtype of a call's tensors (``ValueError`` if they differ)."""
    dtype: torch.dtype = _one_of(tensors, "dtype", op, "dtype")
    return dtype


def check_rank(value: object, size: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int group rank, got {value!r}")
    if not 0 <= value < size:
        raise ValueError(f"{what}={value} is out of range for a group of size {size} (valid: 0..{size - 1})")
    return value


def check_tag(tag: object) -> int:
    if isinstance(tag, bool) or not isinstance(tag, int):
        raise TypeError(f"tag must be an int, got {tag!r}")
    if not 0 <= tag < _MAX_TAG:
        raise ValueError(f"tag must be in [0, 2**62), got {tag}; negative tags are reserved for the core")
    return tag
