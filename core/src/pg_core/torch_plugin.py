"""Torch's own plugin route: ``torch.distributed.init_process_group(backend="pg_core")`` builds a
pg-core :class:`~pg_core.ProcessGroup` underneath, and torch's ``new_group`` builds one per
subgroup.

This route goes through torch's global state (its default group, its group registry and rank
tables, ``Backend``'s class-level tables), by design: it is for code that is written against
``torch.distributed``'s functions and is not to be changed. Code that can hold a group object
has no need of it (``ProcessGroup(...)``, ``group.to_torch()``). Nothing is registered by
importing ``pg_core``; :func:`register` does it, once per process (idempotent)::

    import pg_core.torch_plugin

    pg_core.torch_plugin.register()
    torch.distributed.init_process_group("pg_core", init_method="tcp://...", rank=r, world_size=n)

**Backend names.** ``"pg_core"``: pg-core's backends chosen as ``ProcessGroup(backends=...)``
chooses them, from :data:`BACKENDS_ENV` (``PG_CORE_TORCH_BACKEND=tcp``,
``PG_CORE_TORCH_BACKEND="cpu:gloo,cuda:nccl"``) or, unset, the highest-priority backend
installed and available for each device. ``"pg_core_<name>"`` (``"pg_core_tcp"``,
``"pg_core_gloo"``: one per pg-core backend installed when :func:`register` ran) names one pg-core
backend for every device it declares. Torch's ``"device:backend"`` strings cannot spell a
pg-core backend (``"pg_core:tcp"`` reads as a device named ``pg_core``), hence the underscore.
The pg-core name must be the whole backend string: torch stops at the first device whose
backend returns a whole group, so ``"cpu:pg_core,cuda:nccl"`` would silently drop NCCL; say
``PG_CORE_TORCH_BACKEND="cpu:tcp,cuda:nccl"`` instead, and pg-core dispatches per device.
``pg_options=`` (``init_process_group``, ``new_group``) may be a :class:`TorchOptions`, which
takes precedence over the environment.

**What torch gets.** The creator forms a pg-core group on the store torch prefixed for the
group, with torch's group rank, size and timeout, named ``torch:<group id>``, and hands torch
``group.to_torch()``'s operations (:mod:`pg_core.interop`): over native backends (pg-gloo,
pg-nccl) a plain torch ``ProcessGroup`` holding the group's very C++ backends, so torch's calls
cost no Python; otherwise the adapter. The pg-core group lives as long as torch or the user
holds the torch group. ``destroy_process_group`` shuts it down (threads, sockets and store
marks released): at once for the adapter, whose ``shutdown`` torch calls; over native backends
when the torch group is let go, which is at once unless the user still holds it (torch shuts
its C++ backends down at once either way). A torch group can carry no hook of its own unless
it is a Python subclass, and torch's calls into a subclass hold the GIL while they wait for
Gloo's work queue, whose thread may be waiting for the GIL to free a finished work's tensors:
both ranks hang (seen in torch's own tests).
Torch's subgroups are pg-core groups of their own, formed on torch's store by their members;
their ranks are torch's group ranks (torch keeps the global ranks in its own tables). A
``new_group`` without ``pg_options`` takes the default group's pg-core backends and settings,
as torch's subgroups take the default group's backend. :func:`pg_core_group` finds the pg-core
group under a torch group.

**What it relies on.** Torch's documented ``Backend.register_backend(..., extended_api=True)``,
and ``_new_process_group_helper`` using a returned ``ProcessGroup`` as the group; tested with
the torch versions of :data:`TORCH_VERSIONS` (``tests/torch_suite``), and :func:`register`
refuses another with a message that says so.

**Torch's entry points.** Torch 2.13 has no entry-point group for distributed backends: its
``torch.backends`` group is for device extensions, every one loaded by every ``import torch``
in the environment. pg-core declares one there (:func:`autoload`) that registers only where
:data:`AUTOLOAD_ENV` (``PG_CORE_TORCH_AUTOLOAD=1``) asks, so ``import torch`` alone changes
nothing of torch's state.
"""

from __future__ import annotations

import os
import re
import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Final

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from .dispatch import BackendsArg
    from .group import ProcessGroup
    from .messages import ObjectsArg

__all__ = [
    "AUTOLOAD_ENV",
    "BACKENDS_ENV",
    "NAME",
    "TORCH_VERSIONS",
    "TorchOptions",
    "autoload",
    "pg_core_group",
    "register",
    "registered",
]

#: The backend name torch's ``init_process_group(backend=...)`` takes.
NAME: Final = "pg_core"
#: pg-core's backends for ``backend="pg_core"``: a ``ProcessGroup(backends=...)`` string.
BACKENDS_ENV: Final = "PG_CORE_TORCH_BACKEND"
#: ``1`` makes ``import torch`` register pg-core through torch's ``torch.backends`` entry points.
AUTOLOAD_ENV: Final = "PG_CORE_TORCH_AUTOLOAD"
#: The oldest and newest torch (major, minor) this route is tested with (tests/torch_suite).
TORCH_VERSIONS: Final = ((2, 13), (2, 13))

