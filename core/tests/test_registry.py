"""The plugin registry: in-process registrations, and real plugin distributions installed with pip."""

from __future__ import annotations

import re
import runpy
import shutil
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from pg_core import registry as registry_module
from pg_core.backend import API_VERSION, Backend, BackendSpec
from pg_core.errors import (
    BackendNotFoundError,
    BackendUnavailableError,
    NotSupportedError,
    PluginConflictError,
    PluginLoadError,
    PluginVersionError,
)
from pg_core.registry import ENTRY_POINT_GROUP, PluginEntry, Registry, default_registry, register_backend

_INSTALL = runpy.run_path(str(Path(__file__).parent / "plugins" / "install.py"))


def spec(name: str, *, devices: tuple[str, ...] = ("cpu",), priority: int = 0, why: str | None = None) -> BackendSpec:
    return BackendSpec(name, Backend, devices=devices, priority=priority, is_available=lambda: why)


def by_name(entries: list[PluginEntry]) -> dict[str, list[PluginEntry]]:
    result: dict[str, list[PluginEntry]] = {}
    for entry in entries:
        result.setdefault(entry.name, []).append(entry)
    return result


# -- in-process registrations ------------------------------------------------------


def test_entry_point_group_is_the_contracts() -> None:
    assert ENTRY_POINT_GROUP == "pg_core.backends"


def test_register_then_get_and_list() -> None:
    reg = Registry(load_entry_points=False)
    assert reg.entries() == []
    s = spec("mine", devices=("cpu", "cuda"), priority=3)
    reg.register(s)
    assert reg.get("mine") is s
    [entry] = reg.entries()
    assert entry == PluginEntry(
        name="mine",
        distribution=None,
        version=None,
        entry_point=None,
        api_version=API_VERSION,
        devices=("cpu", "cuda"),
        priority=3,
        status="available",
        reason=None,
        spec=s,
    )


def test_available_for_orders_by_priority_then_name_and_skips_unusable() -> None:
    reg = Registry(load_entry_points=False)
    for s in [
        spec("b", priority=1),
        spec("a", priority=1),
        spec("high", priority=9),
        spec("low", priority=-5),
        spec("gpu", devices=("cuda",), priority=100),
        spec("down", priority=50, why="needs a unicorn"),
    ]:
        reg.register(s)
    assert [s.name for s in reg.available_for("cpu")] == ["high", "a", "b", "low"]
    assert [s.name for s in reg.available_for("cuda")] == ["gpu"]
    assert reg.available_for("xpu") == []
    assert reg.default_for("cpu").name == "high"


def test_unavailable_entry_reports_its_reason_and_a_raising_probe_is_a_reason() -> None:
    def explode() -> str | None:
        raise RuntimeError("driver exploded")

    reg = Registry(load_entry_points=False)
    reg.register(spec("down", why="torch was built without CUDA"))
    reg.register(BackendSpec("boom", Backend, devices=("cpu",), is_available=explode))
    entries = {e.name: e for e in reg.entries()}
    assert (entries["down"].status, entries["down"].reason) == ("unavailable", "torch was built without CUDA")
    assert entries["boom"].status == "unavailable"
    assert entries["boom"].reason == "is_available() raised RuntimeError: driver exploded"


def test_availability_is_probed_once_per_spec_until_refresh() -> None:
    calls: list[int] = []

    def probe() -> str | None:
        calls.append(1)
        return None

    reg = Registry(load_entry_points=False)
    reg.register(BackendSpec("probed", Backend, devices=("cpu",), is_available=probe))
    reg.entries()
    reg.require("probed", "cpu")
    reg.available_for("cpu")
    reg.default_for("cpu")
    assert len(calls) == 1
    reg.refresh()
    reg.entries()
    assert len(calls) == 2


