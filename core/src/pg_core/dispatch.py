"""Dispatch: which backend serves which device type, and the live backend instances of one group.

:func:`resolve_backends` turns the user's ``backends=`` into a spec per device type, talking
to nobody; a :class:`Dispatcher` owns one group's instances, each created on the first use
of its device type.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .backend import Backend, BackendContext, BackendSpec, Capabilities
from .errors import (
    BackendNotFoundError,
    BackendUnavailableError,
    CollectiveMismatchError,
    CollectiveTimeout,
    GroupClosedError,
)
from .instance import Instance
from .ops import ReduceOp
from .store import PrefixStore, Store, wait_for

if TYPE_CHECKING:
    from .auth import AuthKey
    from .registry import Registry

__all__ = [
    "BackendsArg",
    "Choice",
    "Dispatcher",
    "context_factory",
    "describe",
    "factory_spec",
    "fallbacks",
    "message_device",
    "parse_backends",
    "resolve_backends",
    "unavailable",
]

BackendValue = str | BackendSpec | type[Backend] | Callable[[BackendContext], Backend]
BackendsArg = None | str | BackendValue | Mapping[str, BackendValue]


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


def factory_spec(value: Any, devices: Sequence[str] | None = None) -> BackendSpec:
    """The spec of a :class:`~pg_core.backend.Backend` subclass or factory given as a backend
    (``backends=``, a command-line reference): named after it (its ``name`` attribute where
    that is a string, else its ``__name__``, spaces made ``_``), for ``devices`` (default: its
    ``devices`` attribute, else ``cpu``), declaring its ``capabilities`` attribute where that
    is a :class:`~pg_core.backend.Capabilities` (else the default ones)."""
    name = getattr(value, "name", None)
    if not isinstance(name, str) or not name:
        name = getattr(value, "__name__", None) or type(value).__name__
    if devices is None:
        devices = getattr(value, "devices", None) or ("cpu",)
    caps = getattr(value, "capabilities", None)
    if not isinstance(caps, Capabilities):
        caps = Capabilities()
    return BackendSpec(name=str(name).replace(" ", "_"), factory=value, devices=tuple(devices), capabilities=caps)


class Choice(dict[str, BackendSpec]):
    """What :func:`resolve_backends` returns: device type -> spec, as a dict, and for each
    device type left to the default (``backends=None``) the available backends after the
    chosen one, highest priority first (:attr:`fallbacks`): where the chosen one refuses the
    group's members alike (pg-shm for members on several hosts), its :class:`Dispatcher`
    builds the next. Subgroups inherit the whole choice, so each decides for its own members."""

    fallbacks: dict[str, tuple[BackendSpec, ...]]

    def __init__(
        self, specs: Mapping[str, BackendSpec], fallbacks: Mapping[str, Sequence[BackendSpec]] | None = None
    ) -> None:
        super().__init__(specs)
        self.fallbacks = {d: tuple(c) for d, c in (fallbacks or {}).items() if c}


def fallbacks(specs: Mapping[str, BackendSpec]) -> dict[str, tuple[BackendSpec, ...]]:
    """The :attr:`Choice.fallbacks` of ``specs`` (none for a plain mapping)."""
    return dict(specs.fallbacks) if isinstance(specs, Choice) else {}


def resolve_backends(backends: BackendsArg, registry: Registry | None = None) -> Choice:
    """The user's ``backends=`` as device type -> spec. Talks to nobody: a name that is not
    installed or a device the backend does not declare raises here, and so does an installed
    backend that cannot run here if it serves the group's messages (:func:`message_device`).
    Any other backend that cannot run here is kept: the group raises its
    :class:`~pg_core.errors.BackendUnavailableError` on the first use of its device type
    (:func:`unavailable`), so a script written for ``{"cuda": "nccl", "cpu": "gloo"}`` runs
    its cpu part on a machine without a GPU.

    ``None`` picks, per device type, the highest-priority available backend of
    ``registry`` (default: the installed plugins), the others following it in
    :attr:`Choice.fallbacks`; a name, every device it declares; a
    dict or ``"cpu:gloo,cuda:nccl"``, one per device; a ``BackendSpec``, a ``Backend``
    subclass or a factory, every device it declares (``cpu`` for a bare class).
    """
    parsed = parse_backends(backends)
    if registry is None:
        from .registry import default_registry

        registry = default_registry()
    specs: dict[str, BackendSpec] = {}
    after: dict[str, list[BackendSpec]] = {}
    if parsed is None:
        devices: list[str] = []
        for entry in registry.entries():
            for device in entry.devices:
                if device not in devices:
                    devices.append(device)
        for device in devices:
            candidates = registry.available_for(device)
            if candidates:
                specs[device], *after[device] = candidates
        if "cpu" not in specs:
            registry.default_for("cpu")  # raises the error that says what to install
        if not specs:
            raise BackendNotFoundError("no backend is available")
    elif isinstance(parsed, dict):
        if not parsed:
            raise ValueError("backends={} names no backend; pass None to pick the defaults")
        for device, value in parsed.items():
            specs[device] = _resolve(registry, value, device)
    elif isinstance(parsed, str):
        for device in registry.declared(parsed).devices:
            specs[device] = registry.declared(parsed, device)
    else:
        spec = parsed if isinstance(parsed, BackendSpec) else factory_spec(parsed)
        for device in spec.devices:
            specs[device] = spec
    messages = message_device(specs).type
    error = registry.unavailable_error(specs[messages], messages)
    if error is not None:  # the group's own traffic (objects, barrier, subgroups) needs it
        raise error
    return Choice(specs, after)


def unavailable(specs: Mapping[str, BackendSpec], registry: Registry | None, group: str) -> dict[str, str]:
    """Device type -> the message of the :class:`~pg_core.errors.BackendUnavailableError`
    that its first use raises, for each backend of ``specs`` that cannot run here."""
    if registry is None:
        from .registry import default_registry

        registry = default_registry()
    errors = {d: e for d, spec in specs.items() if (e := registry.unavailable_error(spec, d)) is not None}
    working = ", ".join(f"{d}: {s.name}" for d, s in specs.items() if d not in errors)
    return {
        device: f"group {group!r} cannot run {device} tensors here. {error} The group formed without it"
        f"{f' (its other backends work: {working})' if working else ''}; `pg-core backends` lists what runs here"
        for device, error in errors.items()
    }


def _resolve(registry: Registry, value: BackendValue, device: str) -> BackendSpec:
    if isinstance(value, str):
        return registry.declared(value, device)
    if isinstance(value, BackendSpec):
        value.capabilities_for(device)  # raises if the spec does not declare it
        return value
    if callable(value):
        return factory_spec(value, (device,))
    raise TypeError(f"backend for {device!r} must be a name, a BackendSpec or a Backend factory, got {value!r}")


def describe(specs: Mapping[str, BackendSpec]) -> str:
    """``"cpu:tcp,cuda:nccl"``: what every member of a group must have resolved alike."""
    return ",".join(f"{device}:{spec.name}" for device, spec in sorted(specs.items()))


def message_device(specs: Mapping[str, BackendSpec]) -> torch.device:
    """Where a group's objects, messages and barrier go: its cpu backend, else the first one."""
    return torch.device("cpu" if "cpu" in specs or not specs else next(iter(specs)))


