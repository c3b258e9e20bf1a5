"""The conformance suite's entry points: the pytest plugin, ``pg-core conformance``,
strict ``--xfail`` files, and the one-line replay a failure prints."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
WRONG_ROOT = f"{HERE / 'wrong_root.py'}:SPEC"


def conformance(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pg_core", "conformance", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)


def test_plugin_import_is_light() -> None:
    """pytest loads the plugin in every project that has pg-core installed: it must not import torch."""
    code = (
        "import sys, pytest_pg_core; print(sorted(m for m in ('torch', 'hypothesis', 'pg_core') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_pyargs_with_a_backend_runs_the_suite(tmp_path: Path) -> None:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--pg-backend", "tcp", "--pg-world-sizes", "1,2"]
    cmd += ["-k", "supports or barrier", "--pg-max-examples", "3", "--pyargs", "pg_core.testing"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 passed" in proc.stdout
    assert re.search(r"barrier\s+3\s", proc.stdout), proc.stdout  # the summary table counts the examples


def test_a_run_leaves_no_pool_folder_in_the_temporary_directory(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    cmd = [sys.executable, "-m", "pg_core", "conformance", "tcp", "--world-sizes", "1,2", "-k", "supports or barrier"]
    cmd += ["--max-examples", "3"]
    env = {**os.environ, "TMPDIR": str(tmp)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "barrier" in proc.stdout, proc.stdout  # the pools ran
    assert [p.name for p in tmp.iterdir() if p.name.startswith("pg-core-pool-")] == []


def test_xfail_is_strict(tmp_path: Path) -> None:
    gaps = tmp_path / "gaps.txt"
    gaps.write_text("# known gaps\nsupports  # claimed broken, but it passes\n")
    proc = conformance("tcp", "--world-sizes", "1", "-k", "supports", "--xfail", str(gaps))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "XPASS(strict)" in proc.stdout


def test_xfail_line_matching_no_test_is_an_error(tmp_path: Path) -> None:
    gaps = tmp_path / "gaps.txt"
    gaps.write_text("all_reduse\n")
    proc = conformance("tcp", "--world-sizes", "1", "-k", "supports", "--xfail", str(gaps))
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "'all_reduse' matches no conformance test" in proc.stdout + proc.stderr


def test_unknown_backend_is_a_clear_error() -> None:
    proc = conformance("no-such-backend")
    assert proc.returncode == 2
    assert "BackendNotFoundError" in proc.stderr and "no-such-backend" in proc.stderr


def test_failure_prints_a_replay_line_that_reproduces_it() -> None:
    proc = conformance(WRONG_ROOT, "--world-sizes", "2,3", "-k", "broadcast", "--max-examples", "20")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "[reference]" in proc.stdout
    lines = proc.stdout.splitlines()
    replay = lines[lines.index("replay exactly this example:") + 1].strip()
    assert replay.startswith("pg-core conformance ")
    # the shrunk example: the smallest world size where a wrong root shows, one element
    assert "world size 2" in proc.stdout
    again = conformance(*shlex.split(replay)[2:])
    assert again.returncode == 1, again.stdout + again.stderr
    assert "1 failed" in again.stdout and "[reference]" in again.stdout
    assert replay in again.stdout  # the same example, so the same line


def test_a_relative_file_reference_is_the_same_file_on_every_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Relative to the controller's directory when the suite is made; the ranks get it absolute,
    so they load that file from wherever they start; the replay line repeats it as typed."""
    from pg_core.testing.harness import Conformance, ConformanceFailure

    monkeypatch.chdir(HERE)
    with Conformance("wrong_root.py:SPEC", world_sizes=(2,), max_examples=5, shrink=False) as suite:
        assert suite.spec.name == "wrong-root"
        assert suite.rank_ref == f"{HERE / 'wrong_root.py'}:SPEC"
        monkeypatch.chdir(tmp_path)  # the rank processes start here, where there is no wrong_root.py
        with pytest.raises(ConformanceFailure) as info:
            suite.check("broadcast")
    assert info.value.check == "reference", info.value
    assert info.value.replay is not None
    assert info.value.replay.startswith("pg-core conformance wrong_root.py:SPEC --replay broadcast "), info.value.replay


def test_the_suite_without_a_backend_is_a_usage_error_not_a_skip(tmp_path: Path) -> None:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs", "--pyargs", "pg_core.testing"]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, proc.stdout + proc.stderr
    assert "--pg-backend NAME" in proc.stderr and "skipped" not in proc.stdout, proc.stdout + proc.stderr


def test_pytest_help_names_every_form_of_backend_reference() -> None:
    cmd = [sys.executable, "-m", "pytest", "-p", "pytest_pg_core", "--help"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
    text = " ".join(proc.stdout.split())
    assert "registered name" in text and "package.module:ATTR" in text and "path/to/file.py:ATTR" in text, text


def test_replay_of_a_passing_example() -> None:
    example = (
        '{"device":"cpu","lanes":[{"calls":[{"async_op":false,"dtype":"int32","late":null,"layout":"strided",'
        '"op":"all_reduce","params":{"reduce":"BXOR"},"shape":[3,5]}],"members":[0,1,2],"wait_order":[]}],'
        '"seed":7,"world_size":3}'
    )
    proc = conformance("tcp", "--replay", "all_reduce", example)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed" in proc.stdout


@pytest.mark.parametrize("bad", ["not json", '{"world_size": 2}'])
def test_replay_of_garbage_fails_clearly(bad: str) -> None:
    proc = conformance("tcp", "--replay", "all_reduce", bad)
    assert proc.returncode == 1
    assert "--pg-replay: not an example the suite printed" in proc.stdout