#: What this process registered with torch: backend name -> the pg-core backends it stands for
#: (``None``: the environment's or the defaults). The plugin route is process-wide by nature:
#: torch's ``Backend`` tables are. Guarded by ``_LOCK``.
_REGISTERED: dict[str, str | None] = {}
_LOCK = threading.Lock()
#: The torch groups over native backends the route made -> their pg-core group and settings. A
#: torch ``ProcessGroup`` takes no attributes; an entry goes with its torch group.
_NATIVE: weakref.WeakKeyDictionary[dist.ProcessGroup, tuple[ProcessGroup, TorchOptions]] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class TorchOptions:
    """``pg_options=`` for a pg-core backend in ``init_process_group`` / ``new_group``: what
    :class:`~pg_core.ProcessGroup` would take. ``backends`` overrides :data:`BACKENDS_ENV` and the
    backend name's own; ``options``, ``check``, ``auth_key`` and ``objects`` are passed as they are."""

    backends: BackendsArg = None
    options: Mapping[str, Mapping[str, Any]] | None = None
    check: bool | None = None
    auth_key: str | bytes | None = None
    objects: ObjectsArg = None


def registered() -> dict[str, str | None]:
    """The backend names this process registered with torch, each with the pg-core backends it
    stands for (``None``: from :data:`BACKENDS_ENV`, or pg-core's defaults)."""
    with _LOCK:
        return dict(_REGISTERED)


def register() -> list[str]:
    """Register ``"pg_core"``, and ``"pg_core_<name>"`` for each pg-core backend installed (one
    that cannot run here too: using it says why), with torch's ``Backend.register_backend``;
    returns the names. Idempotent: a second call
    registers only backends installed since. Raises ``RuntimeError`` on a torch version outside
    :data:`TORCH_VERSIONS`, naming it."""
    from .registry import default_registry

    _check_torch()
    wanted: dict[str, tuple[str | None, list[str]]] = {}
    entries = [e for e in default_registry().entries() if e.spec is not None]
    available = [e.spec for e in entries if e.status == "available" and e.spec is not None]
    every = sorted({device for spec in available for device in spec.devices} | {"cpu"})
    wanted[NAME] = (None, every)
    # an installed backend that cannot run here is registered too: using it raises pg-core's
    # BackendUnavailableError with the reason, where torch would say only 'Invalid backend'
    for spec in [e.spec for e in entries if e.status in ("available", "unavailable") and e.spec is not None]:
        if not re.fullmatch(r"[a-z0-9_]+", spec.name):
            continue  # torch lower-cases and upper-cases names: only plain ones map back
        wanted[f"{NAME}_{spec.name}"] = (spec.name, sorted(spec.devices))
    with _LOCK:
        for name, (backends, devices) in wanted.items():
            if name in _REGISTERED:
                continue
            dist.Backend.register_backend(name, _creator(name, backends), extended_api=True, devices=devices)
            _REGISTERED[name] = backends
        return list(_REGISTERED)


def autoload() -> None:
    """Torch's ``torch.backends`` entry point: registers (as :func:`register`) only where
    :data:`AUTOLOAD_ENV` is ``1``. Runs inside ``import torch``, so it imports nothing else
    unless asked."""
    if os.environ.get(AUTOLOAD_ENV, "") == "1":
        register()


def pg_core_group(torch_group: dist.ProcessGroup) -> ProcessGroup:
    """The pg-core group under a torch group that the plugin route made (``init_process_group``'s
    default group, or a ``new_group``). Raises ``TypeError`` for any other torch group."""
    made = _made(torch_group)
    if made is None:
        raise TypeError(
            f"{torch_group!r} was not made by pg-core's torch plugin route "
            f"(init_process_group(backend={NAME!r}) or new_group() under it)"
        )
    return made[0]


def _check_torch() -> None:
    found = tuple(int(part) for part in re.findall(r"\d+", torch.__version__)[:2])
    low, high = TORCH_VERSIONS
    if not low <= found <= high:
        supported = f"{low[0]}.{low[1]}" + ("" if low == high else f" to {high[0]}.{high[1]}")
        raise RuntimeError(
            f"pg-core's torch plugin route supports torch {supported}, "
            f"found torch {torch.__version__}: it relies on how torch's init_process_group calls a "
            "plugin. Use ProcessGroup(...) and group.to_torch() instead, which need no registration."
        )


def _creator(name: str, backends: str | None) -> Callable[[Any, Any], dist.ProcessGroup]:
    """Torch's creator for the backend ``name``: ``creator(dist_backend_opts, pg_options)``."""

    def create(opts: Any, pg_options: Any) -> dist.ProcessGroup:
        return _create(name, backends, opts, pg_options)

    create.__qualname__ = f"pg_core_torch_plugin[{name}]"
    return create


