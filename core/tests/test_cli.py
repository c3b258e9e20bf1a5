"""`pg-core backends` in fresh processes that see real, pip-installed plugin distributions."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pg_core import registry as registry_module
from pg_core.backend import API_VERSION, Backend, BackendSpec
from pg_core.cli import main
from pg_core.registry import Registry

_INSTALL = runpy.run_path(str(Path(__file__).parent / "plugins" / "install.py"))
_FIELDS = {"name", "distribution", "version", "entry_point", "api_version", "devices", "priority", "status", "reason"}
_STATUSES = {"available", "unavailable", "broken", "disabled", "conflict"}

# Run in the child: import pg_core imports no plugin; the registry's answers, as JSON.
_PROBE = """
import json, sys
import pg_core
from pg_core.registry import default_registry
from pg_core.errors import PGError
imported = sorted(m for m in sys.modules if m.startswith(("pg_good", "pg_bad", "pg_dup", "pg_api2")))
def outcome(name):
    try:
        spec = default_registry().get(name)
    except PGError as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"distribution": spec.distribution, "description": spec.description}
print(json.dumps({"imported_at_import": imported,
                  **{name: outcome(name) for name in ("good", "dup", "dup@pg-dup-a", "dup@pg-dup-b", "bad", "api2")}}))