class Dispatcher:
    """The live backend instances of one group, by device type, each created on first use.

    ``ctx`` builds the :class:`BackendContext` of a device (its store already prefixed for
    this group). ``unavailable`` (see :func:`unavailable`) names the device types whose
    backend cannot run here: creating one raises its error. Closing refuses further
    creation; an instance created while the group closed is aborted by its creator, so none
    escapes being closed.

    ``fallbacks`` (:attr:`Choice.fallbacks`) are the backends to try, in order, for a device
    type left to the default whose backend refuses the members
    (:class:`~pg_core.errors.BackendUnavailableError` from its creation). Falling back needs
    every member to have been refused alike, which one more store round after each attempt
    that has a fallback settles (keys ``pg-core/choice/<rank>`` in the refused backend's
    store): all refused, each builds the next; some refused and some formed it, or one
    failed otherwise, every member raises, naming who did what, and those that formed it
    abort it. ``on_choice(device type, spec)`` hears of the spec a fallback put in use.
    """

    def __init__(
        self,
        specs: Mapping[str, BackendSpec],
        ctx: Callable[[BackendSpec, torch.device], BackendContext],
        unavailable: Mapping[str, str] | None = None,
        fallbacks: Mapping[str, Sequence[BackendSpec]] | None = None,
        on_choice: Callable[[str, BackendSpec], None] | None = None,
    ):
        self._specs = dict(specs)
        self._ctx = ctx
        self._unavailable = dict(unavailable or {})
        self._fallbacks = {d: tuple(c) for d, c in (fallbacks or {}).items()}
        self._on_choice = on_choice
        self._instances: dict[str, Instance] = {}  # by device type
        self._by_device: dict[torch.device, Instance] = {}  # the same, by every device seen (no .type on the hot path)
        self._locks = {device: threading.Lock() for device in self._specs}
        self._closed = False

    @property
    def specs(self) -> dict[str, BackendSpec]:
        return dict(self._specs)

    def available(self, device_type: str) -> bool:
        """Whether ``device_type`` has a backend in this group that can run here."""
        return device_type in self._specs and device_type not in self._unavailable

    def device(self, device_type: str) -> torch.device:
        """Where tensors of ``device_type`` live for this group: its instance's device once
        created, else the type's current device."""
        inst = self._instances.get(device_type)
        return inst.device if inst is not None else torch.device(device_type)

    def launches(self, device: torch.device, op: str | None = None) -> bool:
        """Whether ``device``'s backend exists and launches collective ``op`` (``None``: its
        collectives; ``Backend.launches``, API 1.2, and a method that takes ``async_op``). Before
        it exists, an asynchronous collective goes to the progress thread like any other:
        creating a backend may wait for every member (Gloo's does), which the caller of an
        ``async_op=True`` call must not."""
        inst = self._by_device.get(device) or self._instances.get(device.type)
        if inst is None:
            return False
        return inst.launches if op is None else op in inst.launching

    def prepared_all_reduce(
        self, device: torch.device, dtype: torch.dtype, op: ReduceOp, timeout: float
    ) -> Callable[[torch.Tensor], None] | None:
        """The prepared all_reduce (API 1.5) of ``device``'s backend, if it exists and offers one."""
        inst = self._by_device.get(device) or self._instances.get(device.type)
        prepare = getattr(inst.backend, "prepared_all_reduce", None) if inst is not None else None
        return None if prepare is None else prepare(dtype, op, timeout=timeout)  # type: ignore[no-any-return]

    def instance(self, device: torch.device, op: str | None = None) -> Instance:
        """The instance for ``device``'s type, created on first use (the caller checked that
        the group has a backend for it). A timeout while it is created names ``op``, the
        user's operation that needed it."""
        inst = self._by_device.get(device)
        if inst is not None:
            return inst
        inst = self._instances.get(device.type)
        if inst is not None:
            self._by_device[device] = inst
            return inst
        with self._locks[device.type]:
            if self._closed:
                raise GroupClosedError("the group is closed")
            inst = self._instances.get(device.type)
            if inst is None:
                if device.type in self._unavailable:
                    raise BackendUnavailableError(self._unavailable[device.type])
                try:
                    inst = self._create(device)
                except CollectiveTimeout as exc:
                    if op is not None:
                        exc.op = op
                    raise
                if self._closed:  # closed while it was being created: nobody else will close it
                    inst.close("abort")
                    raise GroupClosedError("the group was closed while its backend was created")
                self._instances[device.type] = inst
            return inst

    def _create(self, device: torch.device) -> Instance:
        """The instance of ``device``'s type: its spec's, or where that refuses every member
        alike, the first of its fallbacks that does not (see the class)."""
        spec = self._specs[device.type]
        after = self._fallbacks.get(device.type, ())
        while True:
            ctx = self._ctx(spec, device)
            if not after:
                inst = Instance(spec, ctx)
                break
            try:
                inst = Instance(spec, ctx)
            except BackendUnavailableError as exc:
                _agree_refused(ctx, spec, after[0], exc)
            except BaseException as exc:
                with contextlib.suppress(Exception):  # (a store that is gone: the others time out, naming it)
                    ctx.store.set(f"{_CHOICE}/{ctx.rank}", f"failed {type(exc).__name__}: {exc}")
                raise
            else:
                _agree_formed(ctx, spec, inst)
                break
            spec, after = after[0], after[1:]
            self._specs[device.type] = spec
            self._fallbacks[device.type] = after
            if self._on_choice is not None:
                self._on_choice(device.type, spec)
        return inst

    def close(self) -> list[Instance]:
        """Refuse further creation; return the instances created so far (the caller closes them)."""
        self._closed = True
        instances = []
        for device, lock in self._locks.items():
            with lock:
                inst = self._instances.get(device)
            if inst is not None:
                instances.append(inst)
        return instances


