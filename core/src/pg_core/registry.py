"""The plugin registry: which backends are installed, which can run here, which to use.

Backends live in separate distributions that declare a module in the entry-point
group ``pg_core.backends``; that module implements the pluggy hook
``pg_core_backends()`` and returns :class:`~pg_core.backend.BackendSpec` objects::

    # pyproject.toml of the plugin
    [project.entry-points."pg_core.backends"]
    tcp = "pg_tcp.plugin"

    # pg_tcp/plugin.py
    from pg_core.registry import hookimpl

    @hookimpl                       # optional: an unmarked function of this name is found too
    def pg_core_backends():
        return [BackendSpec("tcp", "pg_tcp.backend:TCPBackend", devices=("cpu",))]

**What the registry guarantees**

* Discovery is lazy: nothing is imported before the registry is first used, and
  ``import pg_core`` never imports a plugin.
* Each entry point is imported, and its hook called, in its own guard. Whatever
  goes wrong in one plugin (an import error, a hook returning garbage, a spec for
  another major version of the backend API) becomes a listed ``broken``
  :class:`PluginEntry` naming the distribution and the error; other plugins keep
  working, and asking for that backend raises the plugin's
  :class:`~pg_core.errors.PluginError`.
* Every spec carries the ``distribution`` and ``version`` of the distribution
  that provided it.
* Two distributions providing one backend name is a conflict: both are listed as
  ``conflict`` and :meth:`Registry.get` raises
  :class:`~pg_core.errors.PluginConflictError` naming both, until the user pins
  one (``"name@distribution"``) or steers loading. One distribution seen twice
  (say, an editable and a regular install) is not a conflict: the first on
  ``sys.path`` wins, as for imports.
* ``PG_CORE_PLUGINS=a,b`` (allow-list) and ``PG_CORE_DISABLE_PLUGINS=a,b``
  (deny-list) steer loading. An item matches an entry-point name, a distribution
  name (case-insensitive, ``-``, ``_`` and ``.`` alike) or a backend name. An entry
  point matched by its own or its distribution's name is not imported at all.
* Availability (``BackendSpec.is_available()``) is probed on first need and
  cached per spec until :meth:`Registry.refresh`.
* Every method is thread-safe.

:func:`default_registry` is the one process-wide object of pg-core;
``Registry(load_entry_points=False)`` gives an isolated one for tests.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import os
import re
import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal

import pluggy

from .backend import API_VERSION, BackendSpec, parse_api_version
from .errors import (
    BackendNotFoundError,
    BackendUnavailableError,
    NotSupportedError,
    PluginConflictError,
    PluginError,
    PluginLoadError,
    PluginVersionError,
)

if TYPE_CHECKING:
    from importlib_metadata import EntryPoint

__all__ = [
    "DISABLE_ENV",
    "ENTRY_POINT_GROUP",
    "HOOK_NAME",
    "PLUGINS_ENV",
    "PluginEntry",
    "PluginSpecs",
    "Registry",
    "default_registry",
    "hookimpl",
    "hookspec",
    "register_backend",
]

#: The entry-point group plugin distributions declare their hook module in.
ENTRY_POINT_GROUP: Final = "pg_core.backends"
#: The name of the hook a plugin module implements.
HOOK_NAME: Final = "pg_core_backends"
#: Allow-list: only the plugins named here load.
PLUGINS_ENV: Final = "PG_CORE_PLUGINS"
#: Deny-list: the plugins named here do not load.
DISABLE_ENV: Final = "PG_CORE_DISABLE_PLUGINS"

hookspec = pluggy.HookspecMarker("pg_core")
hookimpl = pluggy.HookimplMarker("pg_core")

Status = Literal["available", "unavailable", "broken", "disabled", "conflict"]

_PIP_HINT: Final = "pg-core alone has no backend. `pip install pg-core[tcp]` gives the pure-Python default"
_IN_PROCESS: Final = "in-process registration"


class PluginSpecs:
    """The hooks a plugin module may implement."""

    @hookspec
    def pg_core_backends(self) -> list[BackendSpec]:  # type: ignore[empty-body]
        """Return the backends this plugin provides (a list, or any iterable, of
        :class:`~pg_core.backend.BackendSpec`). Called once per discovery; keep it
        cheap: do not import CUDA, MPI or a native library here (use a
        ``"module:attr"`` factory and ``is_available``)."""


@dataclass(frozen=True)
class PluginEntry:
    """One line of ``pg-core backends``: a backend, or a plugin that could not provide one.

    ``name`` is the backend name; for a plugin that was not loaded (broken before
    its hook returned, or disabled by its entry-point or distribution name) it is
    the entry-point name. ``entry_point`` is ``"name = module"`` (``None`` for an
    in-process registration). ``reason`` says why a backend is unavailable, the
    error of a broken one, what disabled one, or the other provider(s) of a
    conflict.
    """

    name: str
    distribution: str | None
    version: str | None
    entry_point: str | None
    api_version: str | None
    devices: tuple[str, ...]
    priority: int | None
    status: Status
    reason: str | None
    spec: BackendSpec | None

    def as_dict(self) -> dict[str, Any]:
        """The entry as JSON-compatible data (everything but ``spec``)."""
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "entry_point": self.entry_point,
            "api_version": self.api_version,
            "devices": list(self.devices),
            "priority": self.priority,
            "status": self.status,
            "reason": self.reason,
        }


# -- internal records ------------------------------------------------------------


@dataclass
class _Record:
    """What discovery or ``register`` found: a usable spec, a broken plugin or a disabled one."""

    name: str
    state: Literal["ok", "broken", "disabled"]
    distribution: str | None = None
    version: str | None = None
    entry_point: str | None = None
    spec: BackendSpec | None = None
    reason: str | None = None
    error: PluginError | None = None
    in_process: bool = False
    override: bool = False

    @property
    def label(self) -> str:
        return _label(self.distribution, self.version, self.in_process)

    def entry(self, status: Status, reason: str | None) -> PluginEntry:
        spec = self.spec
        return PluginEntry(
            name=self.name,
            distribution=self.distribution,
            version=self.version,
            entry_point=self.entry_point,
            api_version=None if spec is None else str(spec.api_version),
            devices=() if spec is None else spec.devices,
            priority=None if spec is None else spec.priority,
            status=status,
            reason=reason,
            spec=spec,
        )


@dataclass
class _View:
    """A record with its resolved status: ``ok`` is still to be probed for availability."""

    record: _Record
    status: Literal["ok", "broken", "disabled", "conflict"]
    reason: str | None


def _canonical(name: str) -> str:
    """A distribution-style name: case-insensitive, ``-``/``_``/``.`` alike (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name.strip()).lower()


