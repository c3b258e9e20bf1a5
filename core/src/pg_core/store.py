"""Stores: torch's c10d key-value stores, re-exported, and the helpers groups use on them.

pg-core uses torch's stores (``TCPStore``, ``FileStore``, ``HashStore``, ``PrefixStore``),
so a store created for torch.distributed, torchrun's, or vLLM's, serves pg-core groups too.
Groups never write outside their own prefix. ``pg_core.TCPStore`` *is* torch's, with one
difference for a client: it waits for the server in Python first (:func:`wait_for_server`),
so the wait is bounded by its ``timeout`` and Ctrl-C ends it.

A ``TCPStore`` lives as long as the process that hosts its server. :class:`StoreServer`
hosts one apart from the ranks; a group formed on a store sees it through
:class:`GuardedStore`, so that once the host is gone every rank meets
:class:`~pg_core.errors.StoreUnavailableError` saying so, not torch's ``DistNetworkError``.
In an authenticated job (:mod:`pg_core.auth`) it is formed on :class:`AuthenticatedStore`,
which writes every value with a MAC and verifies it when read back.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import stat
import time
from collections.abc import Callable
from datetime import timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar, cast

from torch.distributed import DistNetworkError, FileStore, HashStore, PrefixStore, Store
from torch.distributed import TCPStore as _TorchTCPStore

from .auth import MAC_BYTES, AuthKey
from .errors import AuthenticationError, CollectiveTimeout, PGError, StoreUnavailableError
from .timeouts import DEFAULT_TIMEOUT, Deadline, seconds

__all__ = [
    "AuthenticatedStore",
    "FileStore",
    "GuardedStore",
    "HashStore",
    "PolledStore",
    "PrefixStore",
    "Store",
    "StoreServer",
    "TCPStore",
    "advertise_address",
    "auth_key_of",
    "authenticated",
    "guarded",
    "hosts_store",
    "store_address",
    "store_host",
    "wait_any",
    "wait_for",
    "wait_for_server",
]


def _innermost(store: Store) -> Store:
    """The store behind ``PrefixStore`` and pg-core's wrappers (:class:`GuardedStore`,
    :class:`PolledStore`, :class:`~pg_core.auth.AuthenticatedStore`: each keeps its store as ``inner``)."""
    for _ in range(64):
        if isinstance(store, PrefixStore):
            store = store.underlying_store
        elif isinstance(getattr(store, "inner", None), Store):
            store = store.inner  # type: ignore[attr-defined]
        else:
            break
    return store


def store_host(store: Store) -> str | None:
    """The host a ``TCPStore`` (possibly behind ``PrefixStore`` wrappers) connects to,
    or ``None`` for stores that live in one host's memory or file system."""
    inner = _innermost(store)
    if isinstance(inner, _TorchTCPStore):
        return str(inner.host)
    return None


def store_address(store: Store) -> str | None:
    """``host:port`` of a ``TCPStore`` (possibly wrapped), or ``None`` for other stores."""
    inner = _innermost(store)
    if isinstance(inner, _TorchTCPStore):
        host = str(inner.host)
        return f"[{host}]:{inner.port}" if ":" in host else f"{host}:{inner.port}"
    return None


def hosts_store(store: Store) -> bool:
    """Whether this process hosts the server of ``store``, a ``TCPStore`` (possibly wrapped):
    whether the store ends when this process exits. Torch's object does not say whether it was
    made with ``is_master=True``, so this asks the system whether this process holds a socket
    listening on the store's port, bound to the store's host or to every address, and whether
    that host is this machine (the same port number served here for another store, while this
    store's server runs elsewhere, is not this store). Its descriptors come from
    ``/proc/self/fd`` or ``/dev/fd``; where neither lists them, ``False``, so nothing waits.
    ``False`` for other stores (``FileStore``, ``HashStore``)."""
    inner = _innermost(store)
    if not isinstance(inner, _TorchTCPStore):
        return False
    bound = _listening_addresses(int(inner.port))
    if not bound:
        return False
    local = _local_addresses(str(inner.host))
    return bool(local) and any(addr in local or ipaddress.ip_address(addr).is_unspecified for addr in bound)


