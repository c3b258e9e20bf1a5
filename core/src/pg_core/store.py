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
from datetime import timedelta

from torch.distributed import DistStoreError, FileStore, HashStore, PrefixStore, Store, TCPStore

__all__ = [
    "FileStore",
    "HashStore",
    "PollingStore",
    "PrefixStore",
    "Store",
    "TCPStore",
    "advertise_address",
    "shareable",
    "store_host",
    "wait_for",
]


def store_host(store: Store) -> str | None:
    """The host a ``TCPStore`` (possibly behind ``PrefixStore`` wrappers) connects to,
    or ``None`` for stores that live in one host's memory or file system."""
    seen = 0
    while isinstance(store, (PrefixStore, PollingStore)) and seen < 64:
        store = store.underlying_store if isinstance(store, PrefixStore) else store.inner
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


class PollingStore(Store):
    """The same store, waited on by polling, so one client can serve many threads.

    A ``TCPStore`` client serves one request at a time, and its blocking ``wait``
    (and ``get`` of a missing key) holds the client until the key appears: two
    groups forming at once on threads that share one store would stall each
    other until the timeout. Here ``wait`` and ``get`` poll ``check`` with a short
    backoff (0.2 ms doubling to 10 ms), so every request is brief. Opening a new
    connection per group instead would cost a socket each, and torch's client
    connect sometimes takes 5 s. Everything else goes straight to ``inner``.
    """

    _FIRST_S = 0.0002
    _MAX_S = 0.01

    def __init__(self, inner: Store) -> None:
        super().__init__()
        self.inner = inner
        self.set_timeout(inner.timeout)

    def set(self, key: str, value: str | bytes) -> None:
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        if not self.inner.check([key]):
            self.wait([key])
        return self.inner.get(key)

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(key, amount)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return self.inner.compare_set(key, expected, desired)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        limit = (timeout if timeout is not None else self.timeout).total_seconds()
        deadline = time.monotonic() + limit
        delay = self._FIRST_S
        while not self.inner.check(keys):
            left = deadline - time.monotonic()
            if left <= 0:
                raise DistStoreError(f"wait timeout after {limit * 1000:.0f}ms, keys: {', '.join(keys)}")
            time.sleep(min(delay, left))  # a bounded poll of the store, not a synchronisation
            delay = min(delay * 2, self._MAX_S)


def shareable(store: Store) -> Store:
    """``store`` made safe to share between threads (see :class:`PollingStore`).

    Stores backed by a ``TCPStore`` client are wrapped; in-memory and file stores,
    whose waits hold nothing, are returned as they are.
    """
    if isinstance(store, PollingStore) or store_host(store) is None:
        return store
    return PollingStore(store)


def wait_for(store: Store, keys: list[str], timeout: float) -> None:
    """``store.wait(keys)`` bounded by ``timeout`` seconds (raises ``TimeoutError``-like
    ``torch.distributed.DistStoreError`` past it)."""
    store.wait(keys, timedelta(seconds=timeout))
