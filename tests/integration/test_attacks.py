"""Attacks on a job, on every in-repo cpu backend (pg-tcp, pg-gloo, pg-mpi; pg-mpi's ranks
started by ``mpiexec``): strangers who can reach the store, and members who send what they
should not.

What a job trusts. **Without a key** (``PG_CORE_AUTH_KEY`` unset, no ``auth_key=``; the
default outside ``pgrun``) every process that can reach the store is a member: it can read
and write every store value, take a rank's place in a group, and send objects that the
receivers unpickle, which runs its code there (``test_without_a_key_a_stranger_joins...``
shows it). **With a key** the store values pg-core reads back carry a MAC, so a stranger's
write is an :class:`~pg_core.errors.AuthenticationError` naming the key on the rank that
reads it, never a crash and never a value used; a stranger cannot take part in a group. Members
hold the key and are trusted to follow the protocol, but not to send safe objects when the
group loads them ``objects="restricted"``: a class outside the allow-list is a
:class:`~pg_core.errors.ForbiddenObjectError` naming it, before anything of it runs.

Here, with a key set:

* a stranger (a plain torch ``TCPStore`` client, no key) poisons the group's formation record,
  a pg-tcp address, Gloo's own rendezvous key and pg-gloo's watch key: every reader
  raises ``AuthenticationError`` naming the key, and no rank process dies (the pool's workers
  keep their pids);
* a member sends a pickle whose ``__reduce__`` would write a file, through ``send_object`` and
  ``broadcast_object``, to ranks that load objects restricted: ``ForbiddenObjectError``
  naming ``builtins.exec``, the file never appears, and the group goes on;
* ``pgrun`` ranks are authenticated without the user doing anything.

pg-tcp's own connections are attacked in ``backends/tcp_reference/tests/test_attacks.py``
(oversized frame headers, a second claim of a live rank, a stranger's hellos without the
key, a replayed captured hello in an authenticated job); not repeated here.
Every wait is bounded: store keys, the group timeout, the pool's call timeout.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from pg_core import ProcessGroup
from pg_core.errors import ForbiddenObjectError, PGError
from pg_core.store import Store, store_address
from pg_core.testing.pool import RankContext, RankPool
from torch.distributed import PrefixStore, TCPStore

Pools = Callable[[int], RankPool]
PoolFor = Callable[..., RankPool]  # the pool_for fixture (tests/integration/conftest.py)

KEY = "attack-test-secret"
TIMEOUT = 5.0  # the groups' timeout: a rank whose peer failed formation gives up within it

BACKENDS = [
    pytest.param("tcp", marks=pytest.mark.requires_backend("tcp")),
    pytest.param("gloo", marks=pytest.mark.requires_backend("gloo")),
    pytest.param("mpi", marks=pytest.mark.requires_backend("mpi")),
]


def pid(ctx: RankContext) -> int:
    return os.getpid()


def stranger(ctx: RankContext) -> PrefixStore:
    """A plain torch store client of the call's namespace, made from the store's address
    alone: no key, nothing of pg-core's."""
    address = store_address(ctx.store)
    assert address is not None
    host, _, port = address.rpartition(":")
    client = TCPStore(host.strip("[]"), int(port), is_master=False, timeout=timedelta(seconds=30))
    return PrefixStore(f"pool/job{ctx.job}", client)