def test_require_unavailable_names_reason_and_alternatives_for_the_device() -> None:
    reg = Registry(load_entry_points=False)
    reg.register(spec("nccl", devices=("cpu", "cuda"), why="torch was built without CUDA"))
    reg.register(spec("tcp", priority=1))
    reg.register(spec("gloo"))
    with pytest.raises(BackendUnavailableError) as info:
        reg.require("nccl", "cpu")
    assert str(info.value) == (
        "Backend 'nccl' is installed but unavailable: torch was built without CUDA. "
        "Installed and available for 'cpu': tcp, gloo."
    )
    with pytest.raises(BackendUnavailableError, match=r"Installed and available: tcp \(cpu\), gloo \(cpu\)"):
        reg.require("nccl")
    assert reg.require("tcp", "cpu").name == "tcp"
    assert reg.require("tcp").name == "tcp"


def test_require_undeclared_device_names_the_declared_ones() -> None:
    reg = Registry(load_entry_points=False)
    reg.register(spec("tcp", devices=("cpu",)))
    reg.register(spec("nccl", devices=("cuda",)))
    with pytest.raises(NotSupportedError) as info:
        reg.require("tcp", "cuda")
    assert "Backend 'tcp' does not support device 'cuda': it declares cpu." in str(info.value)
    assert "Installed and available for 'cuda': nccl." in str(info.value)


def test_default_for_with_nothing_installed_says_how_to_get_the_default() -> None:
    reg = Registry(load_entry_points=False)
    with pytest.raises(BackendNotFoundError) as info:
        reg.default_for("cpu")
    message = str(info.value)
    assert "pg-core alone has no backend" in message
    assert "`pip install pg-core[tcp]` gives the pure-Python default" in message


def test_default_for_lists_what_is_installed_and_why_each_is_unusable() -> None:
    reg = Registry(load_entry_points=False)
    reg.register(spec("nccl", devices=("cuda",)))
    reg.register(spec("slow", why="MPI was not launched"))
    with pytest.raises(BackendNotFoundError) as info:
        reg.default_for("cpu")
    message = str(info.value)
    assert "No installed backend is available for device 'cpu'" in message
    assert "nccl (in-process registration): declares cuda, not 'cpu'" in message
    assert "slow (in-process registration): unavailable: MPI was not launched" in message
    assert "pip install pg-core[tcp]" in message


def test_get_unknown_lists_installed_and_suggests_a_close_name() -> None:
    reg = Registry(load_entry_points=False)
    reg.register(spec("gloo"))
    reg.register(spec("tcp"))
    with pytest.raises(BackendNotFoundError) as info:
        reg.get("glo")
    assert str(info.value) == (
        "Unknown backend 'glo'. Installed: gloo (in-process registration), tcp (in-process registration). "
        "Did you mean 'gloo'?"
    )
    assert isinstance(info.value, LookupError)
    with pytest.raises(
        BackendNotFoundError,
        match=r"no backend is installed\. pg-core alone has no backend\. `pip install pg-core\[tcp\]`",
    ):
        Registry(load_entry_points=False).get("tcp")


@pytest.mark.parametrize("bad", ["", "@dist", "tcp@", " @ "])
def test_get_rejects_malformed_names(bad: str) -> None:
    with pytest.raises(ValueError, match="'name' or 'name@distribution'"):
        Registry(load_entry_points=False).get(bad)


def test_register_clash_is_a_conflict_unless_override() -> None:
    reg = Registry(load_entry_points=False)
    first, second = spec("mine"), spec("mine", priority=5)
    reg.register(first)
    reg.register(first)  # the same spec again: nothing to do
    with pytest.raises(
        PluginConflictError, match=r"already provided by in-process registration.*override=True"
    ) as info:
        reg.register(second)
    assert info.value.name == "mine"
    assert reg.get("mine") is first
    reg.register(second, override=True)
    assert reg.get("mine") is second
    assert [e.spec for e in reg.entries()] == [second]


