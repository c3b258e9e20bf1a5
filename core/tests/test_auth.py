"""The job's secret, the authenticating store and restricted object loading, in one process."""

from __future__ import annotations

import io
import os
import pickle
import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from pg_core import AuthenticationError, AuthKey, ForbiddenObjectError, ProcessGroup
from pg_core.auth import ENV, environment_with_key, resolve_key
from pg_core.messages import Loader, loader
from pg_core.store import AuthenticatedStore, auth_key_of, authenticated, guarded
from torch.distributed import HashStore, PrefixStore, TCPStore


@pytest.fixture(params=["hash", "tcp"])
def raw_store(request: pytest.FixtureRequest) -> Any:
    if request.param == "hash":
        return HashStore()
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


def test_key_never_shows_its_secret() -> None:
    key = AuthKey("hunter2-secret")
    assert "hunter2" not in repr(key) and "hunter2" not in str(key)
    assert "hunter2" not in repr(AuthenticatedStore(HashStore(), key))
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(key)
    assert AuthKey("a") == AuthKey(b"a") and AuthKey("a") != AuthKey("b")


def test_key_resolution() -> None:
    assert resolve_key(None, {}) is None
    assert resolve_key(None, {ENV: "x"}) == AuthKey("x")
    assert resolve_key("y", {ENV: "x"}) == AuthKey("y")  # the argument wins
    with pytest.raises(ValueError, match="empty"):
        resolve_key("", {})
    with pytest.raises(ValueError, match=ENV):
        resolve_key(None, {ENV: ""})
    with pytest.raises(TypeError, match="str or bytes"):
        resolve_key(3, {})  # type: ignore[arg-type]
    made = environment_with_key({"PATH": "/bin"})
    assert len(made[ENV]) == 64 and environment_with_key({ENV: "mine"})[ENV] == "mine"
    assert environment_with_key({})[ENV] != environment_with_key({})[ENV]


def test_round_trip_through_prefix_and_guard(raw_store: Any) -> None:
    wrapped = guarded(AuthenticatedStore(raw_store, AuthKey("k")))  # held: torch keeps no Python wrapper alive
    store = PrefixStore("job", wrapped)
    store.set("a", "hello")
    cast(Any, store).set("b", b"\x00\xff")  # torch takes bytes; its stubs say str
    assert store.get("a") == b"hello" and store.get("b") == b"\x00\xff"
    assert raw_store.get("job/a") != b"hello"  # what the store holds is MAC || payload
    assert store.compare_set("c", "", "one") == b"one"
    assert store.compare_set("c", "one", "two") == b"two"
    assert store.compare_set("c", "nope", "three") == b"two"
    assert store.add("n", 2) == 2 and store.add("n", 3) == 5
    assert auth_key_of(store) == AuthKey("k")


def test_poisoned_value_names_the_key(raw_store: Any) -> None:
    store = AuthenticatedStore(raw_store, AuthKey("k"))
    for junk in (b"", b"\xff\xfe not utf-8", b"x" * 100):
        raw_store.set("poisoned", junk)
        with pytest.raises(AuthenticationError, match="'poisoned'.*no member of this authenticated job") as info:
            store.get("poisoned")
        assert info.value.key == "poisoned"


def test_value_moved_to_another_key_is_refused(raw_store: Any) -> None:
    store = AuthenticatedStore(raw_store, AuthKey("k"))
    store.set("addr/1", "10.0.0.1:1234")
    raw_store.set("addr/2", raw_store.get("addr/1"))  # a genuine value, replayed under another key
    with pytest.raises(AuthenticationError, match="addr/2"):
        store.get("addr/2")


def test_wrong_key_is_refused(raw_store: Any) -> None:
    AuthenticatedStore(raw_store, AuthKey("one")).set("k", "v")
    with pytest.raises(AuthenticationError, match="another secret"):
        AuthenticatedStore(raw_store, AuthKey("two")).get("k")


def test_poisoned_counter_is_an_error_not_a_crash(raw_store: Any) -> None:
    store = guarded(AuthenticatedStore(raw_store, AuthKey("k")))
    raw_store.set("counter", "not a number")
    with pytest.raises(AuthenticationError, match="'counter' is a counter"):
        store.add("counter", 1)
    assert store.add("fine", 1) == 1  # the store still works (torch's server would have dropped us)


def test_authenticated_wraps_once() -> None:
    raw = HashStore()
    assert authenticated(raw, None) is raw
    wrapped = authenticated(raw, AuthKey("k"))
    assert authenticated(wrapped, AuthKey("k")) is wrapped
    with pytest.raises(ValueError, match="another secret"):
        authenticated(wrapped, AuthKey("other"))