"""

_CONSOLE_SCRIPT = Path(sys.executable).with_name("pg-core")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess[str]]:
    """Every child process of this module, started at once (each pays torch's import time)."""
    site = _INSTALL["install_plugins"](tmp_path_factory.getbasetemp())
    base = {k: v for k, v in os.environ.items() if not k.startswith("PG_CORE_")}
    base["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
    if _CONSOLE_SCRIPT.exists():
        pg_core_cmd = [str(_CONSOLE_SCRIPT)]
    else:  # what the console script runs
        pg_core_cmd = [sys.executable, "-c", "import sys; from pg_core.cli import main; sys.exit(main())"]
    module_cmd = [sys.executable, "-m", "pg_core"]
    commands: dict[str, tuple[list[str], dict[str, str]]] = {
        "json": ([*module_cmd, "backends", "--json"], {}),
        "table": ([*module_cmd, "backends"], {}),
        "disabled": ([*pg_core_cmd, "backends", "--json"], {"PG_CORE_DISABLE_PLUGINS": "pg-dup-b,bad"}),
        "allowed": ([*pg_core_cmd, "backends", "--json"], {"PG_CORE_PLUGINS": "good,pg_dup_a"}),
        "probe": ([sys.executable, "-c", _PROBE], {}),
    }
    procs = {
        name: subprocess.Popen(argv, env={**base, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name, (argv, env) in commands.items()
    }
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        results[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return results


def _json(run: subprocess.CompletedProcess[str]) -> dict[tuple[str, str | None], dict[str, Any]]:
    assert run.returncode == 0, run.stderr
    listing = json.loads(run.stdout)
    assert isinstance(listing, list)
    for item in listing:
        assert set(item) == _FIELDS
        assert item["status"] in _STATUSES
    return {(item["name"], item["distribution"]): item for item in listing}


def test_json_lists_every_plugin_with_its_status(runs: dict[str, subprocess.CompletedProcess[str]]) -> None:
    listing = _json(runs["json"])
    good = listing["good", "pg-good-plugin"]
    assert good == {
        "name": "good",
        "distribution": "pg-good-plugin",
        "version": "0.1.0",
        "entry_point": "good = pg_good_plugin.plugin",
        "api_version": API_VERSION,
        "devices": ["cpu"],
        "priority": 7,
        "status": "available",
        "reason": None,
    }
    assert (listing["unicorn", "pg-good-plugin"]["status"], listing["unicorn", "pg-good-plugin"]["reason"]) == (
        "unavailable",
        "no unicorn in this machine",
    )
    bad = listing["bad", "pg-bad-plugin"]
    assert bad["status"] == "broken"
    assert bad["reason"] == "ImportError: pg_bad_plugin needs libunicorn.so, which is not installed"
    assert listing["garbage", "pg-bad-plugin"]["status"] == "broken"
    api2 = listing["api2", "pg-api2-plugin"]
    assert (api2["status"], api2["api_version"]) == ("broken", "2.0")
    assert api2["reason"].startswith("PluginVersionError: ")
    for mine, other in (("pg-dup-a", "pg-dup-b"), ("pg-dup-b", "pg-dup-a")):
        assert listing["dup", mine]["status"] == "conflict"
        assert other in listing["dup", mine]["reason"]
    if any(dist == "pg-tcp" for _, dist in listing):  # written concurrently: listed, whatever its state
        assert any(name == "tcp" for name, _ in listing)


def test_table_shows_name_distribution_api_devices_priority_status(
    runs: dict[str, subprocess.CompletedProcess[str]],
) -> None:
    run = runs["table"]
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].split() == ["NAME", "DISTRIBUTION", "API", "DEVICES", "PRIORITY", "STATUS"]
    rows = {line.split()[0]: line for line in lines[1:] if line and not line.startswith(("Conflicts", "No "))}
    assert rows["good"].split() == ["good", "pg-good-plugin==0.1.0", API_VERSION, "cpu", "7", "available"]
    assert "unavailable: no unicorn in this machine" in rows["unicorn"]
    assert "broken: ImportError: pg_bad_plugin needs libunicorn.so" in rows["bad"]
    assert "broken: PluginVersionError:" in rows["api2"]
    dup_rows = [line for line in lines if line.startswith("dup ")]
    assert len(dup_rows) == 2
    assert all("conflict: also provided by pg-dup-" in row for row in dup_rows)
    assert "Conflicts: pin one provider as 'name@distribution'" in run.stdout


def test_disable_list_steers_loading(runs: dict[str, subprocess.CompletedProcess[str]]) -> None:
    listing = _json(runs["disabled"])
    assert listing["dup", "pg-dup-a"]["status"] == "available"
    assert listing["dup", "pg-dup-b"]["status"] == "disabled"
    assert listing["dup", "pg-dup-b"]["reason"] == "named in PG_CORE_DISABLE_PLUGINS=pg-dup-b,bad"
    assert listing["bad", "pg-bad-plugin"]["status"] == "disabled"
    assert listing["garbage", "pg-bad-plugin"]["status"] == "broken"  # same distribution, not named
    assert listing["good", "pg-good-plugin"]["status"] == "available"


def test_allow_list_steers_loading(runs: dict[str, subprocess.CompletedProcess[str]]) -> None:
    listing = _json(runs["allowed"])
    assert listing["good", "pg-good-plugin"]["status"] == "available"
    assert listing["dup", "pg-dup-a"]["status"] == "available"
    assert listing["dup", "pg-dup-b"]["status"] == "disabled"
    for key in (("bad", "pg-bad-plugin"), ("garbage", "pg-bad-plugin"), ("api2", "pg-api2-plugin")):
        assert listing[key]["status"] == "disabled"
        assert listing[key]["reason"] == "not in PG_CORE_PLUGINS=good,pg_dup_a"
    assert all(item["status"] == "disabled" for (_, dist), item in listing.items() if dist == "pg-tcp")


def test_import_never_fails_get_raises_plugin_errors_and_pins_resolve(
    runs: dict[str, subprocess.CompletedProcess[str]],
) -> None:
    run = runs["probe"]
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["imported_at_import"] == []
    assert result["good"] == {"distribution": "pg-good-plugin", "description": ""}
    assert result["dup"]["error"] == "PluginConflictError"
    assert "pg-dup-a" in result["dup"]["message"] and "pg-dup-b" in result["dup"]["message"]
    assert "'dup@pg-dup-a'" in result["dup"]["message"]
    assert result["dup@pg-dup-a"] == {"distribution": "pg-dup-a", "description": "from pg-dup-a"}
    assert result["dup@pg-dup-b"] == {"distribution": "pg-dup-b", "description": "from pg-dup-b"}
    assert result["bad"]["error"] == "PluginLoadError"
    assert result["api2"]["error"] == "PluginVersionError"


# -- in this process, against a registry of our own ----------------------------------


@pytest.fixture
def isolated(monkeypatch: pytest.MonkeyPatch) -> Registry:
    reg = Registry(load_entry_points=False)
    monkeypatch.setattr(registry_module, "_default_registry", reg)
    return reg


def test_nothing_installed_says_how_to_get_a_backend(isolated: Registry, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert "pg-core alone has no backend" in out
    assert "`pip install pg-core[tcp]` gives the pure-Python default" in out
    assert main(["backends", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []


def test_in_process_registration_is_listed(isolated: Registry, capsys: pytest.CaptureFixture[str]) -> None:
    isolated.register(BackendSpec("mine", Backend, devices=("cpu", "cuda"), priority=2))
    isolated.register(BackendSpec("off", Backend, devices=("cpu",), is_available=lambda: "no MPI launch"))
    assert main(["backends"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["mine", "(in-process)", API_VERSION, "cpu,cuda", "2", "available"]
    assert lines[2].split()[:5] == ["off", "(in-process)", API_VERSION, "cpu", "0"]
    assert lines[2].endswith("unavailable: no MPI launch")


def test_the_table_ends_with_what_backends_none_picks(isolated: Registry, capsys: pytest.CaptureFixture[str]) -> None:
    isolated.register(BackendSpec("near", Backend, devices=("cpu",), priority=20, description="one host only"))
    isolated.register(BackendSpec("far", Backend, devices=("cpu", "cuda"), priority=10))
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-1] == (
        "Default for backends=None: cpu: near, else far for a group whose members near refuses "
        "(near: one host only); cuda: far"
    )


def test_no_command_prints_usage_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "backends" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["no-such-command"])
    assert info.value.code == 2


# -- backends named by a file: path/to/file.py:ATTR, for `pg-core conformance` and `pg-core bench` ------------

_SPEC_FILE = """
from pg_core.backend import BackendSpec

SPEC = BackendSpec(name="mytcp", factory="pg_tcp.backend:TCPBackend", devices=("cpu",))
"""


@pytest.fixture(scope="module")
def file_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess[str]]:
    """Both commands on a spec in a file that no distribution installs (wrapping pg-tcp's
    backend), started at once; bench with a path relative to its working directory."""
    tmp = tmp_path_factory.mktemp("file-spec")
    (tmp / "my_spec.py").write_text(_SPEC_FILE)
    cli = [sys.executable, "-m", "pg_core"]
    tiny = ["--sizes", "4", "--iters", "5", "--warmup", "1", "--time-budget", "0.2"]
    commands = {
        "conformance": [*cli, "conformance", f"{tmp / 'my_spec.py'}:SPEC", "-k", "all_reduce"],
        "bench": [*cli, "bench", "--backends", "my_spec.py:SPEC", "--no-baseline", "--ops", "all_reduce", "--json"],
    }
    commands["conformance"] += ["--world-sizes", "1,2", "--max-examples", "2"]
    commands["bench"] += tiny
    procs = {
        name: subprocess.Popen(argv, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name, argv in commands.items()
    }
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=240)
        results[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return results


@pytest.mark.slow
def test_conformance_certifies_a_spec_in_a_file(file_runs: dict[str, subprocess.CompletedProcess[str]]) -> None:
    run = file_runs["conformance"]
    assert run.returncode == 0, run.stdout + run.stderr
    assert "test_conformance[all_reduce] PASSED" in run.stdout
    assert "my_spec.py:SPEC: exit 0" in run.stdout


@pytest.mark.slow
def test_bench_measures_a_spec_in_a_file(file_runs: dict[str, subprocess.CompletedProcess[str]]) -> None:
    run = file_runs["bench"]
    assert run.returncode == 0, run.stderr
    rows = json.loads(run.stdout)
    assert [(r["op"], r["backend"], r["status"]) for r in rows] == [("all_reduce", "mytcp", "ok")]


@pytest.mark.parametrize("command", ["conformance", "bench"])
def test_a_wrong_attribute_in_a_file_says_what_the_file_defines(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "my_spec.py"
    path.write_text(_SPEC_FILE)
    argv = [command, f"{path}:SPECC"] if command == "conformance" else [command, "--backends", f"{path}:SPECC"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert (
        f"cannot load '{path}:SPECC': file {path} defines no 'SPECC'. It defines: SPEC (BackendSpec named 'mytcp')"
        in err
    )
    assert "Did you mean 'SPEC'?" in err


# -- pg-core trace ---------------------------------------------------------------------------------
def _dumped(folder: Path, rank: int, ops: list[str], failed: str | None) -> None:
    import torch
    from pg_core.errors import CollectiveTimeout
    from pg_core.recorder import FlightRecorder, head_of
    from pg_core.traces import write_dump

    rec = FlightRecorder(8)
    for seq, op in enumerate(ops, start=1):
        rec.finished(rec.tensor_collective(seq, op, torch.ones(2), "cpu"))
    if failed is not None:
        rec.finished(rec.tensor_collective(len(ops) + 1, failed, torch.ones(2), "cpu"), CollectiveTimeout("t"))
    entries = rec.entries()
    state = {
        "group": "world", "uid": "world#0-feedc0de00000000", "rank": rank, "size": 3, "backends": {"cpu": "gloo"},
        "timeout": 2.0, "state": "failed", "seq": len(entries), "recorder": {"capacity": 8}, "entries": entries,
        "report": {"text": f"rank {rank} saw {head_of(entries)['current']}"} if failed else None,
    }  # fmt: skip
    write_dump(folder, state)


def test_trace_merges_a_jobs_dumps_into_one_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _dumped(tmp_path, 0, ["all_reduce", "broadcast"], failed="all_reduce")
    _dumped(tmp_path, 2, ["all_reduce", "broadcast"], failed="all_gather")
    (tmp_path / "notes.txt").write_text("not a dump")
    assert main(["trace", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "group 'world' (world#0-feedc0de00000000), size 3, backends cpu: gloo" in text
    assert "not heard from: rank(s) 1" in text
    assert "first divergence at collective #3:" in text
    assert "rank 0: all_reduce #3 float32[2] (failed: CollectiveTimeout)" in text
    assert "rank 2: all_gather #3 float32[2] (failed: CollectiveTimeout)" in text
    assert "rank 1 is not heard from (dead or stuck outside pg-core)" in text
    assert "fr_trace " + str(tmp_path) + " -p world-feedc0de-rank" in text
    assert "skipped notes.txt: " in text
    assert main(["trace", str(tmp_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (group,) = report["groups"]
    assert group["dumped"] == [0, 2] and group["not_heard"] == [1] and group["divergence"]["seq"] == 3
    assert report["skipped"][0]["file"] == "notes.txt"


def test_trace_says_when_there_is_nothing_to_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", str(tmp_path / "missing")]) == 2
    assert "is not a folder; give the one PG_CORE_TRACE_DIR named" in capsys.readouterr().err
    (tmp_path / "junk").write_bytes(b"\x80\x04junk")
    assert main(["trace", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"no pg-core dump in {tmp_path}" in err and "junk: " in err
