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

A :class:`Formation` is everything a group is built from: the place taken, the backends
every member resolved alike (checked as the member arrives, against the first arrival's,
without waiting for anyone), and a ``uid`` that no other formation anywhere shares.
Forming a name again while an earlier formation of it is alive is a new, independent
formation (the next generation), not an error: that is how survivors re-form ``"world"``.

A member that shuts down (or aborts) *leaves* its formation: ``<prefix>/left/<rank>``. The
process hosting the store waits for every member to have left (:func:`await_leaving`)
before its own shutdown returns, so the store outlives the members still using it.
"""

from __future__ import annotations

import os
import socket
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Final

from .backend import BackendSpec
from .dispatch import describe, message_device
from .errors import AuthenticationError, CollectiveMismatchError, CollectiveTimeout, PeerFailureError, warn_user
from .store import Store, _poll, guarded, wait_any, wait_for

if TYPE_CHECKING:
    from .registry import Registry

__all__ = [
    "ROOT_NAMESPACE",
    "Formation",
    "Membership",
    "Subgroups",
    "absent",
    "await_leaving",
    "check_name",
    "form",
    "join",
    "leave",
    "never_joined",
    "survivors",
    "wait_until_full",
]

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


def _text(key: str, value: bytes) -> str:
    """A value pg-core wrote as text, read back from ``key``. Bytes that are not text were not
    written by a pg-core process that shares this one's view of the job: most often a member of
    an authenticated job wrote them (``MAC || payload``) and this process has no key."""
    try:
        return bytes(value).decode()
    except UnicodeDecodeError:
        raise AuthenticationError(
            f"store key {key!r} holds {len(value)} bytes that are not a value this process can read: a member of an "
            "authenticated job wrote it (give this process the job's PG_CORE_AUTH_KEY), or someone wrote garbage "
            "to the store",
            key=key,
        ) from None


def join(store: Store, namespace: str, key: str, rank: int | None, size: int) -> Membership:
    """Take a place in the current generation of ``key``: rank ``rank``, or the next in
    arrival order when ``rank`` is ``None``. Never waits for other members.

    Skipped: a generation some member closed (it never filled: a member died before joining),
    and one where this process held ``rank`` and left (it formed the name there and shut that
    formation down before the others came: forming it again is a new formation)."""
    base = f"{namespace}/{key}"
    generation = int(store.add(f"{base}/generation", 0))
    for _ in range(1 << 16):
        if not store.check([f"{base}/{generation}/closed"]) and not _left_here(store, f"{base}/{generation}", rank):
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
    token = f"{_this_process()}{uuid.uuid4().hex}"
    claimed = _text(f"{gen}/rank/{rank}", store.compare_set(f"{gen}/rank/{rank}", "", token))
    if claimed != token:
        raise ValueError(
            f"group {key!r} (generation {generation}) already has a rank {rank} ({claimed}); each member must "
            "pass a distinct rank, and two groups alive at once need distinct names"
        )
    sizes = _text(f"{gen}/size", store.compare_set(f"{gen}/size", "", str(size)))
    if sizes != str(size):
        raise ValueError(f"group {key!r}: other members passed size={sizes}, this one size={size}")
    return Membership(namespace, key, generation, rank, size, joined)


def _left_here(store: Store, gen: str, rank: int | None) -> bool:
    """Whether this process held ``rank`` in the generation ``gen`` and has left it (shut down
    or aborted). A claim still alive, or another process's, is :func:`join`'s error to raise:
    two members passed one rank."""
    if rank is None or not store.check([f"{gen}/left/{rank}"]):
        return False
    claimed = f"{gen}/rank/{rank}"
    return store.check([claimed]) and _text(claimed, store.get(claimed)).startswith(_this_process())


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


#: Drawn once per interpreter: with the host name and the pid, what tells this process from
#: another that has the same host name and pid (containers on two machines, both named alike
#: and both running Python as pid 1). A forked child keeps it but has another pid.
_PROCESS_NONCE: Final = uuid.uuid4().hex[:16]


def _this_process() -> str:
    """The start of the rank tokens this process claims: ``host:pid:nonce:``."""
    return f"{socket.gethostname()}:{os.getpid()}:{_PROCESS_NONCE}:"


def absent(group_store: Store, size: int) -> list[int]:
    """The ranks that have not taken their place in the formation (``group_store``: its
    prefixed store): the processes that never created the group, as the store knows them."""
    if group_store.check([f"rank/{r}" for r in range(size)]):
        return []
    return [r for r in range(size) if not group_store.check([f"rank/{r}"])]


def never_joined(group_store: Store, size: int, name: str) -> Callable[[CollectiveTimeout], bool]:
    """What a group does with a timeout of its own: where members never joined, that is the
    cause, so the message says so first and names only them (not the members that are here,
    waiting in the same operation). The callable returns whether it explained the timeout so."""

    def explain(exc: CollectiveTimeout) -> bool:
        try:
            missing = absent(group_store, size)
        except Exception:  # the store is gone or failing: the backend's account stands
            return False
        if not missing:
            return _impostors(group_store, size, name, exc)
        ranks = ", ".join(map(str, missing))
        which = f"rank {ranks}" if len(missing) == 1 else f"ranks {ranks}"
        where = f"{exc.op} (collective #{exc.seq})" if exc.op and exc.seq is not None else (exc.op or "the operation")
        exc.args = (
            f"{which} of {size} never joined group {name!r}: {where} timed out waiting for "
            f"{'it' if len(missing) == 1 else 'them'}. Every member must create the group on this store with this "
            "name; check that the process started and did not fail before that",
        )
        exc.peers = tuple(missing)
        return True

    return explain


def _impostors(group_store: Store, size: int, name: str, exc: CollectiveTimeout) -> bool:
    """Whether some rank's place was claimed with a value that fails the job's MAC (a process
    without the key, on an authenticated job's store): then that, not the backend's account,
    is why the operation timed out, and ``exc`` says so."""
    fake: dict[int, str] = {}
    for r in range(size):
        try:
            group_store.get(f"rank/{r}")
        except AuthenticationError as failed:
            fake[r] = failed.key or f"rank/{r}"
        except Exception:  # the store is gone or failing: the backend's account stands
            return False
    if not fake:
        return False
    ranks = ", ".join(map(str, fake))
    exc.args = (
        f"{'rank' if len(fake) == 1 else 'ranks'} {ranks} of group {name!r}: the place was claimed by a process "
        f"without this job's key ({', '.join(repr(k) for k in fake.values())} fails its MAC), so "
        f"{exc.op or 'the operation'} timed out waiting for a member that is not there: a stranger on the store, "
        "or a member started without PG_CORE_AUTH_KEY",
    )
    exc.peers = tuple(fake)
    return True


def leave(group_store: Store, rank: int) -> None:
    """Record that ``rank`` left its formation (``group_store``: the formation's prefixed store)."""
    group_store.set(f"left/{rank}", "1")


def await_leaving(group_store: Store, size: int, timeout: float, what: str) -> list[int]:
    """Wait, at most ``timeout`` seconds, until every rank of the formation that runs in
    another process has left it; the ranks that had not by then (none: all left). Ranks in
    this process (threads) cannot outlive it, so they are not waited for."""
    here = _this_process()  # the start of this process's tokens (see join)

    def elsewhere(rank: int) -> bool:
        claimed = f"rank/{rank}"
        return not group_store.check([claimed]) or not _text(claimed, group_store.get(claimed)).startswith(here)

    keys = [f"left/{r}" for r in range(size) if elsewhere(r)]
    if not keys:
        return []
    try:
        wait_for(group_store, keys, timeout, what=what)
    except CollectiveTimeout:
        return [int(k.rpartition("/")[2]) for k in keys if not group_store.check([k])]
    return []


def survivors(
    store: Store, base: str, *, prefix: str, rank: int, size: int, lost: Iterable[int], timeout: float, name: str
) -> list[int]:
    """The ranks of a formation (its keys under ``prefix``) that go on, agreed by every one of
    them through the store under ``base``; ``rank`` is this member, ``lost`` the ranks it knows
    are gone (a peer failure named them, or the user did).

    Each member that calls it arrives (``base/here/<rank>``, its ``lost`` as the value). A rank
    is gone once an arrived member names it, or it left the formation (``prefix/left/<rank>``:
    it shut down or aborted) without arriving. As soon as every rank has arrived or is gone, or
    at ``timeout`` (the ranks that never arrived are gone), the first member to decide writes
    the decision, the ranks that arrived, and every member takes that one: they agree even
    where they saw arrivals at different times. A member arriving after a decision that left
    it out raises :class:`~pg_core.errors.PeerFailureError`."""
    gone = sorted({int(r) for r in lost} - {rank})
    store.set(f"{base}/here/{rank}", ",".join(map(str, gone)))
    decision = f"{base}/decision"
    named: dict[int, set[int]] = {}  # arrived rank -> the ranks it named gone

    def decided() -> str | None:
        if store.check([decision]):
            return _text(decision, store.get(decision))
        for r in range(size):
            if r not in named and store.check([f"{base}/here/{r}"]):
                said = _text(f"{base}/here/{r}", store.get(f"{base}/here/{r}"))
                named[r] = {int(x) for x in said.split(",") if x.isdigit()}
        out = set().union(*named.values()) - named.keys()
        missing = [r for r in range(size) if r not in named and r not in out]
        if any(not store.check([f"{prefix}/left/{r}"]) for r in missing):
            return None
        return ",".join(map(str, sorted(named)))

    found = _poll(decided, timeout)
    if found is None:  # the deadline: whoever has not arrived is gone
        decided()
        found = ",".join(map(str, sorted(named)))
    agreed = _text(decision, store.compare_set(decision, "", found)) or found
    members = [int(r) for r in agreed.split(",") if r]
    if rank not in members:
        raise PeerFailureError(
            f"shrink of group {name!r}: the survivors ({', '.join(map(str, members))}) went on without rank {rank}, "
            "which they took for gone (it reached shrink after they decided, or a peer reported it lost); form a "
            "new group to take part again",
            peers=members,
        )
    return members


@dataclass(frozen=True)
class Formation:
    """What a group is built from, formed before the group exists."""

    store: Store  # the store the group was formed on (its keys live under ``membership.prefix``)
    membership: Membership
    name: str  # as the group shows it (a subgroup's is derived from its parent's)
    uid: str  # unique to this formation, across jobs and hosts
    specs: Mapping[str, BackendSpec]  # device type -> backend, the same on every member
    timeout: float
    options: Mapping[str, Mapping[str, Any]]
    registry: Registry | None
    parent_ranks: tuple[int, ...] | None = None
    #: device type -> the handle the parent's backend of that type returned from its native
    #: split (``Backend.split``, API 1.6), for this group's backend of that type (``ctx.split_from``)
    split_from: Mapping[str, Any] = field(default_factory=dict)


def form(
    store: Store,
    namespace: str,
    key: str,
    rank: int | None,
    size: int,
    *,
    name: str,
    specs: Mapping[str, BackendSpec],
    timeout: float,
    options: Mapping[str, Mapping[str, Any]],
    registry: Registry | None,
    parent_ranks: tuple[int, ...] | None = None,
    wait: bool = False,
    check: bool = False,
) -> Formation:
    """Take a place in ``namespace/key`` (rank ``rank``, or the next in arrival order) and
    agree on the formation's uid and backends with the first member to arrive, in one store
    round trip; with ``wait``, also wait until every member arrived (:func:`wait_until_full`).
    A member that resolved other backends than the first, or has check mode (``check``) where
    the first has not or the other way round, raises
    :class:`~pg_core.errors.CollectiveMismatchError` here, and the generation is closed.
    The formation keeps ``store`` seen through :class:`~pg_core.store.GuardedStore`, so
    everything built on it raises :class:`~pg_core.errors.StoreUnavailableError` once the
    store's host is gone."""
    store = guarded(store)
    m = join(store, namespace, key, rank, size)
    mine = f"{int(check)} {describe(specs)}"
    proposal = f"{uuid.uuid4().hex[:16]} {m.rank} {mine}"  # backend and device names have no spaces
    record = _text(f"{m.prefix}/formation", store.compare_set(f"{m.prefix}/formation", "", proposal))
    try:
        token, first, theirs = record.split(" ", 2)
        int(first)
    except ValueError:
        raise AuthenticationError(
            f"store key {m.prefix + '/formation'!r} holds {record[:60]!r}, not a formation record pg-core wrote: "
            "someone else wrote to this group's keys (run the job with PG_CORE_AUTH_KEY to refuse them)",
            key=f"{m.prefix}/formation",
        ) from None
    uid = f"{key}#{m.generation}-{token}"
    if theirs != mine:
        store.set(f"{m.prefix}/closed", "1")
        their_check, _, their_specs = theirs.partition(" ")
        if their_specs != mine[2:]:
            raise CollectiveMismatchError(
                f"group {name!r}: rank {first} uses backends {their_specs!r} but rank {m.rank} resolved {mine[2:]!r}; "
                "install the same backends everywhere or name them with backends=",
                peers=[int(first)],
            )
        on, off = (first, m.rank) if their_check == "1" else (m.rank, first)
        raise CollectiveMismatchError(
            f"group {name!r}: rank {on} has check mode on and rank {off} has it off; every member must have it alike "
            "(check= or PG_CORE_CHECK in every rank's environment)",
            peers=[int(first)],
        )
    if wait:
        wait_until_full(store, m, timeout, f"rendezvous {name!r}")
    return Formation(store, m, name, uid, specs, timeout, options, registry, parent_ranks)


class Subgroups:
    """How one group forms its subgroups (``new_group``, ``split``): each in the parent's
    namespace (``<parent prefix>/groups``), so two parents' subgroups never meet, under a key
    every member derives alike from the calls made so far."""

    def __init__(self, parent: Formation) -> None:
        self._parent = parent
        self._lock = threading.Lock()
        self._new_groups: dict[tuple[int, ...], int] = {}  # new_group(ranks) calls so far, per ranks
        self._splits = 0
        self._shrinks = 0

    def new_group(
        self,
        members: Sequence[int],
        name: str | None,
        *,
        specs: Mapping[str, BackendSpec],
        timeout: float,
        options: Mapping[str, Mapping[str, Any]],
        check: bool = False,
    ) -> Formation:
        """The formation of ``members`` (parent ranks, this one among them), the same ranks
        formed again being a new formation."""
        if name is None:
            with self._lock:
                count = self._new_groups.get(tuple(members), 0)
                self._new_groups[tuple(members)] = count + 1
            key = "[" + ",".join(map(str, members)) + "]" + (f"#{count}" if count else "")
            display = f"{self._parent.name}{key}"
        else:
            key = display = check_name(name, "new_group name")
        return self._form(key, display, list(members), specs=specs, timeout=timeout, options=options, check=check)

    def shrink(
        self,
        lost: Iterable[int],
        *,
        specs: Mapping[str, BackendSpec],
        timeout: float,
        options: Mapping[str, Mapping[str, Any]],
        check: bool = False,
    ) -> Formation:
        """The formation of the parent's survivors, agreed through the store (:func:`survivors`),
        named as the parent; ``lost`` are ranks this member knows are gone."""
        with self._lock:
            number = self._shrinks
            self._shrinks += 1
        parent = self._parent
        m = parent.membership
        base = f"{m.prefix}/shrink{number}"
        members = survivors(
            parent.store, base, prefix=m.prefix, rank=m.rank, size=m.size, lost=lost, timeout=timeout, name=parent.name
        )
        return self._form(
            f"shrink{number}", parent.name, members, specs=specs, timeout=timeout, options=options, check=check
        )

    def split(
        self,
        color: int | None,
        key: int,
        name: str | None,
        gather: Callable[[tuple[int | None, int, bool]], list[tuple[int | None, int, bool]]],
        *,
        native: Callable[[int | None, int], Mapping[str, Any]],
        release: Callable[[Mapping[str, Any]], None],
        specs: Mapping[str, BackendSpec],
        timeout: float,
        options: Mapping[str, Mapping[str, Any]],
        check: bool = False,
    ) -> Formation | None:
        """``MPI_Comm_split``: ``gather`` is the parent's ``all_gather_object``. Each member
        also says whether its subgroup would use the parent's backend on the parent's message
        device (a member that joins none has no objection); when all do, ``native(color
        index, rank)`` runs on every member (the parent's ``Backend.split``, API 1.6, where
        its backend has one) and what it returns (device type -> handle) goes to the
        subgroup's formation as ``split_from``. What no subgroup will take, ``release``
        gets back (the parent's ``Backend.release_split``, API 1.7): the handles of a member
        that joins none, and those of a member whose subgroup's formation raised."""
        with self._lock:
            number = self._splits
            self._splits += 1
        parent = self._parent
        device = message_device(parent.specs).type
        agrees = color is None or (device in specs and specs[device] == parent.specs[device])
        chosen = gather((color, key, agrees))
        me = parent.membership.rank
        members = [r for _, r in sorted((k, r) for r, (c, k, _) in enumerate(chosen) if c == color)]
        handles: Mapping[str, Any] = {}
        if all(a for _, _, a in chosen):
            colors = sorted({c for c, _, _ in chosen if c is not None})
            if color is None:
                release(native(None, me))  # no subgroup will own what it made
            else:
                handles = native(colors.index(color), members.index(me))
        if color is None:
            return None
        store_key = f"split{number}.{color}"
        display = name or f"{parent.name}.{store_key}"
        try:
            formation = self._form(
                store_key, display, members, specs=specs, timeout=timeout, options=options, check=check
            )
        except BaseException as exc:
            if handles:  # no backend took them: they go back, and the formation's error is what is raised
                try:
                    release(handles)
                except Exception as failed:
                    warn_user(
                        f"split of group {parent.name!r}: releasing this member's handle after {exc!r} failed: {failed!r}"
                    )
            raise
        return replace(formation, split_from=handles) if handles else formation

    def _form(
        self,
        key: str,
        display: str,
        members: list[int],
        *,
        specs: Mapping[str, BackendSpec],
        timeout: float,
        options: Mapping[str, Mapping[str, Any]],
        check: bool,
    ) -> Formation:
        parent = self._parent
        return form(
            parent.store,
            f"{parent.membership.prefix}/groups",
            key,
            members.index(parent.membership.rank),
            len(members),
            name=display,
            specs=specs,
            timeout=timeout,
            options=options,
            registry=parent.registry,
            parent_ranks=tuple(members),
            check=check,
        )