def _threads(size: int, body: Callable[[int], Any]) -> list[Any]:
    out: list[Any] = [None] * size
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            out[rank] = body(rank)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return out


def test_group_with_key_is_authenticated_and_subgroups_inherit() -> None:
    store = HashStore()

    def body(rank: int) -> tuple[bool, bool, str, list[float]]:
        with ProcessGroup(store, rank, 2, backends="tcp", auth_key="job-secret", timeout=20) as g:
            t = torch.full((3,), float(rank + 1))
            g.all_reduce(t)
            with g.new_group([0, 1]) as sub:
                return g.authenticated, sub.authenticated, repr(g), t.tolist()

    for authed, sub_authed, shown, values in _threads(2, body):
        assert authed and sub_authed and values == [3.0, 3.0, 3.0]
        assert "authenticated" in shown and "job-secret" not in shown


def test_member_with_another_key_cannot_join() -> None:
    store = HashStore()
    first = ProcessGroup(store, 0, 2, backends="tcp", auth_key="one", timeout=5)  # forms without waiting
    try:
        with pytest.raises(AuthenticationError, match="no member of this authenticated job"):
            ProcessGroup(store, 1, 2, backends="tcp", auth_key="two", timeout=5)
    finally:
        first.abort()


def test_group_without_key_is_unchanged() -> None:
    store = HashStore()
    with ProcessGroup(store, 0, 1, backends="tcp") as g:
        assert not g.authenticated and "authenticated" not in repr(g)
        assert g.objects == "pickle"


# -- restricted object loading ---------------------------------------------------------------


class _Allowed:
    def __init__(self, x: int) -> None:
        self.x = x


class _Evil:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.path}",))


def _load(obj: Any, how: Loader) -> Any:
    from pg_core.messages import OBJECT, encode, parse

    data = bytearray().join(bytes(p) for p in encode(OBJECT, obj).parts())
    return parse(data, src=0).value({}, None, how)


def test_restricted_loads_plain_values_and_torch_types() -> None:
    value: dict[str, Any] = {
        "a": [1, 2.5, "s", b"b", None, True],
        "t": torch.arange(3),
        "d": torch.float16,
        "dev": torch.device("cpu"),
        "size": torch.Size([2, 3]),
        "set": {1, 2},
        "fs": frozenset({3}),
        "c": 1 + 2j,
        "r": range(3),
    }
    got = _load(value, loader("restricted", {}))
    assert got["a"] == value["a"] and torch.equal(got["t"], value["t"]) and got["d"] is torch.float16
    assert got["dev"] == value["dev"] and got["size"] == value["size"] and got["set"] == {1, 2}
    assert got["c"] == 1 + 2j and got["r"] == range(3) and got["fs"] == frozenset({3})


def test_restricted_refuses_a_malicious_pickle_and_runs_nothing(tmp_path: Path) -> None:
    target = tmp_path / "pwned"
    with pytest.raises(ForbiddenObjectError, match=r"posix\.system|os\.system") as info:
        _load(_Evil(str(target)), loader("restricted", {}))
    assert "system" in info.value.name
    assert not target.exists()
    with pytest.raises(ForbiddenObjectError, match="_Allowed"):
        _load(_Allowed(1), loader("restricted", {}))
    assert _load(_Allowed(7), loader([_Allowed], {})).x == 7
    raw = pickle.dumps(_Evil(str(target)))
    with pytest.raises(ForbiddenObjectError):
        Loader("restricted").find(*_global_of(raw))
    assert not target.exists()


def _global_of(raw: bytes) -> tuple[str, str]:
    """The first global a pickle stream names (module, name)."""
    found: list[tuple[str, str]] = []

    class Spy(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            found.append((module, name))
            raise pickle.UnpicklingError("stop")

    with pytest.raises(pickle.UnpicklingError):
        Spy(io.BytesIO(raw)).load()
    return found[0]


def test_loader_setting() -> None:
    assert loader(None, {}).mode == "pickle"
    assert loader(None, {"PG_CORE_OBJECTS": "restricted"}).mode == "restricted"
    with pytest.raises(ValueError, match="PG_CORE_OBJECTS"):
        loader(None, {"PG_CORE_OBJECTS": "yaml"})
    with pytest.raises(ValueError, match="objects="):
        loader("safe", {})
    with pytest.raises(TypeError, match="not a class"):
        loader([3], {})  # type: ignore[list-item]
