"""Stores: torch's c10d key-value stores, re-exported, and the helpers groups use on them.

pg-core uses torch's stores unchanged (``TCPStore``, ``FileStore``, ``HashStore``,
``PrefixStore``), so a store created for torch.distributed, torchrun's, or
vLLM's, serves pg-core groups too. Groups never write outside their own prefix.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from datetime import timedelta

from torch.distributed import FileStore, HashStore, PrefixStore, Store, TCPStore

__all__ = [
    "FileStore",
    "HashStore",
    "PrefixStore",
    "Store",
    "TCPStore",
    "advertise_address",
    "store_host",
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


def private_connection(store: Store) -> Store:
    """A connection of this process's own to the same store, where the store can make one.

    A ``TCPStore`` client serves one request at a time, and a blocking ``wait``
    holds it until the key appears: threads that share one client stall each
    other. ``ProcessGroup`` therefore talks to the store over a clone (a new
    socket to the same server, behind the same prefixes). Stores that cannot be
    cloned, or live in memory, are used as they are.
    """
    clone = getattr(store, "clone", None)
    if clone is None:
        return store
    try:
        copy = clone()
    except Exception:  # HashStore and older torch: no clone; they are shared as they are
        return store
    return copy if copy is not None else store


def wait_for(store: Store, keys: list[str], timeout: float) -> None:
    """``store.wait(keys)`` bounded by ``timeout`` seconds (raises ``TimeoutError``-like
    ``torch.distributed.DistStoreError`` past it)."""
    store.wait(keys, timedelta(seconds=timeout))
