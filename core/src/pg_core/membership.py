"""Membership: how a process takes its place in a group formation, through the store alone.

Every group lives under a *namespace* in the store: ``pg-core`` for top-level groups,
``<parent's prefix>/groups`` for subgroups (so two parents' subgroups never meet).
Under it a group name has numbered *generations*: ``<namespace>/<name>/<generation>/``
holds one formation's keys. Each generation admits exactly ``size`` members, first
come; the member that fills it opens the next one, so forming the same name again
(after a shutdown, or survivors re-forming after a failure) never meets stale keys.
A generation that some member *closed* (``abort()``, a failed group's ``shutdown()``,
a rendezvous that timed out) is skipped by later arrivals.

A member either claims the rank it was given (``ProcessGroup(store, rank, size)``)
or, for :func:`pg_core.rendezvous`, takes the next rank in arrival order.
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass

from .errors import CollectiveTimeout, PeerFailureError
from .store import Store, wait_any

__all__ = ["ROOT_NAMESPACE", "Membership", "check_name", "join", "wait_until_full"]

ROOT_NAMESPACE = "pg-core"


def check_name(name: object, what: str = "group name") -> str:
    if not isinstance(name, str) or not name or "/" in name:
        raise ValueError(f"{what} must be a non-empty string without '/', got {name!r}")
    return name


@dataclass(frozen=True)
class Membership:
    """This process's place in one formation: ``prefix`` is the formation's store prefix."""

    namespace: str
    key: str
    generation: int
    rank: int
    size: int
    arrived: int  # this member's arrival number in its generation (1-based)

    @property
    def prefix(self) -> str:
        return f"{self.namespace}/{self.key}/{self.generation}"


def join(store: Store, namespace: str, key: str, rank: int | None, size: int) -> Membership:
    """Take a place in the current generation of ``key``: rank ``rank``, or the next in
    arrival order when ``rank`` is ``None``. Never waits for other members."""
    base = f"{namespace}/{key}"
    generation = int(store.add(f"{base}/generation", 0))
    for _ in range(1 << 16):
        # a generation some member closed (it never filled: a member died before joining) is skipped
        if not store.check([f"{base}/{generation}/closed"]):
            joined = int(store.add(f"{base}/{generation}/joined", 1))
            if joined <= size:
                break
        generation += 1
    else:  # pragma: no cover - needs 65536 concurrent formations of one name
        raise RuntimeError(f"could not join group {key!r}")
    gen = f"{base}/{generation}"
    if joined == size:
        store.add(f"{base}/generation", 1)
        store.set(f"{gen}/full", "1")
    if rank is None:
        rank = joined - 1
    token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex}"
    claimed = store.compare_set(f"{gen}/rank/{rank}", "", token).decode()
    if claimed != token:
        raise ValueError(
            f"group {key!r} (generation {generation}) already has a rank {rank} ({claimed}); each member must "
            "pass a distinct rank, and two groups alive at once need distinct names"
        )
    sizes = store.compare_set(f"{gen}/size", "", str(size)).decode()
    if sizes != str(size):
        raise ValueError(f"group {key!r}: other members passed size={sizes}, this one size={size}")
    return Membership(namespace, key, generation, rank, size, joined)


def wait_until_full(store: Store, m: Membership, timeout: float, what: str) -> None:
    """Wait until all ``m.size`` members arrived in ``m``'s generation.

    Past ``timeout`` the generation is closed (later arrivals skip it) and
    :class:`CollectiveTimeout` says how many arrived. If another member closed it
    first (it timed out, or aborted), :class:`PeerFailureError`.
    """
    full, closed = f"{m.prefix}/full", f"{m.prefix}/closed"
    seen = wait_any(store, [full, closed], timeout)
    if seen == full:
        return
    if seen == closed:
        raise PeerFailureError(
            f"{what}: another member of generation {m.generation} gave up before it filled (it timed out or "
            "aborted); call it again to meet in the next generation"
        )
    store.set(closed, "1")
    if store.check([full]):  # the last member arrived as we gave up: the group is whole after all
        return
    arrived = min(int(store.add(f"{m.prefix}/joined", 0)), m.size)
    later = (
        f"; earlier generations of {m.key!r} were full or closed when this process arrived (a process that "
        "arrives after a group filled up waits for the next formation of the name)"
        if m.generation > 0
        else ""
    )
    raise CollectiveTimeout(
        f"{what}: {arrived} of {m.size} members arrived within {timeout:g} s (generation {m.generation}){later}",
        op="rendezvous",
    )