def _label(distribution: str | None, version: str | None, in_process: bool = False) -> str:
    if distribution is None:
        return _IN_PROCESS if in_process else "unknown distribution"
    return f"{distribution} {version}" if version else distribution


def error_text(exc: BaseException) -> str:
    """``exc`` as an error message quotes it: its class and its text."""
    return f"{type(exc).__name__}: {exc}"


def clause(text: str | None) -> str:
    """``text`` without its final full stop, to go inside a sentence."""
    return (text or "").rstrip().rstrip(".")


def _parse_list(raw: str) -> frozenset[str]:
    return frozenset(_canonical(item) for item in raw.split(",") if item.strip())


def api_version_error(spec: BackendSpec, where: str, distribution: str | None) -> tuple[PluginVersionError, str] | None:
    """``None`` if ``spec.api_version`` has the core's major version, else the error to raise
    (naming the spec, ``where`` it came from and what to install) and a short reason."""
    from . import __version__

    core = parse_api_version(API_VERSION)
    assert core is not None
    declared = spec.api_version
    parsed = parse_api_version(declared)
    if parsed is None:
        return PluginVersionError(
            f"Backend {spec.name!r} from {where} declares api_version {declared!r}, which is not 'MAJOR.MINOR'; "
            f"this pg-core ({__version__}) implements backend API {API_VERSION}. "
            f"The plugin must set api_version={API_VERSION!r} (or leave the default).",
            distribution=distribution,
        ), f"PluginVersionError: api_version {declared!r} is not 'MAJOR.MINOR'"
    if parsed[0] != core[0]:
        return PluginVersionError(
            f"Backend {spec.name!r} from {where} was written for backend API {declared.strip()}, "
            f"but this pg-core ({__version__}) implements API {API_VERSION}. "
            f"Install a release of {distribution or 'the plugin'} built for API {core[0]}.x, "
            f"or a pg-core that implements API {parsed[0]}.x.",
            distribution=distribution,
        ), f"PluginVersionError: written for backend API {declared.strip()}, pg-core implements {API_VERSION}"
    return None