#: where, in a refused backend's store, the members say how its creation went (see Dispatcher)
_CHOICE = "pg-core/choice"


def _outcomes(ctx: BackendContext, spec: BackendSpec, mine: str) -> list[str]:
    """Every member's word on creating ``spec`` (``ok``, ``refused <next> <why>`` or
    ``failed <why>``), this member's being ``mine``."""
    ctx.store.set(f"{_CHOICE}/{ctx.rank}", mine)
    what = f"group {ctx.group_name!r} rank {ctx.rank}: whether every member formed backend {spec.name!r}"
    wait_for(ctx.store, [f"{_CHOICE}/{r}" for r in range(ctx.size)], ctx.timeout, what=what)
    return [ctx.store.get(f"{_CHOICE}/{r}").decode() for r in range(ctx.size)]


def _disagreement(ctx: BackendContext, spec: BackendSpec, words: list[str]) -> BackendUnavailableError:
    """The error of members that did not all fare alike with the default ``spec``."""
    told: dict[str, list[int]] = {}
    for rank, word in enumerate(words):
        kind, _, rest = word.partition(" ")
        if kind == "ok":
            text = "formed it"
        elif kind == "refused":
            text = f"were refused it ({rest.partition(' ')[2]})"
        else:
            text = f"failed to form it ({rest})"
        told.setdefault(text, []).append(rank)
    return BackendUnavailableError(
        f"group {ctx.group_name!r}: the members did not fare alike with the default {ctx.device.type} backend "
        f"{spec.name!r}, so they cannot fall back together: "
        + "; ".join(f"ranks {ranks} {text}" for text, ranks in told.items())
        + ". Name the backend for this group (backends=...)"
    )


