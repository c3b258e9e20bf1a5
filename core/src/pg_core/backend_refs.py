"""Backend references on command lines: what ``pg-core conformance``, ``pg-core bench``,
``pgrun`` and the conformance ranks take as a backend, turned into a spec here
(:func:`resolve_backend_ref`), and made absolute for a process that may run elsewhere
(:func:`absolute_backend_ref`).

A reference is a registered name (looked up in a :class:`~pg_core.registry.Registry`),
``package.module:ATTR``, or ``path/to/file.py:ATTR`` (a file installed nowhere). A Backend
subclass or factory gets its spec from :func:`pg_core.dispatch.factory_spec`, the rule
``backends=`` uses too.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from typing import Any, Final

from .backend import Backend, BackendSpec
from .dispatch import factory_spec
from .errors import BackendNotFoundError, BackendUnavailableError, NotSupportedError, PluginLoadError
from .registry import Registry, api_version_error, clause, default_registry, error_text

__all__ = ["absolute_backend_ref", "resolve_backend_ref"]

#: sys.modules names of spec files loaded by :func:`resolve_backend_ref` start with this.
_FILE_MODULE_PREFIX: Final = "pg_core_backend_file_"


def resolve_backend_ref(
    ref: str,
    device: str | None = None,
    *,
    registry: Registry | None = None,
    factories: bool = True,
    here: bool = True,
    _available: bool = True,
) -> BackendSpec:
    """The backend that a command-line reference names, ready to use here. One function
    for every command that takes a backend (``pg-core conformance``, ``pg-core bench``):

    * ``"tcp"`` or ``"tcp@pg-tcp"``: a registered backend (:meth:`Registry.require`);
    * ``"package.module:ATTR"``: ``ATTR`` of an importable module;
    * ``"path/to/file.py:ATTR"``: ``ATTR`` of a Python file, not installed anywhere
      (loaded once per process under a private module name).

    ``ATTR`` (dotted for nested attributes) names a :class:`~pg_core.backend.BackendSpec`
    or, with ``factories=True``, a :class:`~pg_core.backend.Backend` subclass or a factory
    function, which gets its spec as ``backends=`` gives one
    (:func:`pg_core.dispatch.factory_spec`: named after itself, declaring the ``devices`` and
    ``capabilities`` attributes it has, default ``cpu`` and the default capabilities).

    With ``device``, the backend must declare it. Raises
    :class:`~pg_core.errors.BackendNotFoundError` for a reference that names nothing usable
    (the message names the module or file and the attribute, and lists what it does
    define), :class:`~pg_core.errors.PluginLoadError` if importing the module or running
    the file fails, :class:`~pg_core.errors.PluginVersionError` for a spec of another API
    major version, :class:`~pg_core.errors.NotSupportedError` /
    :class:`~pg_core.errors.BackendUnavailableError` as :meth:`Registry.require` does.

    ``here=False`` is for a process that starts the backend's ranks rather than being one: a
    backend that declares a ``launcher`` is then asked whether it can run in a process started
    through it (:func:`pg_core.launchers.why_unavailable_launched`), not in this one.
    """
    if not here:
        spec = resolve_backend_ref(ref, device, registry=registry, factories=factories, here=True, _available=False)
        if spec.launcher is None:
            reason = spec.why_unavailable()
        else:
            from .launchers import why_unavailable_launched

            reason = why_unavailable_launched(ref, spec.launcher)
        if reason is not None:
            raise BackendUnavailableError(f"Backend {spec.name!r} ({ref}) cannot run here: {clause(reason)}.")
        return spec
    if not isinstance(ref, str):
        raise TypeError(f"a backend reference is a str, got {type(ref).__name__}: {ref!r}")
    ref = ref.strip()
    if ":" not in ref:
        chosen = registry or default_registry()
        if not _available:
            spec = chosen.get(ref)
            if device is not None and device not in spec.devices:
                return chosen.require(ref, device)  # its error, naming the alternatives
            return spec
        return chosen.require(ref, device)
    where, _, attr = (part.strip() for part in ref.rpartition(":"))
    if not where or not attr or not all(part.isidentifier() for part in attr.split(".")):
        raise BackendNotFoundError(
            f"{ref!r} is not a backend reference: expected a backend name (see `pg-core backends`), "
            f"'package.module:ATTR' or 'path/to/file.py:ATTR'"
        )
    module, source = _load_ref_module(ref, where) if _is_file_ref(where) else _import_ref_module(ref, where)
    obj: Any = module
    parts = attr.split(".")
    for i, part in enumerate(parts):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            owner = source if i == 0 else f"{'.'.join(parts[:i])} in {source}"
            raise BackendNotFoundError(
                f"cannot load {ref!r}: {owner} defines no {part!r}. {_defined(obj, module.__name__, part)}"
            ) from None
    if isinstance(obj, BackendSpec):
        spec = obj
    elif factories and _is_factory(obj):
        spec = factory_spec(obj)
    else:
        wanted = "a BackendSpec" + (", a Backend subclass or a factory function" if factories else "")
        raise BackendNotFoundError(
            f"cannot load {ref!r}: {attr} in {source} is {_describe(obj)}, not {wanted}. "
            f"{_defined(module, module.__name__, attr)}"
        )
    mismatch = api_version_error(spec, source, None)
    if mismatch is not None:
        raise mismatch[0]
    if device is not None and device not in spec.devices:
        raise NotSupportedError(
            f"Backend {spec.name!r} ({ref}) does not support device {device!r}: it declares {', '.join(spec.devices)}."
        )
    reason = spec.why_unavailable() if _available else None
    if reason is not None:
        raise BackendUnavailableError(f"Backend {spec.name!r} ({ref}) cannot run here: {clause(reason)}.")
    return spec


def absolute_backend_ref(ref: str) -> str:
    """``ref`` as :func:`resolve_backend_ref` would read it here, for another process that
    may run in another working directory: a ``path/to/file.py:ATTR`` reference with its path
    made absolute (``~`` expanded, relative to the current directory); a name or a
    ``module:ATTR`` reference as it is. Both resolve to the same file in every process."""
    if not isinstance(ref, str):
        raise TypeError(f"a backend reference is a str, got {type(ref).__name__}: {ref!r}")
    ref = ref.strip()
    where, sep, attr = (part.strip() for part in ref.rpartition(":"))
    if not sep or not where or not _is_file_ref(where):
        return ref
    return f"{os.path.abspath(os.path.expanduser(where))}:{attr}"


def _is_file_ref(where: str) -> bool:
    """Whether the part of a reference before its last ``:`` names a file, not a module."""
    return where.endswith(".py") or os.sep in where or "/" in where


def _import_ref_module(ref: str, name: str) -> tuple[Any, str]:
    try:
        return importlib.import_module(name), f"module {name}"
    except ModuleNotFoundError as exc:
        if exc.name is not None and name.startswith(exc.name):  # the module itself, not one it imports
            hint = " (a file is named as path/to/file.py:ATTR)"
            raise BackendNotFoundError(f"cannot load {ref!r}: there is no module {name!r}{hint}") from None
        raise PluginLoadError(f"cannot load {ref!r}: importing {name} failed: {error_text(exc)}") from exc
    except Exception as exc:
        raise PluginLoadError(f"cannot load {ref!r}: importing {name} failed: {error_text(exc)}") from exc


def _load_ref_module(ref: str, where: str) -> tuple[Any, str]:
    path = os.path.abspath(os.path.expanduser(where))
    if not os.path.isfile(path):
        raise BackendNotFoundError(f"cannot load {ref!r}: there is no file {where}" + _resolved(where, path))
    name = _FILE_MODULE_PREFIX + hashlib.sha256(path.encode()).hexdigest()[:16]
    source = f"file {where}"
    module = sys.modules.get(name)
    if module is not None:
        return module, source
    loader_spec = importlib.util.spec_from_file_location(name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise BackendNotFoundError(f"cannot load {ref!r}: {where} is not a Python file Python can load")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module  # dataclasses and pickle look a module up by name while it runs
    try:
        loader_spec.loader.exec_module(module)
    except BaseException as exc:
        del sys.modules[name]
        if not isinstance(exc, Exception):
            raise
        raise PluginLoadError(f"cannot load {ref!r}: running {where} failed: {error_text(exc)}") from exc
    return module, source


def _resolved(given: str, path: str) -> str:
    return "" if given == path else f" ({path})"


def _is_factory(obj: object) -> bool:
    if isinstance(obj, type):
        return issubclass(obj, Backend)
    return callable(obj)


def _describe(obj: object) -> str:
    if isinstance(obj, BackendSpec):
        return f"a BackendSpec named {obj.name!r}"
    if isinstance(obj, type):
        return "a Backend subclass" if issubclass(obj, Backend) else "a class"
    if inspect.ismodule(obj):
        return "a module"
    if inspect.isfunction(obj):
        return "a function"
    kind = type(obj).__name__
    return f"{'an' if kind[:1] in 'aeiou' else 'a'} {kind}"


def _defined(owner: object, module_name: str, missing: str, limit: int = 12) -> str:
    """What ``owner`` (a module, or an object in it) defines, for an error message: backend
    specs, then Backend subclasses, then its other public names; what it imported is left out."""
    names = []
    for name, value in sorted(vars(owner).items()) if hasattr(owner, "__dict__") else []:
        if name.startswith("_") or inspect.ismodule(value) or type(value).__module__ == "typing":
            continue
        if (inspect.isclass(value) or inspect.isfunction(value)) and value.__module__ != module_name:
            continue  # imported, not defined here
        names.append(name)
    if not names:
        return "It defines nothing public."

    def order(name: str) -> tuple[int, str]:
        value = getattr(owner, name)
        return (0 if isinstance(value, BackendSpec) else 1 if _is_factory(value) else 2, name)

    names.sort(key=order)
    shown = [f"{n} ({_describe(getattr(owner, n)).partition(' ')[2]})" for n in names[:limit]]
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    text = f"It defines: {', '.join(shown)}{more}."
    close = [] if missing in names else difflib.get_close_matches(missing, names, n=1)
    return text + (f" Did you mean {close[0]!r}?" if close else "")