def _fresh(error: PluginError) -> PluginError:
    """A new exception equal to a stored one, so raising it twice keeps tracebacks apart."""
    new = type(error)(str(error), distribution=error.distribution)
    new.__cause__ = error.__cause__
    return new


class _PluginManager(pluggy.PluginManager):
    """Also accepts an unmarked module-level function named ``pg_core_backends``."""

    def parse_hookimpl_opts(self, plugin: object, name: str) -> pluggy.HookimplOpts | None:
        opts = super().parse_hookimpl_opts(plugin, name)
        if opts is None and name == HOOK_NAME:
            attr = inspect.getattr_static(plugin, name, None)
            if inspect.isfunction(attr) or isinstance(attr, staticmethod):
                return pluggy.HookimplOpts(
                    wrapper=False, hookwrapper=False, optionalhook=False, tryfirst=False, trylast=False, specname=None
                )
        return opts


# -- the registry ------------------------------------------------------------------


class Registry:
    """Installed backends, by name and by device. See the module docstring.

    ``load_entry_points=False`` gives a registry that only knows what is
    :meth:`register`-ed (for tests). ``environ`` replaces ``os.environ`` for
    ``PG_CORE_PLUGINS`` and ``PG_CORE_DISABLE_PLUGINS``; it is read at each
    discovery.
    """

    def __init__(self, *, load_entry_points: bool = True, environ: Mapping[str, str] | None = None) -> None:
        self._load_entry_points = load_entry_points
        self._environ = environ
        self._lock = threading.RLock()
        self._discovered = not load_entry_points
        self._discovering = False
        self._plugins: list[_Record] = []  # from entry points
        self._registered: list[_Record] = []  # from register()
        #: id(spec) -> (a weak reference to the spec, its reason): a spec made for one group
        #: (``backends=SomeBackend``) leaves the cache when it is collected
        self._availability: dict[int, tuple[weakref.ref[BackendSpec], str | None]] = {}

    def __repr__(self) -> str:
        state = "discovered" if self._discovered else "not yet discovered"
        return f"<Registry {state}: {len(self._plugins)} from entry points, {len(self._registered)} registered>"

    # -- listing -------------------------------------------------------------------
    def entries(self) -> list[PluginEntry]:
        """Everything known, usable or not, sorted by name then distribution.

        Includes broken, disabled and conflicting plugins; availability of the
        others is probed (``spec.why_unavailable()``) and cached per spec.
        """
        with self._lock:
            result = []
            for view in self._views():
                if view.status == "ok":
                    assert view.record.spec is not None
                    reason = self._why_unavailable(view.record.spec)
                    result.append(view.record.entry("available" if reason is None else "unavailable", reason))
                else:
                    result.append(view.record.entry(view.status, view.reason))
            return sorted(result, key=lambda e: (e.name, _canonical(e.distribution or ""), e.entry_point or ""))

    # -- lookup ----------------------------------------------------------------------
    def get(self, name: str) -> BackendSpec:
        """The spec of backend ``name``, available here or not.

        ``name`` may pin a distribution: ``"tcp@pg-tcp"``. Raises
        :class:`~pg_core.errors.BackendNotFoundError` (listing what is installed),
        :class:`~pg_core.errors.PluginConflictError` (two distributions provide
        ``name``), or the :class:`~pg_core.errors.PluginLoadError` /
        :class:`~pg_core.errors.PluginVersionError` of a broken plugin known to
        provide ``name``.
        """
        if not isinstance(name, str):
            raise TypeError(f"backend name must be a str, got {type(name).__name__}: {name!r}")
        backend, sep, pin = (part.strip() for part in name.partition("@"))
        if not backend or (sep and not pin):
            raise ValueError(f"backend name {name!r} must be 'name' or 'name@distribution'")
        with self._lock:
            views = self._views()
            providers = [v for v in views if v.status in ("ok", "conflict") and v.record.name == backend]
            if pin:
                pinned = [v for v in providers if _canonical(v.record.distribution or "") == _canonical(pin)]
                if pinned:
                    assert pinned[0].record.spec is not None
                    return pinned[0].record.spec
                self._raise_broken(views, backend, pin)
                self._raise_disabled(views, backend, pin)
                if providers:
                    raise BackendNotFoundError(
                        f"Backend {backend!r} is not provided by distribution {pin!r}. "
                        f"Providers of {backend!r}: {', '.join(v.record.label for v in providers)}; "
                        f"pin one of them as '{backend}@<distribution>'."
                    )
                raise BackendNotFoundError(self._unknown_message(views, name))
            if len(providers) > 1:
                raise self._conflict_error(backend, [v.record for v in providers])
            if providers:
                assert providers[0].record.spec is not None
                return providers[0].record.spec
            self._raise_broken(views, backend, None)
            self._raise_disabled(views, backend, None)
            raise BackendNotFoundError(self._unknown_message(views, name))

    def require(self, name: str, device: str | None = None) -> BackendSpec:
        """:meth:`declared`, then insist that the backend can run here (on ``device``).

        Raises what :meth:`declared` raises, and :class:`~pg_core.errors.BackendUnavailableError`
        with the backend's reason and the backends that are available instead.
        """
        with self._lock:
            spec = self.declared(name, device)
            error = self.unavailable_error(spec, device)
            if error is not None:
                raise error
            return spec

    def declared(self, name: str, device: str | None = None) -> BackendSpec:
        """:meth:`get`, then insist that the backend declares ``device``; whether it can run
        here is not asked (a group defers that to the first use of the device type).

        Raises what :meth:`get` raises, and :class:`~pg_core.errors.NotSupportedError` if the
        backend does not declare ``device``, naming the ones that serve it.
        """
        with self._lock:
            spec = self.get(name)
            if device is not None and device not in spec.devices:
                raise NotSupportedError(
                    f"Backend {spec.name!r} does not support device {device!r}: it declares "
                    f"{', '.join(spec.devices)}. {self._alternatives(device, exclude=spec.name)}"
                )
            return spec

    def why_unavailable(self, spec: BackendSpec) -> str | None:
        """``spec.why_unavailable()``, probed once per spec and remembered until :meth:`refresh`."""
        with self._lock:
            return self._why_unavailable(spec)

    def unavailable_error(self, spec: BackendSpec, device: str | None = None) -> BackendUnavailableError | None:
        """``None`` if ``spec`` can run here, else the error that says why, with the backends
        available instead (for ``device``, where given)."""
        with self._lock:
            reason = self._why_unavailable(spec)
            if reason is None:
                return None
            return BackendUnavailableError(
                f"Backend {spec.name!r} is installed but unavailable: {clause(reason)}. "
                f"{self._alternatives(device, exclude=spec.name)}"
            )

    def available_for(self, device: str) -> list[BackendSpec]:
        """Available backends declaring ``device``, highest priority first, then by name.

        Conflicting, broken and disabled ones are left out.
        """
        with self._lock:
            specs = [
                v.record.spec
                for v in self._views()
                if v.status == "ok"
                and v.record.spec is not None
                and device in v.record.spec.devices
                and self._why_unavailable(v.record.spec) is None
            ]
            return sorted(specs, key=lambda s: (-s.priority, s.name))

    def default_for(self, device: str) -> BackendSpec:
        """The backend used for ``device`` when the user names none: the first of :meth:`available_for`.

        Raises :class:`~pg_core.errors.BackendNotFoundError` saying what is
        installed and why none of it serves ``device``.
        """
        with self._lock:
            available = self.available_for(device)
            if available:
                return available[0]
            views = self._views()
            if not views:
                raise BackendNotFoundError(
                    f"No backend is installed, so none can serve device {device!r}: {_PIP_HINT}."
                )
            reasons = []
            for view in views:
                record, spec = view.record, view.record.spec
                head = f"{record.name} ({record.label})"
                if view.status == "ok" and spec is not None:
                    why = self._why_unavailable(spec)
                    if device not in spec.devices:
                        reasons.append(f"{head}: declares {', '.join(spec.devices)}, not {device!r}")
                    else:
                        reasons.append(f"{head}: unavailable: {clause(why)}")
                else:
                    reasons.append(f"{head}: {view.status}: {clause(view.reason)}")
            hint = ""
            if device == "cpu" and not any(_canonical(v.record.distribution or "") == "pg-tcp" for v in views):
                hint = " `pip install pg-core[tcp]` gives the pure-Python default."
            raise BackendNotFoundError(
                f"No installed backend is available for device {device!r}. Installed: {'; '.join(reasons)}.{hint}"
            )

    def describe_defaults(self) -> str:
        """What ``backends=None`` picks here, one line per device type that has an available
        backend (``pg-core backends`` prints it): the chosen one and, where there is another,
        what a group gets whose members the chosen one refuses (pg-shm: members on several
        hosts)."""
        with self._lock:
            devices = sorted({d for v in self._views() if v.record.spec is not None for d in v.record.spec.devices})
            lines = []
            for device in devices:
                chain = self.available_for(device)
                if not chain:
                    continue
                first = chain[0]
                line = f"{device}: {first.name}"
                if len(chain) > 1:
                    line += f", else {chain[1].name} for a group whose members {first.name} refuses"
                    if first.description:
                        line += f" ({first.name}: {first.description})"
                lines.append(line)
            return "\n".join(lines)

    # -- changing ----------------------------------------------------------------------
    def register(self, spec: BackendSpec, *, override: bool = False) -> None:
        """Add a backend in this process (not through an entry point).

        A name already provided raises :class:`~pg_core.errors.PluginConflictError`
        unless ``override=True``, which makes this spec the one used for the name
        (the others are listed as ``disabled``). A spec for another major version
        of the backend API raises :class:`~pg_core.errors.PluginVersionError`.
        """
        if not isinstance(spec, BackendSpec):
            raise TypeError(f"register() takes a pg_core.BackendSpec, got {type(spec).__name__}: {spec!r}")
        mismatch = api_version_error(spec, "register()", spec.distribution)
        if mismatch is not None:
            raise mismatch[0]
        with self._lock:
            self._ensure_discovered()
            if not override:
                if any(r.spec is spec for r in self._registered):
                    return  # the same spec twice: nothing to do
                providers = [
                    v.record for v in self._views() if v.status in ("ok", "conflict") and v.record.name == spec.name
                ]
                if providers:
                    labels = ", ".join(r.label for r in providers)
                    raise PluginConflictError(
                        f"Backend {spec.name!r} is already provided by {labels}; pass override=True to "
                        f"register_backend() to use yours in this process, or give yours another name.",
                        name=spec.name,
                        distributions=[r.distribution or _IN_PROCESS for r in providers] + [_IN_PROCESS],
                    )
            else:
                self._registered = [r for r in self._registered if r.name != spec.name]
            self._registered.append(
                _Record(
                    name=spec.name,
                    state="ok",
                    distribution=spec.distribution,
                    version=spec.version,
                    spec=spec,
                    in_process=True,
                    override=override,
                )
            )

    def refresh(self) -> None:
        """Discover entry points again (after a ``pip install`` in this process) and forget
        cached availability. In-process registrations are kept."""
        with self._lock:
            importlib.invalidate_caches()
            self._availability.clear()
            if self._load_entry_points:
                self._discovered = False
                self._ensure_discovered()

    # -- internals -------------------------------------------------------------------------
    def _why_unavailable(self, spec: BackendSpec) -> str | None:
        key = id(spec)
        cached = self._availability.get(key)
        if cached is None or cached[0]() is not spec:
            ref = weakref.ref(spec, lambda dead: self._forget(key, dead))
            cached = self._availability[key] = (ref, spec.why_unavailable())
        return cached[1]

    def _forget(self, key: int, dead: weakref.ref[BackendSpec]) -> None:
        # no lock: the collector may call this on any thread, and a dict's get and pop are atomic
        entry = self._availability.get(key)
        if entry is not None and entry[0] is dead:
            self._availability.pop(key, None)

    def _ensure_discovered(self) -> None:
        if self._discovered or self._discovering:
            return  # _discovering: a plugin registers a backend while being imported
        self._discovering = True
        try:
            self._plugins = list(self._discover())
            self._discovered = True
        finally:
            self._discovering = False

    def _views(self) -> list[_View]:
        """Every record with its status: shadowed by an override, in conflict, or as found."""
        self._ensure_discovered()
        records = self._plugins + self._registered
        overridden = {r.name for r in self._registered if r.override}
        active: dict[str, list[_Record]] = {}
        for record in records:
            if record.state == "ok" and (record.in_process or record.name not in overridden):
                active.setdefault(record.name, []).append(record)
        views = []
        for record in records:
            if record.state != "ok":
                views.append(_View(record, record.state, record.reason))
            elif not record.in_process and record.name in overridden:
                views.append(_View(record, "disabled", "overridden in-process by register_backend(override=True)"))
            elif len(providers := active[record.name]) > 1:
                others = ", ".join(r.label for r in providers if r is not record)
                dist = record.distribution or next((r.distribution for r in providers if r.distribution), None)
                pin = f"pin one, e.g. '{record.name}@{dist}'" if dist else "register yours under another name"
                views.append(_View(record, "conflict", f"also provided by {others}; {pin}"))
            else:
                views.append(_View(record, "ok", None))
        return views

    def _conflict_error(self, name: str, records: list[_Record]) -> PluginConflictError:
        dists = [r.distribution or _IN_PROCESS for r in records]
        named = [r.distribution for r in records if r.distribution]
        how = []
        if named:
            how.append(f"pin one as {' or '.join(repr(f'{name}@{d}') for d in named)}")
            how.append(
                f"stop loading the other{'s' if len(named) > 2 else ''} with {DISABLE_ENV}={','.join(named[1:])} "
                f"(or list the plugins to load in {PLUGINS_ENV})"
                if len(named) > 1
                else f"stop loading it with {DISABLE_ENV}={named[0]}"
            )
        if len(named) < len(records):
            how.append("register yours under another name")
        how.append("uninstall all but one")
        return PluginConflictError(
            f"Backend {name!r} is provided by {len(records)} distributions: "
            f"{', '.join(r.label for r in records)}. To use it, {', '.join(how[:-1])}, or {how[-1]}.",
            name=name,
            distributions=dists,
        )

    def _raise_broken(self, views: list[_View], name: str, pin: str | None) -> None:
        for view in views:
            record = view.record
            if view.status != "broken" or record.error is None:
                continue
            if pin is not None and _canonical(record.distribution or "") != _canonical(pin):
                continue
            # a spec-level failure knows the backend name; a load failure only the entry-point name
            if record.name == name or (record.spec is None and _canonical(record.name) == _canonical(name)):
                raise _fresh(record.error) from record.error.__cause__

    def _raise_disabled(self, views: list[_View], name: str, pin: str | None) -> None:
        for view in views:
            record = view.record
            if view.status != "disabled" or _canonical(record.name) != _canonical(name):
                continue
            if pin is not None and _canonical(record.distribution or "") != _canonical(pin):
                continue
            raise BackendNotFoundError(f"Backend {name!r} from {record.label} is disabled: {clause(view.reason)}.")

    def _unknown_message(self, views: list[_View], name: str) -> str:
        if not views:
            return f"Unknown backend {name!r}: no backend is installed. {_PIP_HINT}."
        installed: dict[str, list[str]] = {}
        for view in views:
            if view.status in ("ok", "conflict"):
                installed.setdefault(view.record.name, []).append(view.record.label)
        parts = [f"Unknown backend {name!r}."]
        if installed:
            parts.append(
                "Installed: " + ", ".join(f"{n} ({', '.join(ls)})" for n, ls in sorted(installed.items())) + "."
            )
        else:
            parts.append("No usable backend is installed.")
        broken = [f"{v.record.name} ({v.record.label}): {clause(v.reason)}" for v in views if v.status == "broken"]
        if broken:
            parts.append("Broken: " + "; ".join(broken) + ".")
        disabled = [f"{v.record.name} ({v.record.label})" for v in views if v.status == "disabled"]
        if disabled:
            parts.append(f"Disabled ({PLUGINS_ENV} / {DISABLE_ENV}): " + ", ".join(disabled) + ".")
        close = difflib.get_close_matches(name.partition("@")[0], sorted(installed), n=1)
        if close:
            parts.append(f"Did you mean {close[0]!r}?")
        return " ".join(parts)

    def _alternatives(self, device: str | None, *, exclude: str) -> str:
        if device is not None:
            names = [s.name for s in self.available_for(device) if s.name != exclude]
            return f"Installed and available for {device!r}: {', '.join(names) if names else 'none'}."
        names = [
            f"{v.record.spec.name} ({', '.join(v.record.spec.devices)})"
            for v in self._views()
            if v.status == "ok"
            and v.record.spec is not None
            and v.record.name != exclude
            and self._why_unavailable(v.record.spec) is None
        ]
        return f"Installed and available: {', '.join(names) if names else 'none'}."

    # -- discovery -----------------------------------------------------------------------------
    def _discover(self) -> Iterator[_Record]:
        """Load every entry point of the group, each in its own guard."""
        import importlib_metadata

        environ = os.environ if self._environ is None else self._environ
        allow_raw, deny_raw = environ.get(PLUGINS_ENV, ""), environ.get(DISABLE_ENV, "")
        allow, deny = _parse_list(allow_raw), _parse_list(deny_raw)

        # (distribution, entry point), first on sys.path wins: one distribution seen
        # twice (editable + regular install) is one plugin, not a conflict.
        found: list[tuple[EntryPoint, str | None, str | None]] = []
        seen_dists: set[str] = set()
        for dist in importlib_metadata.distributions():
            try:
                eps = list(dist.entry_points.select(group=ENTRY_POINT_GROUP))
                if not eps:
                    continue
                name: str | None = dist.metadata["Name"]
                version: str | None = dist.version
            except Exception:
                continue  # unreadable metadata of some unrelated distribution
            key = _canonical(name) if name else f"?{len(seen_dists)}"
            if key in seen_dists:
                continue
            seen_dists.add(key)
            found.extend((ep, name, version) for ep in eps)

        found.sort(key=lambda item: (_canonical(item[1] or ""), item[0].name))  # listing order, not disk order

        # allow-list items naming no entry point and no distribution may be backend names:
        # then entry points they do not name are imported to learn their backends' names.
        known = {_canonical(ep.name) for ep, _, _ in found} | {_canonical(d) for _, d, _ in found if d}
        allow_by_backend = bool(allow - known)

        manager = _PluginManager("pg_core")
        manager.add_hookspecs(PluginSpecs)
        results: dict[int, list[BackendSpec] | Exception] = {}
        seen_specs: set[tuple[str, str]] = set()
        for ep, dist_name, version in found:
            base = _Record(
                name=ep.name,
                state="disabled",
                distribution=dist_name,
                version=version,
                entry_point=f"{ep.name} = {ep.value}",
            )
            named = {_canonical(ep.name), _canonical(dist_name or "")}
            if allow and not (named & allow) and not allow_by_backend:
                yield dataclasses.replace(base, reason=f"not in {PLUGINS_ENV}={allow_raw}")
                continue
            if named & deny:
                yield dataclasses.replace(base, reason=f"named in {DISABLE_ENV}={deny_raw}")
                continue
            specs = self._load(manager, ep, base, results)
            if isinstance(specs, _Record):
                yield specs
                continue
            for spec in specs:
                if (_canonical(dist_name or ""), spec.name) in seen_specs:
                    continue  # the same distribution providing one name twice
                seen_specs.add((_canonical(dist_name or ""), spec.name))
                record = dataclasses.replace(base, name=spec.name, state="ok", spec=spec)
                try:
                    filled = dataclasses.replace(spec, distribution=dist_name, version=version)
                    mismatch = api_version_error(filled, base.label, dist_name)
                except Exception as exc:  # a spec subclass with its own ideas
                    error = PluginLoadError(
                        f"Backend {spec.name!r} from {base.label}: {error_text(exc)}", distribution=dist_name
                    )
                    error.__cause__ = exc
                    yield dataclasses.replace(record, state="broken", reason=error_text(exc), error=error)
                    continue
                record.spec = filled
                if mismatch is not None:
                    yield dataclasses.replace(record, state="broken", reason=mismatch[1], error=mismatch[0])
                elif allow and not (named & allow) and _canonical(spec.name) not in allow:
                    yield dataclasses.replace(record, state="disabled", reason=f"not in {PLUGINS_ENV}={allow_raw}")
                elif _canonical(spec.name) in deny:
                    yield dataclasses.replace(record, state="disabled", reason=f"named in {DISABLE_ENV}={deny_raw}")
                else:
                    yield record

    def _load(
        self,
        manager: pluggy.PluginManager,
        ep: EntryPoint,
        base: _Record,
        results: dict[int, list[BackendSpec] | Exception],
    ) -> list[BackendSpec] | _Record:
        """Import one entry point and call its hook: its specs, or a broken record."""
        try:
            plugin = ep.load()
            if id(plugin) not in results:  # two entry points may name one module
                results[id(plugin)] = self._call_hook(manager, plugin, base)
            outcome = results[id(plugin)]
            if isinstance(outcome, Exception):
                raise outcome
            return outcome
        except Exception as exc:
            error = PluginLoadError(
                f"Plugin {base.entry_point!r} from {base.label} failed to load: {error_text(exc)}. "
                f"Other backends are unaffected; fix or uninstall {base.distribution or 'it'}, "
                f"or skip it with {DISABLE_ENV}={base.name}.",
                distribution=base.distribution,
            )
            error.__cause__ = exc
            return dataclasses.replace(base, state="broken", reason=error_text(exc), error=error)

    def _call_hook(self, manager: pluggy.PluginManager, plugin: object, base: _Record) -> list[BackendSpec] | Exception:
        try:
            manager.register(plugin, name=f"{base.distribution}:{base.entry_point}")
        except Exception as exc:
            if manager.is_registered(plugin):
                manager.unregister(plugin)
            return exc
        others = [p for p in manager.get_plugins() if p is not plugin]
        caller = manager.subset_hook_caller(HOOK_NAME, remove_plugins=others)
        if not caller.get_hookimpls():
            return TypeError(f"{base.entry_point!r} has no {HOOK_NAME}() hook")
        try:
            returned = caller()
        except Exception as exc:
            return exc
        if not returned:
            return TypeError(f"{HOOK_NAME}() of {base.entry_point!r} returned None; expected a list of BackendSpec")
        specs: list[BackendSpec] = []
        for result in returned:
            if isinstance(result, (str, bytes, BackendSpec)) or not isinstance(result, Iterable):
                return TypeError(
                    f"{HOOK_NAME}() of {base.entry_point!r} returned {result!r} ({type(result).__name__}); "
                    f"expected a list of BackendSpec"
                )
            items = list(result)  # a generator may raise here: caught by _load
            for item in items:
                if not isinstance(item, BackendSpec):
                    return TypeError(
                        f"{HOOK_NAME}() of {base.entry_point!r} returned {item!r} ({type(item).__name__}) "
                        f"in its list; expected BackendSpec"
                    )
            specs.extend(items)
        return specs


# -- the process-wide registry ----------------------------------------------------------
# The one piece of module-level mutable state in pg-core: a cache of what is installed.

_default_registry: Registry | None = None
_default_registry_lock = threading.Lock()


def default_registry() -> Registry:
    """The process-wide registry, created (not yet discovered) on first call."""
    global _default_registry
    registry = _default_registry
    if registry is None:
        with _default_registry_lock:
            if _default_registry is None:
                _default_registry = Registry()
            registry = _default_registry
    return registry


def register_backend(spec: BackendSpec, *, override: bool = False) -> None:
    """Add a backend to the process-wide registry; see :meth:`Registry.register`."""
    default_registry().register(spec, override=override)


# -- moved ------------------------------------------------------------------------------------


def __getattr__(name: str) -> Any:
    """The command-line reference resolver moved to :mod:`pg_core.backend_refs`; its two names
    are still found here for the importers that predate the move."""
    if name in ("resolve_backend_ref", "absolute_backend_ref"):
        from . import backend_refs

        return getattr(backend_refs, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