def _normalised(address: object) -> str:
    """An IP address as :mod:`ipaddress` writes it, without an IPv6 zone, an IPv4-mapped IPv6
    address as the IPv4 one."""
    ip = ipaddress.ip_address(str(address).partition("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip)


def _local_addresses(host: str) -> set[str]:
    """The addresses ``host`` resolves to that belong to this machine (a socket can be bound
    to them), normalised as :mod:`ipaddress` writes them; empty if it does not resolve."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return set()
    local = set()
    for family, _, _, _, sockaddr in infos:
        addr = _normalised(sockaddr[0])
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.bind((addr, 0))
        except OSError:
            continue
        local.add(addr)
    return local


def _listening_addresses(port: int) -> set[str]:
    """The addresses this process's listening TCP sockets on ``port`` are bound to (``0.0.0.0``
    or ``::`` for every address): each socket among this process's file descriptors, asked
    through a duplicate (which is all that is closed)."""
    found: set[str] = set()
    try:
        names = os.listdir("/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd")
    except OSError:
        return found
    accepting = getattr(socket, "SO_ACCEPTCONN", None)
    if accepting is None:
        return found
    for name in names:
        try:
            fd = int(name)
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            dup = os.dup(fd)
        except (OSError, ValueError):  # closed meanwhile (the listing's own descriptor among them)
            continue
        try:
            sock = socket.socket(fileno=dup)
        except OSError:
            os.close(dup)
            continue
        with sock:
            try:
                if sock.family not in (socket.AF_INET, socket.AF_INET6):
                    continue
                bound_to = sock.getsockname()
                if sock.getsockopt(socket.SOL_SOCKET, accepting) and bound_to[1] == port:
                    found.add(_normalised(bound_to[0]))
            except OSError:
                continue
    return found


def _gone(address: str | None, op: str, exc: BaseException) -> str:
    said = (str(exc).strip().splitlines() or [type(exc).__name__])[0].partition(". ")[0]  # torch's first sentence
    where = f" at {address}" if address else ""
    return (
        f"the store{where} is gone ({op}: {said}): the process hosting it has exited. Keep it alive until every "
        "rank is done: end every rank with group.shutdown() (the hosting rank's waits for the others), host it with "
        "pg_core.StoreServer, or use a launcher that hosts it (torchrun, pgrun)"
    )


class GuardedStore(Store):
    """The store a group is formed on, as every part of pg-core (and every backend, through
    ``BackendContext.store``) sees it: ``inner`` unchanged, except that a broken connection
    to a ``TCPStore``'s server (torch's ``DistNetworkError``) raises
    :class:`~pg_core.errors.StoreUnavailableError` naming the store's address and what to
    do, without torch's C++ frames. Once the store is gone, later calls raise that at once,
    without asking torch again (each failed call would log its C++ frames)."""

    def __init__(self, inner: Store) -> None:
        super().__init__()
        self.inner = inner
        self.address = store_address(inner)
        self._gone: str | None = None  # the message, once the store is gone

    def _call(self, op: str, fn: Callable[..., _T], *args: Any) -> _T:
        if self._gone is not None:
            raise StoreUnavailableError(self._gone, address=self.address)
        try:
            return fn(*args)
        except DistNetworkError as exc:
            self._gone = _gone(self.address, op, exc)
            raise StoreUnavailableError(self._gone, address=self.address) from None

    def set(self, key: str, value: Any) -> None:
        self._call("set", self.inner.set, key, value)

    def get(self, key: str) -> bytes:
        return self._call("get", self.inner.get, key)

    def add(self, key: str, amount: int) -> int:
        return self._call("add", self.inner.add, key, amount)

    def check(self, keys: list[str]) -> bool:
        return self._call("check", self.inner.check, keys)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self._call("compare_set", self.inner.compare_set, key, expected, desired)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self._call("wait", self.inner.wait, keys)
        else:
            self._call("wait", self.inner.wait, keys, timeout)

    def delete_key(self, key: str) -> bool:
        return self._call("delete_key", self.inner.delete_key, key)

    def num_keys(self) -> int:
        return self._call("num_keys", self.inner.num_keys)

    # torch's C++ stores (a PrefixStore over this one) reach these two by their C++ names
    def deleteKey(self, key: str) -> bool:  # noqa: N802  (the name torch looks up)
        return self.delete_key(key)

    def getNumKeys(self) -> int:  # noqa: N802
        return self.num_keys()

    # torch's extended API (a C++ backend asks has_extended_api() before using it); torch's
    # type stubs do not declare it
    def append(self, key: str, value: Any) -> None:
        self._call("append", cast(Any, self.inner).append, key, value)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._call("multi_get", self.inner.multi_get, keys)

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self._call("multi_set", cast(Any, self.inner).multi_set, keys, values)

    def has_extended_api(self) -> bool:
        return bool(cast(Any, self.inner).has_extended_api())


def _raw(value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class AuthenticatedStore(Store):
    """``inner`` seen by the members of an authenticated job: values are written as
    ``MAC || payload`` and verified when read back. ``set``,
    ``get``, ``compare_set``, ``multi_set`` and ``multi_get`` carry MACs; ``add``, ``check``,
    ``wait``, ``delete_key`` and ``num_keys`` pass through; ``append`` is refused (a value
    appended to cannot keep one MAC). See :mod:`pg_core.auth`."""

    def __init__(self, inner: Store, key: AuthKey) -> None:
        super().__init__()
        self.inner = inner
        self.key = key

    def __repr__(self) -> str:
        return f"<AuthenticatedStore over {type(self.inner).__name__}, authenticated>"

    # -- the MAC --------------------------------------------------------------------
    def seal(self, key: str, value: Any) -> bytes:
        """``value`` as it is stored under ``key``: ``MAC || payload``."""
        payload = _raw(value)
        return self.key.mac(key.encode(), payload) + payload

    def open(self, key: str, stored: bytes) -> bytes:
        """The payload of what ``key`` holds, once its MAC is verified; else
        :class:`~pg_core.errors.AuthenticationError` naming ``key``."""
        stored = bytes(stored)
        mac, payload = stored[:MAC_BYTES], stored[MAC_BYTES:]
        if len(mac) < MAC_BYTES or not self.key.verify(mac, key.encode(), payload):
            raise AuthenticationError(
                f"store key {key!r} holds a value ({len(stored)} bytes) that no member of this authenticated job "
                "wrote (its MAC does not match the job's secret): someone without the secret wrote to the store, or "
                "this process has another secret than the job's (compare PG_CORE_AUTH_KEY on every rank)",
                key=key,
            )
        return payload

    def _counter(self, op: str, key: str, fn: Callable[[], _T]) -> _T:
        try:
            return fn()
        except (DistNetworkError, PGError):  # the store is gone: GuardedStore says so
            raise
        except (RuntimeError, ValueError) as exc:
            raise AuthenticationError(
                f"store key {key!r} is a counter ({op}) but holds something else ({exc}): counters cannot carry a "
                "MAC, and someone without the job's secret wrote to it",
                key=key,
            ) from None

    # -- the store ------------------------------------------------------------------
    def set(self, key: str, value: Any) -> None:
        cast(Any, self.inner).set(key, self.seal(key, value))  # torch takes bytes; its stubs say str

    def get(self, key: str) -> bytes:
        return self.open(key, self.inner.get(key))

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        want = _raw(expected)
        sealed_expected = self.seal(key, want) if want else b""  # empty: "not set yet"
        inner = cast(Any, self.inner)  # torch takes bytes; its stubs say str
        return self.open(key, inner.compare_set(key, sealed_expected, self.seal(key, desired)))

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        cast(Any, self.inner).multi_set(keys, [self.seal(k, v) for k, v in zip(keys, values, strict=True)])

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.open(k, v) for k, v in zip(keys, self.inner.multi_get(keys), strict=True)]

    def add(self, key: str, amount: int) -> int:
        # torch's TCPStore server drops the client's connection when asked to add to a value
        # that is not a number: look first (counters are only touched while groups form)
        if self.inner.check([key]):
            held = bytes(self.inner.get(key))
            if not held.removeprefix(b"-").isdigit():
                raise AuthenticationError(
                    f"store key {key!r} is a counter but holds {len(held)} bytes that are not a number: counters "
                    "cannot carry a MAC, and someone without the job's secret wrote to it",
                    key=key,
                )
        value = self._counter("add", key, lambda: self.inner.add(key, amount))
        if isinstance(value, bool) or not isinstance(value, int):
            raise AuthenticationError(f"store key {key!r}: the counter read {value!r}, not an int", key=key)
        return value

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def deleteKey(self, key: str) -> bool:  # noqa: N802  (the name torch's C++ stores look up)
        return self.delete_key(key)

    def getNumKeys(self) -> int:  # noqa: N802
        return self.num_keys()

    def append(self, key: str, value: Any) -> None:
        raise AuthenticationError(
            f"store key {key!r}: append is not available in an authenticated job (each value carries one MAC over "
            "all of it); use set",
            key=key,
        )

    def has_extended_api(self) -> bool:
        return bool(cast(Any, self.inner).has_extended_api())


def authenticated(store: Store, key: AuthKey | None) -> Store:
    """``store`` as a group with ``key`` uses it: through :class:`AuthenticatedStore` (itself
    if it is one with this key already); ``store`` unchanged without a key."""
    if key is None:
        return store
    if isinstance(store, AuthenticatedStore):
        if store.key != key:
            raise ValueError(
                "the store is already an AuthenticatedStore with another secret than auth_key: pass one of them"
            )
        return store
    return AuthenticatedStore(store, key)


def auth_key_of(store: Store) -> AuthKey | None:
    """The key of the :class:`AuthenticatedStore` ``store`` is seen through, if any (through
    pg-core's wrappers, which keep theirs as ``inner``, and torch's ``PrefixStore``)."""
    for _ in range(64):
        if isinstance(store, AuthenticatedStore):
            return store.key
        if isinstance(store, PrefixStore):
            store = store.underlying_store
            continue
        inner = getattr(store, "inner", None)
        if not isinstance(inner, Store):
            return None
        store = inner
    return None


def guarded(store: Store) -> GuardedStore:
    """``store`` seen through :class:`GuardedStore` (itself, if it is one already)."""
    return store if isinstance(store, GuardedStore) else GuardedStore(store)


_SERVER_POLL_FIRST_S = 0.01
_SERVER_POLL_MAX_S = 0.25


def wait_for_server(host: str, port: int, timeout: float | timedelta) -> None:
    """Wait until something accepts TCP connections at ``host:port``, at most ``timeout``, in
    Python: interruptible (Ctrl-C raises ``KeyboardInterrupt`` at once), and bounded by
    ``timeout`` (torch's own client, waiting in C++, ignores Ctrl-C and gives up after about
    twice its timeout). Raises :class:`~pg_core.errors.StoreUnavailableError` saying who
    should have been there."""
    budget = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    deadline = time.monotonic() + budget
    pause = _SERVER_POLL_FIRST_S
    last: OSError | None = None
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.001, min(left, 1.0))):
                return
        except OSError as exc:  # refused (nobody listens yet), unreachable, or the host does not resolve
            last = exc
        left = deadline - time.monotonic()
        if left <= 0:
            address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            raise StoreUnavailableError(
                f"no store server at {address} after {budget:g} s ({last}): the process that hosts it (the one "
                "that made its TCPStore with is_master=True, usually rank 0) has not started, failed before it "
                "could, or listens elsewhere. A launcher (pgrun, torchrun) or a StoreServer hosts the store apart "
                "from the ranks, so one rank failing early cannot leave the others waiting",
                address=address,
            )
        time.sleep(min(pause, left))
        pause = min(pause * 2, _SERVER_POLL_MAX_S)


class _TCPStoreType(type):
    """Makes ``isinstance(store, pg_core.TCPStore)`` true of every torch ``TCPStore``."""

    def __instancecheck__(cls, obj: object) -> bool:
        return isinstance(obj, _TorchTCPStore)

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, _TorchTCPStore)


if TYPE_CHECKING:
    TCPStore = _TorchTCPStore
else:

    class TCPStore(metaclass=_TCPStoreType):
        """torch's ``TCPStore``: calling it makes one of torch's (everything torch takes, it
        takes), with the same arguments; a client (``is_master=False``) first waits for the
        server with :func:`wait_for_server`, at most ``timeout``, and Ctrl-C ends the wait.
        ``timeout`` may also be a number of seconds. The object is torch's own, fully made or
        not at all (a subclass would leave one half made behind a failed connection, which
        crashes whatever prints it); to subclass, subclass ``torch.distributed.TCPStore``.

        The wait covers a server that is not listening yet (or any more). Once something
        accepts connections on the port, torch's own handshake follows, in C++: it too ends
        at ``timeout``, but Ctrl-C does not reach it."""

        def __init_subclass__(cls, **kwargs: Any) -> None:
            raise TypeError(
                "pg_core.TCPStore makes torch's own TCPStore and cannot be subclassed; subclass "
                "torch.distributed.TCPStore instead"
            )

        def __new__(
            cls,
            host_name: str,
            port: int,
            world_size: int | None = None,
            is_master: bool = False,
            timeout: timedelta | float = timedelta(seconds=300),
            *args: Any,
            **kwargs: Any,
        ) -> _TorchTCPStore:
            wait = timeout if isinstance(timeout, timedelta) else timedelta(seconds=seconds(timeout, 300.0))
            if not is_master:
                wait_for_server(host_name, int(port), wait)
            return _TorchTCPStore(host_name, port, world_size, is_master, wait, *args, **kwargs)


class StoreServer:
    """Hosts a ``TCPStore`` server in this process until :meth:`close` (or the end of a
    ``with`` block), for jobs started without a launcher: the store then outlives every rank,
    whichever finishes first. ``port=0`` takes a free port; the ranks connect to
    :attr:`address` (``TCPStore(server.host, server.port, is_master=False)``). The server
    listens on every interface; ``host`` is the address the ranks are told to use.

    >>> with StoreServer() as server:  # doctest: +SKIP
    ...     run_ranks(store_address=server.address)  # each: TCPStore(host, port, is_master=False)

    ``timeout`` (seconds) is the server-side client's timeout for its own calls through
    :attr:`store`. :meth:`close` drops this object's server; it stops once nothing else in
    this process holds :attr:`store` (a group formed on it holds it until it is collected).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, timeout: float | timedelta | None = None) -> None:
        budget = seconds(timeout, DEFAULT_TIMEOUT)
        self._store: TCPStore | None = TCPStore(
            host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=budget)
        )
        self._host = host
        self._port = int(self._store.port)

    @property
    def host(self) -> str:
        return self._host

    @property
    def port(self) -> int:
        return self._port

    @property
    def address(self) -> str:
        """``host:port`` (``[host]:port`` for an IPv6 address), as ``PG_STORE`` carries it."""
        return f"[{self._host}]:{self._port}" if ":" in self._host else f"{self._host}:{self._port}"

    @property
    def store(self) -> TCPStore:
        """The server's own store object (a client too): for a group formed in this process."""
        if self._store is None:
            raise RuntimeError(f"StoreServer at {self.address} is closed")
        return self._store

    @property
    def closed(self) -> bool:
        return self._store is None

    def close(self) -> None:
        """Stop hosting (idempotent): clients' later calls raise
        :class:`~pg_core.errors.StoreUnavailableError` through a group."""
        self._store = None

    def __enter__(self) -> StoreServer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<StoreServer {self.address}{' closed' if self.closed else ''}>"


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
        self.inner, self._timeout, self._what = inner, timeout, what

    def set(self, key: str, value: Any) -> None:
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        wait_for(self.inner, [key], self._timeout, what=self._what)
        return self.inner.get(key)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        wait_for(self.inner, list(keys), self._timeout, what=self._what)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(key, amount)


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
