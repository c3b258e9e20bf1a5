"""pg-core: object-oriented, global-state-free process groups for PyTorch.

The public names below are imported on first use (PEP 562), so importing ``pg_core`` or a
torch-free module of it (``pg_core.launch``: the ``pgrun`` command) does not import torch:
``pgrun`` starts its ranks without paying for torch first. ``from pg_core import
ProcessGroup`` imports what it names, as any import would.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import errors as _errors

if TYPE_CHECKING:
    from .auth import AuthKey
    from .backend import API_VERSION, Backend, BackendContext, BackendSpec, Capabilities
    from .errors import (
        AuthenticationError,
        BackendNotFoundError,
        BackendUnavailableError,
        CollectiveMismatchError,
        CollectiveTimeout,
        ForbiddenObjectError,
        GroupClosedError,
        NotSupportedError,
        PeerFailureError,
        PGError,
        PluginConflictError,
        PluginError,
        PluginLoadError,
        PluginVersionError,
        StoreUnavailableError,
    )
    from .group import P2POp, ProcessGroup, rendezvous
    from .ops import RedOpType, ReduceOp
    from .registry import PluginEntry, Registry, default_registry, register_backend
    from .store import FileStore, HashStore, PrefixStore, Store, StoreServer, TCPStore
    from .torch_world import device_mesh
    from .work import Work

__version__ = "0.1.0"

#: Each public name -> the module that defines it.
_HOME: dict[str, str] = {
    "AuthKey": "auth",
    **dict.fromkeys(("API_VERSION", "Backend", "BackendContext", "BackendSpec", "Capabilities"), "backend"),
    # every error class of pg_core.errors (a torch-free module: importing it here costs nothing)
    **dict.fromkeys((n for n in _errors.__all__ if isinstance(getattr(_errors, n), type)), "errors"),
    **dict.fromkeys(("P2POp", "ProcessGroup", "rendezvous"), "group"),
    **dict.fromkeys(("RedOpType", "ReduceOp"), "ops"),
    **dict.fromkeys(("PluginEntry", "Registry", "default_registry", "register_backend"), "registry"),
    **dict.fromkeys(("FileStore", "HashStore", "PrefixStore", "Store", "StoreServer", "TCPStore"), "store"),
    "Work": "work",
    "device_mesh": "torch_world",
}

__all__ = [
    "API_VERSION",
    "AuthKey",
    "AuthenticationError",
    "Backend",
    "BackendContext",
    "BackendNotFoundError",
    "BackendSpec",
    "BackendUnavailableError",
    "Capabilities",
    "CollectiveMismatchError",
    "CollectiveTimeout",
    "FileStore",
    "ForbiddenObjectError",
    "GroupClosedError",
    "HashStore",
    "NotSupportedError",
    "P2POp",
    "PGError",
    "PeerFailureError",
    "PluginConflictError",
    "PluginEntry",
    "PluginError",
    "PluginLoadError",
    "PluginVersionError",
    "PrefixStore",
    "ProcessGroup",
    "RedOpType",
    "ReduceOp",
    "Registry",
    "Store",
    "StoreServer",
    "StoreUnavailableError",
    "TCPStore",
    "Work",
    "default_registry",
    "device_mesh",
    "register_backend",
    "rendezvous",
]


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is not None:
        value = getattr(importlib.import_module(f".{home}", __name__), name)
    else:  # a submodule, as `import pg_core; pg_core.errors` found it when this module imported them all
        try:
            value = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise  # the submodule exists and failed to import: that is the error to see
            raise AttributeError(f"module 'pg_core' has no attribute {name!r}") from None
    globals()[name] = value  # later lookups do not come back here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOME})