def test_register_checks_the_api_major_version_and_the_type() -> None:
    reg = Registry(load_entry_points=False)
    with pytest.raises(
        PluginVersionError, match=rf"written for backend API 2\.0.*implements API {re.escape(API_VERSION)}"
    ):
        reg.register(BackendSpec("future", Backend, devices=("cpu",), api_version="2.0"))
    with pytest.raises(PluginVersionError, match=r"not 'MAJOR\.MINOR'"):
        reg.register(BackendSpec("weird", Backend, devices=("cpu",), api_version="one"))
    reg.register(BackendSpec("newer-minor", Backend, devices=("cpu",), api_version="1.9"))
    with pytest.raises(TypeError, match=r"takes a pg_core\.BackendSpec"):
        reg.register("tcp")  # type: ignore[arg-type]
    assert [e.name for e in reg.entries()] == ["newer-minor"]


def test_concurrent_registration_loses_nothing() -> None:
    reg = Registry(load_entry_points=False)
    barrier = threading.Barrier(8)

    def worker(i: int) -> None:
        barrier.wait()
        for j in range(25):
            reg.register(spec(f"b{i}-{j}"))
            reg.entries()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(reg.entries()) == 200


def test_default_registry_is_one_object_and_register_backend_uses_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry_module, "_default_registry", None)
    seen: list[Registry] = []
    barrier = threading.Barrier(8)

    def worker() -> None:
        barrier.wait()
        seen.append(default_registry())

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(r) for r in seen}) == 1

    isolated = Registry(load_entry_points=False)
    monkeypatch.setattr(registry_module, "_default_registry", isolated)
    s = spec("from-helper")
    register_backend(s)
    assert isolated.get("from-helper") is s


# -- real plugin distributions, installed with pip ---------------------------------------


@pytest.fixture(scope="session")
def plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _INSTALL["install_plugins"](tmp_path_factory.getbasetemp())


def _forget_test_plugins() -> None:
    for name in list(sys.modules):
        if name.partition(".")[0] in _INSTALL["MODULES"]:
            del sys.modules[name]


@pytest.fixture
def installed(plugin_site: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Registry]]:
    """A factory of registries that see the test plugins (``environ`` as keyword arguments)."""
    _forget_test_plugins()
    monkeypatch.syspath_prepend(str(plugin_site))

    def make(**environ: str) -> Registry:
        return Registry(environ=environ)

    yield make
    _forget_test_plugins()


def test_discovery_waits_for_first_use(installed: Callable[..., Registry]) -> None:
    reg = installed()
    assert "pg_good_plugin" not in sys.modules
    reg.available_for("cpu")
    assert "pg_good_plugin.plugin" in sys.modules


def test_installed_plugins_are_listed_with_their_distribution(installed: Callable[..., Registry]) -> None:
    entries = by_name(installed().entries())
    [good] = entries["good"]
    assert (good.status, good.reason) == ("available", None)
    assert (good.distribution, good.version, good.entry_point) == (
        "pg-good-plugin",
        "0.1.0",
        "good = pg_good_plugin.plugin",
    )
    assert (good.api_version, good.devices, good.priority) == (API_VERSION, ("cpu",), 7)
    [unicorn] = entries["unicorn"]
    assert (unicorn.status, unicorn.reason) == ("unavailable", "no unicorn in this machine")
    assert "tcp" in entries or "pg-tcp" not in {e.distribution for es in entries.values() for e in es}


def test_spec_gets_its_distribution_and_listing_does_not_import_the_factory(installed: Callable[..., Registry]) -> None:
    reg = installed()
    good = reg.get("good")
    assert (good.distribution, good.version) == ("pg-good-plugin", "0.1.0")
    assert reg.get("good@pg-good-plugin") is good
    assert reg.get("good@PG_Good.Plugin") is good
    assert "pg_good_plugin.plugin" in sys.modules
    assert "pg_good_plugin.backend" not in sys.modules
    assert good.load_factory().__name__ == "GoodBackend"