def _create(name: str, backends: str | None, opts: Any, pg_options: Any) -> dist.ProcessGroup:
    from .group import ProcessGroup

    if pg_options is not None and not isinstance(pg_options, TorchOptions):
        raise TypeError(
            f"pg_options for torch backend {name!r} must be a pg_core.torch_plugin.TorchOptions, "
            f"got {type(pg_options).__name__}; say which pg-core backends with TorchOptions(backends=...) "
            f"or {BACKENDS_ENV}"
        )
    inherited = _inherited()
    chosen = (
        (pg_options.backends if pg_options is not None else None)
        or backends
        or inherited.backends
        or os.environ.get(BACKENDS_ENV)
        or None
    )
    settings = replace(pg_options or inherited, backends=chosen)
    timeout = opts.timeout
    group = ProcessGroup(
        opts.store,
        opts.group_rank,
        opts.group_size,
        backends=settings.backends,
        name=_group_name(str(opts.group_id)),
        timeout=timeout.total_seconds() if isinstance(timeout, timedelta) else None,
        options=settings.options,
        check=settings.check,
        auth_key=settings.auth_key,
        objects=settings.objects,
    )
    try:
        return _owning(group, group.to_torch(), settings, name)
    except BaseException:
        group.abort()
        raise


def _inherited() -> TorchOptions:
    """What a subgroup takes from torch's default group when ``new_group`` gives no ``pg_options``:
    the default group's settings (its pg-core backends included) if this route made it, as torch's
    subgroups take their backend from the default group."""
    made = _made(dist.group.WORLD) if dist.is_initialized() else None
    return made[1] if made is not None else TorchOptions()


def _group_name(group_id: str) -> str:
    """The pg-core group's name for torch's group id (pg-core's names have no ``/``)."""
    return "torch:" + group_id.replace("/", "_")


def _owning(
    group: ProcessGroup, torch_group: dist.ProcessGroup, settings: TorchOptions, name: str
) -> dist.ProcessGroup:
    """A torch group that keeps ``group`` alive while torch (or the user) holds it, and shuts it
    down when torch's ``destroy_process_group`` lets it go.

    Over native backends, a plain torch ``ProcessGroup`` with the very C++ backends of
    ``group.to_torch()`` (a new one: the group's cached one would keep itself alive through the
    group), watched by a finalizer. It cannot be a Python subclass, which could carry a
    ``shutdown`` of its own: torch's calls into a subclass keep the GIL while they wait for
    Gloo's work queue, whose thread may be waiting for the GIL to free a finished work's tensors,
    and both ranks hang (seen in torch's own tests, one run in a few). The adapter is Python
    already: it holds the group, its ``shutdown`` and ``abort`` shut the group down or abort it
    as well, and it calls itself ``name``, the backend name torch's tables give it (DDP logs the
    group's own)."""
    if type(torch_group) is dist.ProcessGroup:
        route = dist.ProcessGroup(group.rank, group.size)  # type: ignore[call-arg]
        types = dist.ProcessGroup.BackendType
        default = None
        for device in torch_group._device_types:
            backend = torch_group._get_backend(device)
            kind = getattr(types, backend.name().upper(), types.CUSTOM)
            route._register_backend(torch.device(device), kind, backend)
            default = default or kind
        if default is not None:
            route._set_default_backend(default)
        _NATIVE[route] = (group, settings)
        # not at interpreter exit: a job that never called destroy_process_group ends as torch's
        # would, not waiting there (up to the group's timeout) for its peers to leave
        weakref.finalize(route, group.shutdown).atexit = False
        return route
    torch_shutdown, torch_abort = torch_group.shutdown, torch_group.abort

    def shutdown() -> None:
        try:
            torch_shutdown()
        finally:
            group.shutdown()

    def abort() -> None:  # torch's _abort_process_group
        try:
            torch_abort()
        finally:
            group.abort()

    torch_group._pg_core_group = group  # type: ignore[attr-defined]
    torch_group._pg_core_options = settings  # type: ignore[attr-defined]
    torch_group.shutdown = shutdown  # type: ignore[method-assign]
    torch_group.abort = abort  # type: ignore[method-assign]
    torch_group.getBackendName = lambda: name  # type: ignore[attr-defined]
    return torch_group


def _made(torch_group: object) -> tuple[ProcessGroup, TorchOptions] | None:
    """The pg-core group and settings under a torch group the route made, else ``None``."""
    group = getattr(torch_group, "_pg_core_group", None)
    if group is not None:
        return group, torch_group._pg_core_options  # type: ignore[attr-defined]
    try:
        return _NATIVE.get(torch_group)  # type: ignore[call-overload]
    except TypeError:  # not weakly referable, so not ours
        return None