class Evil:
    """A pickle that, loaded, runs ``exec`` (writes ``path``)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"open({self.path!r}, 'w').write('ran')",))


class Held(Store):
    """``inner``, except that this rank's write of ``key`` waits until ``until`` is set in
    ``inner`` (at most 30 s): a legitimate writer that comes after the poisoned value was read."""

    def __init__(self, inner: Store, key: str, until: str) -> None:
        super().__init__()
        self.inner, self._key, self._until = inner, key, until

    def set(self, key: str, value: Any) -> None:
        if key == self._key:
            self.inner.wait([self._until], timedelta(seconds=30))
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        return self.inner.get(key)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self.inner.compare_set(key, expected, desired)

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(key, amount)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self.inner.multi_get(keys)

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        cast(Any, self.inner).multi_set(keys, values)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()


# -- without a key anyone is a member; with one, a stranger is refused ---------------------


def stranger_joins(ctx: RankContext, keyed: bool, path: str) -> dict[str, Any]:
    """Rank 1 is a stranger: it forms the group with the store alone, never a key, and sends
    rank 0 a pickle that writes ``path``. Rank 0 has the key when ``keyed``."""
    name = f"join-{int(keyed)}"
    try:
        if ctx.rank == 1:
            if keyed:  # it comes second: what it reads was written with the key
                ctx.store.wait([f"pg-core/{name}/0/size"])
            with ProcessGroup(stranger(ctx), 1, 2, backends="tcp", name=name, timeout=TIMEOUT, auth_key=None) as g:
                g.send_object(Evil(path), dst=0)
                return {"joined": True}
        with ProcessGroup(
            ctx.store, 0, 2, backends="tcp", name=name, timeout=TIMEOUT, auth_key=KEY if keyed else None
        ) as g:
            got = g.recv_object(src=1)
            return {"joined": True, "got": got}
    except Exception as exc:  # the test looks at which: a pg-core error, or a raw one
        return {"joined": False, "error": type(exc).__name__, "message": str(exc), "pg": isinstance(exc, PGError)}


def test_without_a_key_a_stranger_joins_and_runs_code_and_with_one_it_is_refused(
    rank_pools: Pools, tmp_path: Path
) -> None:
    open_door = tmp_path / "without-key"
    rank0, rank1 = rank_pools(2).run(stranger_joins, False, str(open_door), timeout=60)
    assert rank0["joined"] and rank1["joined"], (rank0, rank1)
    assert open_door.read_text() == "ran"  # what docs/security.md says a job without a key trusts

    shut = tmp_path / "with-key"
    rank0, rank1 = rank_pools(2).run(stranger_joins, True, str(shut), timeout=60)
    assert not rank0["joined"] and not rank1["joined"], (rank0, rank1)
    assert rank0["pg"], rank0  # refused: a pg-core error, and nothing of the stranger's loaded
    assert not shut.exists()


@pytest.mark.requires_backend("tcp")
def test_a_process_without_the_key_gets_a_pg_core_error_from_an_authenticated_store(
    rank_pools: Pools, tmp_path: Path
) -> None:
    """The stranger reads the keyed rank's values (``MAC || payload``) as it forms: an
    AuthenticationError naming the key, not a raw UnicodeDecodeError. The keyed rank formed
    first, without waiting; its first operation times out waiting for a member that is not
    there, and the timeout says that rank's place was claimed without the job's key."""
    rank0, rank1 = rank_pools(2).run(stranger_joins, True, str(tmp_path / "unused"), timeout=60)
    assert not rank1["joined"] and rank1["error"] == "AuthenticationError", rank1
    assert "PG_CORE_AUTH_KEY" in rank1["message"], rank1
    assert rank0["error"] == "CollectiveTimeout", rank0
    assert "rank 1 of group 'join-1': the place was claimed by a process without this job's key" in rank0["message"]


# -- a stranger poisons the store -----------------------------------------------------------


def poisoned_formation(ctx: RankContext, backend: str) -> tuple[str, str | None, str]:
    name = "poison-form"
    stranger(ctx).set(f"pg-core/{name}/0/formation", "a stranger's formation record")
    with pytest.raises(PGError) as info:
        ProcessGroup(ctx.store, ctx.rank, ctx.size, backends=backend, name=name, timeout=TIMEOUT, auth_key=KEY)
    return type(info.value).__name__, getattr(info.value, "key", None), str(info.value)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_poisoned_formation_record_is_an_authentication_error_on_every_rank(backend: str, pool_for: PoolFor) -> None:
    pool = pool_for(backend)
    pids = pool.run(pid)
    for cls, key, message in pool.run(poisoned_formation, backend, timeout=60):
        assert cls == "AuthenticationError", message
        assert key == "pg-core/poison-form/0/formation", message
        assert repr(key) in message, message
    assert pool.run(pid) == pids  # no rank process died


def poisoned_backend_key(
    ctx: RankContext, backend: str, which: str, reader: int, keyed: bool = True
) -> tuple[str, str | None, str, bool]:
    """A stranger writes a backend's key (``which``, under the group's ``cpu/BACKEND/``) before
    the group forms, and the rank that owns the key writes its own value only once ``reader``
    has read the stranger's: the window a stranger's write lands in, made certain. pg-tcp:
    ``addr/1`` (rank 1's address; rank 0 connects to it). pg-gloo: ``gloo/0/1`` (Gloo's own
    rendezvous value, read in C++; this is the one that segfaulted the reader before values
    were MACed), ``pg-gloo-watch/0`` (pg-gloo's watch address; rank 1 connects to it)."""
    name = f"poison-{backend}-{which.split('/', maxsplit=1)[0]}{'' if keyed else '-nokey'}"
    key = f"pg-core/{name}/0/cpu/{backend}/{which}"
    store: Store = ctx.store
    if ctx.rank == reader:
        outsider = stranger(ctx)
        cast(Any, outsider).set(key, b"\xff\xfe not an address \x00" * 4)  # torch takes bytes
        ctx.store.set("planted", "1")
    else:
        ctx.store.wait(["planted"])
        store = Held(ctx.store, key, until="read")
    try:
        key_arg = KEY if keyed else None
        with ProcessGroup(store, ctx.rank, 2, backends=backend, name=name, timeout=TIMEOUT, auth_key=key_arg) as g:
            g.all_reduce(torch.ones(1))
        return "formed", None, "", True
    except Exception as exc:  # the test looks at which: a pg-core error, or a raw one
        return type(exc).__name__, getattr(exc, "key", None), str(exc), isinstance(exc, PGError)
    finally:
        if ctx.rank == reader:
            ctx.store.set("read", "1")


@pytest.mark.parametrize(
    ("backend", "which", "reader"),
    [
        pytest.param("tcp", "addr/1", 0, marks=pytest.mark.requires_backend("tcp")),
        pytest.param("gloo", "gloo/0/1", 0, marks=pytest.mark.requires_backend("gloo")),
        pytest.param("gloo", "pg-gloo-watch/0", 1, marks=pytest.mark.requires_backend("gloo")),
    ],
)
def test_a_poisoned_backend_key_is_an_authentication_error_and_no_crash(
    rank_pools: Pools, backend: str, which: str, reader: int
) -> None:
    pool = rank_pools(2)
    pids = pool.run(pid)
    results = pool.run(poisoned_backend_key, backend, which, reader, timeout=90)
    cls, key, message, _ = results[reader]
    assert cls == "AuthenticationError", message
    assert key == f"pg-core/poison-{backend}-{which.split('/', maxsplit=1)[0]}/0/cpu/{backend}/{which}", message
    assert repr(key) in message, message
    cls, _, message, _ = results[1 - reader]
    assert cls != "formed", message  # the owner of the key fails too: its peer left
    assert pool.run(pid) == pids  # no segfault, no SIGABRT: the same processes


@pytest.mark.parametrize(
    ("backend", "which", "reader"),
    [
        pytest.param("tcp", "addr/1", 0, marks=pytest.mark.requires_backend("tcp")),
        pytest.param("gloo", "pg-gloo-watch/0", 1, marks=pytest.mark.requires_backend("gloo")),
    ],
)
def test_without_a_key_a_garbled_backend_key_is_still_a_pg_core_error(
    rank_pools: Pools, backend: str, which: str, reader: int
) -> None:
    """Without a key nothing is verified, but what pg-core's backends parse themselves is
    checked as it is parsed: a value that is not theirs is a pg-core error naming the key, not
    a raw ValueError. (Gloo's own values are parsed in C++: without a key, a garbled one is
    Gloo's business; docs/security.md says what a job without a key trusts.)"""
    pool = rank_pools(2)
    pids = pool.run(pid)
    results = pool.run(poisoned_backend_key, backend, which, reader, False, timeout=90)
    cls, _, message, is_pg = results[reader]
    assert is_pg, (cls, message)
    assert which in message, message
    assert pool.run(pid) == pids


# -- a member sends a malicious pickle to ranks that load restricted -----------------------


def malicious_member(ctx: RankContext, backend: str, path: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with ProcessGroup(
        ctx.store, ctx.rank, ctx.size, backends=backend, name="evil", timeout=20, auth_key=KEY, objects="restricted"
    ) as g:
        assert g.objects == "restricted"
        if ctx.rank == 0:
            g.send_object(Evil(path), dst=1)
            g.send_object({"after": [1, 2.5, "x"]}, dst=1)
        else:
            with pytest.raises(ForbiddenObjectError) as info:
                g.recv_object(src=0)
            out["recv"] = (info.value.name, str(info.value))
            out["next"] = g.recv_object(src=0)  # the stream goes on: the next object is the next one
        if ctx.rank == 0:
            g.broadcast_object(Evil(path), src=0)
        else:
            with pytest.raises(ForbiddenObjectError) as info:
                g.broadcast_object(None, src=0)
            out["broadcast"] = (info.value.name, str(info.value))
        t = torch.ones(3)
        g.all_reduce(t)
        out["all_reduce"] = t.tolist()
        out["file"] = os.path.exists(path)
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_malicious_pickle_from_a_member_is_forbidden_when_loading_restricted(
    backend: str, pool_for: PoolFor, tmp_path: Path
) -> None:
    path = tmp_path / f"pwned-{backend}"
    results = pool_for(backend).run(malicious_member, backend, str(path), timeout=90)
    receiver = results[1]
    for how in ("recv", "broadcast"):
        name, message = receiver[how]
        assert name == "builtins.exec", message
        assert "builtins.exec" in message and "objects=" in message, message
    assert receiver["next"] == {"after": [1, 2.5, "x"]}
    assert [r["all_reduce"] for r in results] == [[2.0] * 3] * 2
    assert not path.exists() and not any(r["file"] for r in results)


# -- pgrun authenticates its ranks ----------------------------------------------------------

PGRUN = Path(sys.executable).with_name("pgrun")

SCRIPT = """
import torch
from pg_core import ProcessGroup

with ProcessGroup.from_env(backends="tcp", timeout=20) as g:
    t = torch.ones(1)
    g.all_reduce(t)
    print(f"authenticated={g.authenticated} sum={t.item():g}", flush=True)
"""


@pytest.mark.requires_backend("tcp")
def test_pgrun_ranks_are_authenticated_without_the_user_doing_anything(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "PG_CORE_AUTH_KEY"}
    done = subprocess.run(
        [str(PGRUN), "-n", "2", str(script)], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = sorted(line for line in done.stdout.splitlines() if "authenticated=" in line)
    assert len(lines) == 2, done.stdout
    assert all(line.endswith("authenticated=True sum=2") for line in lines), lines