def test_broken_plugins_are_listed_and_do_not_break_others(installed: Callable[..., Registry]) -> None:
    reg = installed()
    entries = by_name(reg.entries())
    [bad] = entries["bad"]
    assert (bad.status, bad.distribution, bad.spec) == ("broken", "pg-bad-plugin", None)
    assert bad.reason == "ImportError: pg_bad_plugin needs libunicorn.so, which is not installed"
    [garbage] = entries["garbage"]
    assert garbage.status == "broken"
    assert garbage.reason is not None and garbage.reason.startswith("TypeError: pg_core_backends() of 'garbage = ")
    assert "returned 42 (int)" in garbage.reason
    assert reg.get("good").name == "good"

    with pytest.raises(PluginLoadError) as info:
        reg.get("bad")
    assert info.value.distribution == "pg-bad-plugin"
    assert isinstance(info.value.__cause__, ImportError)
    assert "Plugin 'bad = pg_bad_plugin.plugin' from pg-bad-plugin 0.1.0 failed to load" in str(info.value)
    assert "PG_CORE_DISABLE_PLUGINS=bad" in str(info.value)

    with pytest.raises(BackendNotFoundError) as unknown:
        reg.get("nope")
    message = str(unknown.value)
    assert message.startswith("Unknown backend 'nope'. Installed: ")
    assert "good (pg-good-plugin 0.1.0)" in message
    assert "dup (pg-dup-a 0.1.0, pg-dup-b 0.1.0)" in message
    assert "Broken: " in message
    assert "bad (pg-bad-plugin 0.1.0): ImportError: pg_bad_plugin needs libunicorn.so" in message


def test_api_major_mismatch_is_broken_with_a_version_error(installed: Callable[..., Registry]) -> None:
    reg = installed()
    [api2] = by_name(reg.entries())["api2"]
    assert (api2.status, api2.api_version, api2.distribution) == ("broken", "2.0", "pg-api2-plugin")
    assert api2.reason is not None and api2.reason.startswith("PluginVersionError: ")
    with pytest.raises(PluginVersionError) as info:
        reg.get("api2")
    assert info.value.distribution == "pg-api2-plugin"
    for part in ("pg-api2-plugin 0.1.0", "API 2.0", f"implements API {API_VERSION}"):
        assert part in str(info.value)
    assert "api2" not in [s.name for s in reg.available_for("cpu")]


def test_two_distributions_of_one_name_conflict_until_pinned(installed: Callable[..., Registry]) -> None:
    reg = installed()
    dups = by_name(reg.entries())["dup"]
    assert sorted((e.distribution, e.status) for e in dups) == [("pg-dup-a", "conflict"), ("pg-dup-b", "conflict")]
    a, b = sorted(dups, key=lambda e: str(e.distribution))
    assert a.reason is not None and "pg-dup-b 0.1.0" in a.reason
    assert b.reason is not None and "pg-dup-a 0.1.0" in b.reason

    with pytest.raises(PluginConflictError) as info:
        reg.get("dup")
    assert info.value.name == "dup"
    assert info.value.distributions == ("pg-dup-a", "pg-dup-b")
    for part in ("pg-dup-a 0.1.0", "pg-dup-b 0.1.0", "'dup@pg-dup-a'", "PG_CORE_PLUGINS", "PG_CORE_DISABLE_PLUGINS"):
        assert part in str(info.value)

    # both hook styles load: pg-dup-a's function is unmarked, pg-dup-b's is @hookimpl
    assert reg.get("dup@pg-dup-a").description == "from pg-dup-a"
    assert reg.get("dup@pg_dup_b").description == "from pg-dup-b"
    with pytest.raises(BackendNotFoundError, match="not provided by distribution 'pg-good-plugin'"):
        reg.get("dup@pg-good-plugin")
    assert "dup" not in [s.name for s in reg.available_for("cpu")]
    with pytest.raises(BackendNotFoundError, match=r"dup \(pg-dup-a 0\.1\.0\): conflict: also provided by pg-dup-b"):
        Registry(environ={"PG_CORE_PLUGINS": "dup"}).default_for("cpu")