def _agree_refused(ctx: BackendContext, spec: BackendSpec, following: BackendSpec, exc: BaseException) -> None:
    """Return where every member was refused ``spec`` and falls back to ``following``, as this one
    was (``exc``); else raise, naming who did what."""
    words = _outcomes(ctx, spec, f"refused {following.name} {exc}")
    if all(w.startswith("refused ") for w in words):
        nexts = {w.split(" ", 2)[1] for w in words}
        if nexts == {following.name}:
            return
        raise CollectiveMismatchError(
            f"group {ctx.group_name!r}: every member was refused the default backend {spec.name!r}, but they "
            f"would fall back to different ones ({', '.join(sorted(nexts))}): install the same backends "
            "everywhere or name them with backends="
        ) from exc
    raise _disagreement(ctx, spec, words) from exc


def _agree_formed(ctx: BackendContext, spec: BackendSpec, inst: Instance) -> None:
    """Return where every member formed ``spec`` as this one did (``inst``); else abort it and raise."""
    try:
        words = _outcomes(ctx, spec, "ok")
    except BaseException:
        inst.close("abort")
        raise
    if all(w == "ok" for w in words):
        return
    inst.close("abort")
    raise _disagreement(ctx, spec, words)


def context_factory(
    store: Store,
    *,
    rank: int,
    size: int,
    timeout: float,
    group_name: str,
    group_uid: str,
    options: Mapping[str, Mapping[str, Any]],
    split_from: Mapping[str, Any] | None = None,
    auth_key: AuthKey | None = None,
) -> Callable[[BackendSpec, torch.device], BackendContext]:
    """How a group's dispatcher builds each backend's context: the store under
    ``<device type>/<backend name>``, the user's options for that backend, for a device
    type in ``split_from`` (a subgroup split natively, API 1.6) the parent backend's handle,
    and the job's secret (API 1.8) in an authenticated job."""
    handles = dict(split_from or {})

    def ctx(spec: BackendSpec, device: torch.device) -> BackendContext:
        return BackendContext(
            store=PrefixStore(f"{device.type}/{spec.name}", store),
            rank=rank,
            size=size,
            device=device,
            timeout=timeout,
            group_name=group_name,
            group_uid=group_uid,
            backend_name=spec.name,
            options=dict(options.get(spec.name, {})),
            split_from=handles.get(device.type),
            auth_key=auth_key,
        )

    return ctx
