"""The in-repo backends are required by the workspace's tests: a missing, disabled or broken
one fails the tests that need it, naming the backend and the reason; it never skips.

Each case runs pytest in a fresh process on real in-repo test modules, with the backend taken
away through ``PG_CORE_DISABLE_PLUGINS`` (and, for "broken", replaced by a distribution whose
plugin cannot be imported), and checks that the run failed with that message and skipped
nothing. (The shipped suite's skip for an uninstalled third-party backend is another matter,
tested in tests/conformance/test_tooling.py.)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _pytest(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PG_CORE_"))}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _summary(proc: subprocess.CompletedProcess[str]) -> str:
    """pytest's last line: ``2 errors in 0.81s``."""
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _assert_failed_not_skipped(proc: subprocess.CompletedProcess[str], tests: int, message: str) -> None:
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output
    summary = _summary(proc)
    assert "skipped" not in summary and "passed" not in summary, output
    assert re.match(rf"{tests} errors? in ", summary), output
    assert output.count(message) >= tests, output


def test_a_disabled_tcp_fails_the_integration_tests() -> None:
    proc = _pytest("tests/integration/test_serving_example.py", env={"PG_CORE_DISABLE_PLUGINS": "tcp"})
    _assert_failed_not_skipped(
        proc, 1, "in-repo backend 'tcp' is required by make test but is disabled (from pg-tcp): named in"
    )


def test_a_disabled_storecomm_fails_its_certification_and_its_tests() -> None:
    proc = _pytest(
        "tests/conformance/test_backends.py::test_certified[storecomm]",
        "examples/third_party_plugin/tests/test_storecomm.py::test_cli_lists_the_plugin",
        env={"PG_CORE_DISABLE_PLUGINS": "storecomm"},
    )
    _assert_failed_not_skipped(proc, 2, "in-repo backend 'storecomm' is required by make test but is disabled")


def test_a_broken_tcp_fails_with_its_error(tmp_path: Path) -> None:
    # pg-tcp disabled by its distribution name, and a distribution "fake-tcp" whose plugin
    # module for the backend name "tcp" raises on import
    info = tmp_path / "fake_tcp-0.0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-tcp\nVersion: 0.0.1\n")
    (info / "entry_points.txt").write_text("[pg_core.backends]\ntcp = fake_broken_tcp\n")
    (tmp_path / "fake_broken_tcp.py").write_text('raise RuntimeError("planted: this plugin cannot be imported")\n')
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)
    proc = _pytest(
        "tests/integration/test_serving_example.py",
        env={"PG_CORE_DISABLE_PLUGINS": "pg-tcp", "PYTHONPATH": path},
    )
    _assert_failed_not_skipped(
        proc,
        1,
        "in-repo backend 'tcp' is required by make test but is broken (from fake-tcp): "
        "RuntimeError: planted: this plugin cannot be imported",
    )


def test_control_with_the_backend_installed_the_same_kind_of_test_runs_and_passes() -> None:
    proc = _pytest("examples/third_party_plugin/tests/test_storecomm.py::test_cli_lists_the_plugin", env={})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.match(r"1 passed in ", _summary(proc)), proc.stdout