def test_disable_by_distribution_does_not_import_and_resolves_a_conflict(installed: Callable[..., Registry]) -> None:
    reg = installed(PG_CORE_DISABLE_PLUGINS="pg_bad_plugin, PG-DUP-B")
    entries = by_name(reg.entries())
    assert {(e.status, e.reason) for e in entries["bad"] + entries["garbage"]} == {
        ("disabled", "named in PG_CORE_DISABLE_PLUGINS=pg_bad_plugin, PG-DUP-B")
    }
    assert [(e.distribution, e.status) for e in entries["dup"]] == [("pg-dup-a", "available"), ("pg-dup-b", "disabled")]
    assert reg.get("dup").distribution == "pg-dup-a"
    assert "pg_bad_plugin" not in sys.modules
    assert "pg_dup_b" not in sys.modules
    with pytest.raises(BackendNotFoundError, match=r"Backend 'bad' from pg-bad-plugin 0\.1\.0 is disabled"):
        reg.get("bad")


def test_disable_by_backend_name_lists_it_disabled(installed: Callable[..., Registry]) -> None:
    reg = installed(PG_CORE_DISABLE_PLUGINS="unicorn,garbage")
    entries = by_name(reg.entries())
    assert entries["unicorn"][0].status == "disabled"
    assert entries["unicorn"][0].spec is not None
    assert entries["garbage"][0].status == "disabled"
    assert entries["good"][0].status == "available"
    with pytest.raises(BackendNotFoundError, match="named in PG_CORE_DISABLE_PLUGINS=unicorn,garbage"):
        reg.get("unicorn")


def test_allow_list_loads_only_what_it_names(installed: Callable[..., Registry]) -> None:
    reg = installed(PG_CORE_PLUGINS="good,pg-dup-b")
    statuses = {(e.name, e.distribution): e.status for e in reg.entries()}
    assert statuses[("good", "pg-good-plugin")] == "available"
    assert statuses[("unicorn", "pg-good-plugin")] == "unavailable"
    assert statuses[("dup", "pg-dup-b")] == "available"
    assert statuses[("dup", "pg-dup-a")] == "disabled"
    assert statuses[("bad", "pg-bad-plugin")] == "disabled"
    assert statuses[("api2", "pg-api2-plugin")] == "disabled"
    assert reg.get("dup").distribution == "pg-dup-b"
    for module in ("pg_dup_a", "pg_bad_plugin", "pg_api2_plugin"):
        assert module not in sys.modules


def test_allow_list_by_backend_name(installed: Callable[..., Registry]) -> None:
    reg = installed(PG_CORE_PLUGINS="unicorn")
    statuses = {e.name: e.status for e in reg.entries() if e.distribution == "pg-good-plugin"}
    assert statuses == {"unicorn": "unavailable", "good": "disabled"}
    with pytest.raises(BackendNotFoundError, match="not in PG_CORE_PLUGINS=unicorn"):
        reg.get("good")


