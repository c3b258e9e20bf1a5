"""The pytest plugin of pg-core's conformance suite (entry point ``pytest11``).

A top-level module on purpose: pytest loads it in every session of every
project that has pg-core installed, so it only registers options, a marker and
a fixture, and imports neither pg_core nor torch nor hypothesis until a run asks
for the suite (``--pg-backend``). The suite itself runs with::

    pytest --pg-backend NAME --pyargs pg_core.testing

or, the same with a summary table, ``pg-core conformance NAME``. ``NAME`` is any
backend reference :func:`pg_core.backend_refs.resolve_backend_ref` reads: a registered
name, ``package.module:ATTR`` or ``path/to/file.py:ATTR`` naming a ``BackendSpec``.

``--pg-xfail FILE`` lists a plugin's known gaps, one conformance test name (or
an ``fnmatch`` pattern) per line, ``#`` starting a comment that is used as the
reason. They are strict: a listed test that passes fails the run, and a line
that matches no test is an error.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator
from typing import Any

import pytest

_SUITE = pytest.StashKey[Any]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("pg-core", "pg-core conformance suite")
    group.addoption(
        "--pg-backend",
        metavar="NAME",
        help="backend to certify: a registered name (name@distribution pins one), or package.module:ATTR or "
        "path/to/file.py:ATTR naming a BackendSpec (a relative path is relative to the current directory)",
    )
    group.addoption(
        "--pg-world-sizes", metavar="LIST", default="1,2,3,4", help="comma-separated world sizes (default 1,2,3,4)"
    )
    group.addoption(
        "--pg-max-examples", metavar="N", type=int, default=None, help="examples per test (default: profile)"
    )
    group.addoption(
        "--pg-profile", choices=("ci", "thorough"), default="ci", help="ci: derandomized, bounded (default)"
    )
    group.addoption("--pg-xfail", metavar="FILE", default=None, help="the backend's known gaps (strict xfail)")
    group.addoption("--pg-device", metavar="TYPE", action="append", default=None, help="only this device type")
    group.addoption(
        "--pg-replay",
        nargs=2,
        metavar=("TEST", "EXAMPLE"),
        default=None,
        help="run exactly one example (from a failure)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "pg_conformance(test): a pg-core conformance test, as named in --pg-xfail files")


def _xfails(path: str) -> list[tuple[str, str]]:
    entries = []
    with open(path, encoding="utf-8") as f:
        for raw in f:
            pattern, _, reason = raw.partition("#")
            if pattern.strip():
                entries.append((pattern.strip(), reason.strip() or f"listed in {path}"))
    return entries


def _backend(config: pytest.Config) -> str:
    """The backend to certify; running the suite without one is a usage error, not a skip."""
    backend = config.getoption("pg_backend")
    if not backend:
        raise pytest.UsageError(
            "the pg-core conformance suite needs a backend to certify: pass --pg-backend NAME "
            "(or run `pg-core conformance NAME`)"
        )
    return str(backend)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    names = {}
    for item in items:
        marker = item.get_closest_marker("pg_conformance")
        if marker is not None and marker.args:
            names[item] = str(marker.args[0])
    if names:
        _backend(config)
    path = config.getoption("pg_xfail")
    if path:
        entries = _xfails(path)
        for pattern, _ in entries:
            if not any(fnmatch.fnmatchcase(name, pattern) for name in names.values()):
                known = ", ".join(sorted(set(names.values())))
                raise pytest.UsageError(f"{path}: {pattern!r} matches no conformance test ({known})")
        for item, name in names.items():
            for pattern, reason in entries:
                if fnmatch.fnmatchcase(name, pattern):
                    item.add_marker(pytest.mark.xfail(strict=True, reason=reason))
                    break
    replay = config.getoption("pg_replay")
    if replay is not None:  # run exactly the replayed test
        keep = [item for item, name in names.items() if name == replay[0]]
        if not keep:
            raise pytest.UsageError(f"--pg-replay: no conformance test named {replay[0]!r}")
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep


@pytest.fixture(scope="session")
def pg_conformance(request: pytest.FixtureRequest) -> Iterator[Any]:
    """The :class:`~pg_core.testing.harness.Conformance` for ``--pg-backend``."""
    config = request.config
    backend = _backend(config)
    try:
        import hypothesis  # noqa: F401
    except ImportError:
        raise pytest.UsageError("the conformance suite needs hypothesis: pip install 'pg-core[testing]'") from None
    from pg_core.testing.harness import Conformance

    sizes = [int(s) for s in str(config.getoption("pg_world_sizes")).split(",") if s.strip()]
    suite = Conformance(
        backend,
        world_sizes=sizes,
        profile=config.getoption("pg_profile"),
        max_examples=config.getoption("pg_max_examples"),
        devices=config.getoption("pg_device"),
    )
    config.stash[_SUITE] = suite
    try:
        yield suite
    finally:
        suite.close()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    suite = config.stash.get(_SUITE, None)
    if suite is None:
        return
    terminalreporter.write_sep("=", f"pg-core conformance: {suite.backend_ref} ({suite.profile.name} profile)")
    terminalreporter.write_line(
        f"world sizes {', '.join(map(str, suite.world_sizes))}; devices {', '.join(suite.devices)}"
    )
    for device, why in suite.skipped_devices.items():
        terminalreporter.write_line(f"device {device} not tested: {why}")
    terminalreporter.write_line(suite.summary())
