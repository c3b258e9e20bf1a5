"""Stores: torch's c10d key-value stores, re-exported, and the helpers groups use on them.

pg-core uses torch's stores unchanged (``TCPStore``, ``FileStore``, ``HashStore``,
``PrefixStore``), so a store created for torch.distributed, torchrun's, or
vLLM's, serves pg-core groups too. Groups never write outside their own prefix.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

from torch.distributed import FileStore, HashStore, PrefixStore, Store, TCPStore

from .errors import CollectiveTimeout
from .timeouts import Deadline

__all__ = [
    "FileStore",
    "HashStore",
    "PolledStore",
    "PrefixStore",
    "Store",
    "TCPStore",
    "advertise_address",
    "store_host",
    "wait_any",
    "wait_for",
]


def store_host(store: Store) -> str | None:
    """The host a ``TCPStore`` (possibly behind ``PrefixStore`` wrappers) connects to,
    or ``None`` for stores that live in one host's memory or file system."""
    seen = 0
    while isinstance(store, PrefixStore) and seen < 64:
        store = store.underlying_store
        seen += 1
    if isinstance(store, TCPStore):
        return str(store.host)
    return None


def advertise_address(store: Store, override: str | None = None) -> str:
    """The local IP address peers should use to reach this process.

    ``override`` (or the ``PG_CORE_ADDR`` environment variable) wins. Otherwise it
    is the address of the interface that routes to the store's host: loopback
    when the store is local, so single-host jobs never leave the machine. No
    packet is sent to find it.
    """
    chosen = override or os.environ.get("PG_CORE_ADDR")
    if chosen:
        return chosen
    host = store_host(store)
    if host is None:
        return "127.0.0.1"
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)
    except socket.gaierror:
        return "127.0.0.1"
    for family, _, _, _, addr in infos:
        ip = ipaddress.ip_address(addr[0])
        if ip.is_loopback:
            return "127.0.0.1" if family == socket.AF_INET else "::1"
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            try:
                probe.connect((addr[0], 9))  # UDP connect: picks a route, sends nothing
            except OSError:
                continue
            return str(probe.getsockname()[0])
    return "127.0.0.1"


_T = TypeVar("_T")
_POLL_FIRST_S = 0.0002
_POLL_MAX_S = 0.01


def wait_for(store: Store, keys: list[str], timeout: float, *, what: str = "a store wait") -> None:
    """Wait until every key in ``keys`` is set, at most ``timeout`` seconds, by
    polling ``store.check`` (0.2 ms, doubling to 10 ms); past it, raise
    :class:`~pg_core.errors.CollectiveTimeout` naming ``what`` waited (say, ``"group 'world'
    rank 1: connect to rank 2"``) and the keys still missing.

    Use this rather than ``store.wait`` or a ``store.get`` of a key that may not
    exist yet on a store other threads use: a ``TCPStore`` client serves one
    request at a time, and those block it until the key appears, so two groups
    forming at once on threads that share one store would stall each other.
    """
    if _poll(lambda: True if store.check(keys) else None, timeout) is None:
        missing = [k for k in keys if not store.check([k])]
        raise CollectiveTimeout(
            f"{what}: waited {timeout:g} s for the store keys {', '.join(missing)}, which no member set; is every "
            "member running, with the same group name and store?",
            op=what,
        )


class PolledStore(Store):
    """A store as a torch C++ backend's rendezvous (Gloo's, NCCL's) should see it: ``wait``
    and ``get`` poll through :func:`wait_for` instead of blocking the client, so a backend
    built on a store the group shares with groups forming at once on other threads never
    stalls them. ``timeout`` (seconds) bounds every wait, with ``what`` in its error."""

    def __init__(self, inner: Store, timeout: float, what: str = "a backend's rendezvous") -> None:
        super().__init__()
        self._inner, self._timeout, self._what = inner, timeout, what

    def set(self, key: str, value: Any) -> None:
        self._inner.set(key, value)

    def get(self, key: str) -> bytes:
        wait_for(self._inner, [key], self._timeout, what=self._what)
        return self._inner.get(key)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        wait_for(self._inner, list(keys), self._timeout, what=self._what)

    def check(self, keys: list[str]) -> bool:
        return self._inner.check(keys)

    def add(self, key: str, amount: int) -> int:
        return self._inner.add(key, amount)


def wait_any(store: Store, keys: list[str], timeout: float) -> str | None:
    """The first key of ``keys`` found set, polled like :func:`wait_for`; ``None`` if none
    was within ``timeout`` seconds."""

    def first() -> str | None:
        return next((k for k in keys if store.check([k])), None)

    return _poll(first, timeout)


def _poll(found: Callable[[], _T | None], timeout: float) -> _T | None:
    deadline = Deadline("store wait", timeout)
    delay = _POLL_FIRST_S
    while (value := found()) is None:
        left = deadline.remaining()
        if left <= 0:
            return None
        time.sleep(min(delay, left))  # a bounded poll of the store, not a synchronisation
        delay = min(delay * 2, _POLL_MAX_S)
    return value