def test_one_distribution_seen_twice_is_not_a_conflict(
    installed: Callable[..., Registry], plugin_site: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the same distribution again, later on sys.path (an editable and a regular install, say)
    for item in ("pg_good_plugin", "pg_good_plugin-0.1.0.dist-info"):
        shutil.copytree(plugin_site / item, tmp_path / item)
    sys.path.insert(sys.path.index(str(plugin_site)) + 1, str(tmp_path))
    assert sys.path.index(str(tmp_path)) > sys.path.index(str(plugin_site))
    [good] = by_name(installed().entries())["good"]
    assert good.status == "available"


def test_refresh_discovers_a_distribution_installed_after_first_use(
    plugin_site: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _forget_test_plugins()
    reg = Registry(environ={})
    with pytest.raises(BackendNotFoundError):
        reg.get("good")
    monkeypatch.syspath_prepend(str(plugin_site))
    try:
        with pytest.raises(BackendNotFoundError):
            reg.get("good")  # what was discovered stays until refresh()
        reg.refresh()
        assert reg.get("good").distribution == "pg-good-plugin"
    finally:
        _forget_test_plugins()


def test_register_over_an_installed_plugin_needs_override(installed: Callable[..., Registry]) -> None:
    reg = installed()
    mine = spec("good", priority=100)
    with pytest.raises(PluginConflictError, match=r"already provided by pg-good-plugin 0\.1\.0") as info:
        reg.register(mine)
    assert info.value.distributions == ("pg-good-plugin", "in-process registration")
    reg.register(mine, override=True)
    assert reg.get("good") is mine
    assert reg.default_for("cpu") is mine
    shadowed = [e for e in reg.entries() if e.name == "good" and e.distribution == "pg-good-plugin"]
    assert [(e.status, e.reason) for e in shadowed] == [
        ("disabled", "overridden in-process by register_backend(override=True)")
    ]


# -- backend references on command lines (resolve_backend_ref) ---------------------------------------

_SPEC_FILE = """
import threading

from pg_core.backend import Backend, BackendSpec

SPEC = BackendSpec(name="mytcp", factory="pg_tcp.backend:TCPBackend", devices=("cpu",))
FUTURE = BackendSpec(name="future", factory="pg_tcp.backend:TCPBackend", devices=("cpu",), api_version="2.0")
NOWHERE = BackendSpec(name="nowhere", factory="pg_tcp.backend:TCPBackend", devices=("cpu",), is_available=lambda: "no unicorn")
LIMIT = 4


class MyBackend(Backend):
    devices = ("cpu",)


def helper():
    return None
"""


@pytest.fixture
def spec_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_spec.py"
    path.write_text(_SPEC_FILE)
    return path


def test_a_file_reference_names_a_spec_and_loads_once(spec_file: Path) -> None:
    from pg_core.backend_refs import resolve_backend_ref

    got = resolve_backend_ref(f"{spec_file}:SPEC", "cpu")
    assert (got.name, got.factory, got.devices) == ("mytcp", "pg_tcp.backend:TCPBackend", ("cpu",))
    assert resolve_backend_ref(f" {spec_file}:SPEC ") is got  # the file ran once in this process
    with pytest.raises(NotSupportedError, match=r"'mytcp'.*does not support device 'cuda'.*declares cpu"):
        resolve_backend_ref(f"{spec_file}:SPEC", "cuda")


def test_a_wrong_attribute_names_the_file_the_attribute_and_what_the_file_defines(spec_file: Path) -> None:
    from pg_core.backend_refs import resolve_backend_ref

    ref = f"{spec_file}:SPECC"
    with pytest.raises(BackendNotFoundError) as info:
        resolve_backend_ref(ref)
    message = str(info.value)
    assert message.startswith(f"cannot load {ref!r}: file {spec_file} defines no 'SPECC'. It defines: ")
    assert "SPEC (BackendSpec named 'mytcp')" in message and "MyBackend (Backend subclass)" in message
    assert "LIMIT (int)" in message and "helper (function)" in message
    assert "threading" not in message and "BackendSpec (" not in message  # imported, not defined there
    assert message.endswith("Did you mean 'SPEC'?")
    assert "pg_core_backend_file_" not in message  # never the private module name it runs under


def test_file_and_module_references_of_every_kind(spec_file: Path, tmp_path: Path) -> None:
    from pg_core.backend_refs import resolve_backend_ref

    wrapped = resolve_backend_ref(f"{spec_file}:MyBackend")  # a Backend subclass gets a spec named after it
    assert (wrapped.name, wrapped.devices, wrapped.factory.__name__) == ("MyBackend", ("cpu",), "MyBackend")
    with pytest.raises(BackendNotFoundError, match=r"MyBackend in file .* is a Backend subclass, not a BackendSpec\."):
        resolve_backend_ref(f"{spec_file}:MyBackend", factories=False)
    with pytest.raises(BackendNotFoundError, match=r"LIMIT in file .* is an int, not a BackendSpec"):
        resolve_backend_ref(f"{spec_file}:LIMIT")
    with pytest.raises(PluginVersionError, match=r"'future' from file .* written for backend API 2\.0"):
        resolve_backend_ref(f"{spec_file}:FUTURE")
    with pytest.raises(BackendUnavailableError, match=r"'nowhere' .* cannot run here: no unicorn"):
        resolve_backend_ref(f"{spec_file}:NOWHERE")
    with pytest.raises(BackendNotFoundError, match=r"there is no file .*missing\.py"):
        resolve_backend_ref(f"{tmp_path / 'missing.py'}:SPEC")
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('planted')\n")
    with pytest.raises(PluginLoadError, match=r"running .*broken\.py failed: RuntimeError: planted"):
        resolve_backend_ref(f"{broken}:SPEC")
    with pytest.raises(BackendNotFoundError, match=r"module pg_core\.backend defines no 'Nope'"):
        resolve_backend_ref("pg_core.backend:Nope")
    with pytest.raises(BackendNotFoundError, match=r"there is no module 'no_such_module_pg'"):
        resolve_backend_ref("no_such_module_pg:SPEC")
    with pytest.raises(BackendNotFoundError, match=r"is not a backend reference"):
        resolve_backend_ref("tcp:")


def test_an_absolute_reference_names_the_same_file_from_any_directory(
    spec_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pg_core.backend_refs import absolute_backend_ref, resolve_backend_ref

    monkeypatch.chdir(spec_file.parent)
    absolute = absolute_backend_ref(" my_spec.py:SPEC ")
    assert absolute == f"{spec_file}:SPEC"
    assert absolute_backend_ref(f"./sub/../{spec_file.name}:SPEC") == absolute
    assert absolute_backend_ref(absolute) == absolute
    got = resolve_backend_ref("my_spec.py:SPEC")
    other = tmp_path / "elsewhere"
    other.mkdir()
    monkeypatch.chdir(other)
    assert resolve_backend_ref(absolute) is got  # the same file, so the same module, run once
    with pytest.raises(BackendNotFoundError, match="there is no file my_spec.py"):
        resolve_backend_ref("my_spec.py:SPEC")
    for unchanged in ("tcp", "tcp@pg-tcp", "pg_core.backend:SPEC", "tcp:"):
        assert absolute_backend_ref(unchanged) == unchanged


def test_a_name_reference_is_the_registrys() -> None:
    from pg_core.backend_refs import resolve_backend_ref

    reg = Registry(load_entry_points=False)
    s = spec("mine")
    reg.register(s)
    assert resolve_backend_ref("mine", "cpu", registry=reg) is s
    with pytest.raises(BackendNotFoundError, match="Unknown backend 'theirs'"):
        resolve_backend_ref("theirs", registry=reg)


def test_a_backend_class_gets_one_spec_whether_given_to_backends_or_named_on_a_command_line(
    spec_file: Path, tmp_path: Path
) -> None:
    from pg_core.backend_refs import resolve_backend_ref
    from pg_core.dispatch import resolve_backends

    (tmp_path / "named_backends.py").write_text(
        "from pg_core.backend import Backend, Capabilities\n"
        "class Plain(Backend):\n    devices = ('cpu', 'meta')\n"
        "class Named(Backend):\n    name = 'my-named'\n    capabilities = Capabilities(ops=frozenset({'all_reduce'}))\n"
        "ALIAS = Named\n"
    )
    for attr, name in [("Plain", "Plain"), ("Named", "my-named"), ("ALIAS", "my-named")]:
        ref = resolve_backend_ref(f"{tmp_path / 'named_backends.py'}:{attr}")
        given = resolve_backends(ref.factory)
        assert ref.name == name and {s.name for s in given.values()} == {name}
        assert set(given) == set(ref.devices) and given[ref.devices[0]].capabilities == ref.capabilities
    assert resolve_backend_ref(f"{tmp_path / 'named_backends.py'}:Plain").devices == ("cpu", "meta")


def test_the_resolver_is_still_found_under_its_old_module() -> None:
    from pg_core import backend_refs, registry

    assert registry.resolve_backend_ref is backend_refs.resolve_backend_ref  # type: ignore[attr-defined]
    assert registry.absolute_backend_ref is backend_refs.absolute_backend_ref  # type: ignore[attr-defined]
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        registry.nothing_here  # type: ignore[attr-defined]
