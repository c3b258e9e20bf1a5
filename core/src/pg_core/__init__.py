"""pg-core: object-oriented, global-state-free process groups for PyTorch."""

from __future__ import annotations

from .backend import API_VERSION, Backend, BackendContext, BackendSpec, Capabilities
from .errors import (
    BackendNotFoundError,
    BackendUnavailableError,
    CollectiveMismatchError,
    CollectiveTimeout,
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
from .work import Work

__version__ = "0.1.0"

__all__ = [
    "API_VERSION",
    "Backend",
    "BackendContext",
    "BackendNotFoundError",
    "BackendSpec",
    "BackendUnavailableError",
    "Capabilities",
    "CollectiveMismatchError",
    "CollectiveTimeout",
    "FileStore",
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
    "register_backend",
    "rendezvous",
]
