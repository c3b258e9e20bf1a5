"""Every error pg-core raises on purpose derives from :class:`PGError`.

Local validation failures (a rank out of range, a list of the wrong length, a
wrong type) are plain :class:`ValueError` / :class:`TypeError`, raised before any
byte is sent, because that is what a Python user catches for bad arguments.

What torch raises as a ``RuntimeError`` (its ``DistBackendError``, ``DistNetworkError``) is one
here too, beside the builtin that says what it is: a group closed, a peer gone
(``ConnectionError``), a timeout (``TimeoutError``), a mismatch. So torch's habit
``except RuntimeError`` catches them, and ``except TimeoutError`` still does what it says.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterable, Sequence

__all__ = [
    "AuthenticationError",
    "BackendNotFoundError",
    "BackendUnavailableError",
    "CollectiveMismatchError",
    "CollectiveTimeout",
    "ForbiddenObjectError",
    "GroupClosedError",
    "NotSupportedError",
    "PGError",
    "PeerFailureError",
    "PluginConflictError",
    "PluginError",
    "PluginLoadError",
    "PluginVersionError",
    "StoreUnavailableError",
    "warn_user",
]


class PGError(Exception):
    """Base class of every pg-core error."""


class BackendNotFoundError(PGError, LookupError):
    """No installed plugin provides the requested backend name."""


class BackendUnavailableError(PGError):
    """The backend is installed but cannot run here (no CUDA, no MPI launch, ...)."""


class PluginError(PGError):
    """A plugin distribution is broken; the message names the distribution."""

    def __init__(self, message: str, *, distribution: str | None = None) -> None:
        super().__init__(message)
        self.distribution = distribution


class PluginLoadError(PluginError):
    """Importing a plugin's entry point, or calling its hook, failed."""


class PluginConflictError(PluginError):
    """Two distributions provide a backend of the same name and none is pinned."""

    def __init__(self, message: str, *, name: str, distributions: Sequence[str]) -> None:
        super().__init__(message, distribution=", ".join(distributions))
        self.name = name
        self.distributions = tuple(distributions)


class PluginVersionError(PluginError):
    """A plugin was written for another major version of the backend API."""


class NotSupportedError(PGError):
    """The op / device / dtype / reduce op is outside the backend's declared capabilities.

    Raised locally, before anything is sent.
    """


class GroupClosedError(PGError, RuntimeError):
    """The group (or backend) was shut down or aborted."""


class PeerFailureError(PGError, ConnectionError, RuntimeError):
    """A peer died or closed its connection while this rank depended on it."""

    def __init__(self, message: str, *, peers: Iterable[int] = ()) -> None:
        super().__init__(message)
        self.peers = tuple(sorted(set(peers)))


class StoreUnavailableError(PeerFailureError):
    """The store is gone: the connection to it broke, almost always because the process
    hosting it exited. A :class:`PeerFailureError` (the peer lost being the store's host),
    so code that handles a failed peer handles it too. ``address`` is the store's
    ``host:port`` where known."""

    def __init__(self, message: str, *, address: str | None = None, peers: Iterable[int] = ()) -> None:
        super().__init__(message, peers=peers)
        self.address = address


class AuthenticationError(PGError):
    """Something that should come from a member of this authenticated job does not: a store
    value whose MAC does not match the job's secret (``key`` names the store key), or a peer
    that failed to prove it holds the secret."""

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class ForbiddenObjectError(PGError):
    """A received object names a class or function that the group's restricted object
    loading (``objects="restricted"``) does not allow; ``name`` is ``module.qualname``.
    Raised before anything of it is called."""

    def __init__(self, message: str, *, name: str) -> None:
        super().__init__(message)
        self.name = name


class CollectiveMismatchError(PGError, RuntimeError):
    """Ranks called different ops, shapes, dtypes or roots at the same sequence number."""

    def __init__(self, message: str, *, peers: Iterable[int] = ()) -> None:
        super().__init__(message)
        self.peers = tuple(sorted(set(peers)))


class CollectiveTimeout(PGError, TimeoutError, RuntimeError):
    """An operation exceeded its timeout.

    ``op`` is the operation's name, ``seq`` its sequence number in its group (or
    ``None`` where unknown) and ``peers`` the group ranks not heard from.

    Its text says "Timed out", torch's words, which torch's tests and its users grep for: a
    raiser words it ``Timed out after 2 s in all_reduce (collective #3); ...``, and where a
    message (a plugin's, one a handler rewrote) does not say it, ``str()`` puts ``Timed out:``
    in front.
    """

    def __init__(
        self,
        message: str,
        *,
        op: str | None = None,
        seq: int | None = None,
        peers: Iterable[int] = (),
    ) -> None:
        super().__init__(message)
        self.op = op
        self.seq = seq
        self.peers = tuple(sorted(set(peers)))

    def __str__(self) -> str:
        text = super().__str__()
        return text if "Timed out" in text else f"Timed out: {text}"


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def warn_user(message: str, category: type[Warning] = RuntimeWarning) -> None:
    """``warnings.warn`` pointing at the first frame outside pg-core: the user's line that led
    here (``group.shutdown()``, or the end of a ``with`` block), however deep inside pg-core the
    warning is raised."""
    level, frame = 2, sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
