"""Release readiness: every in-repo distribution builds, and works installed from what it built.

``python -m build`` makes each distribution's sdist, then its wheel *from that sdist* (so an
sdist that lacks a file the build needs fails here), into ``build/dist``. A fresh virtual
environment, ``build/pkg-venv`` (recreated every time), gets the wheels, not editable, with
torch pinned by ``constraints-dev.txt``. Then, from a directory outside the repository and
with nothing of the repository on the path: ``pg-core backends`` lists tcp and storecomm as
available, two processes all_reduce over ``tcp``, the shipped conformance suite runs a few
examples, and every version agrees with its single declaration.

``make package`` runs this module (``make test`` runs ``make package``); it is left out of
``make unit`` so that it runs once.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from datetime import timedelta
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONSTRAINTS = ROOT / "constraints-dev.txt"
DIST_DIR = ROOT / "build" / "dist"
VENV = ROOT / "build" / "pkg-venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")

#: distribution -> (folder, import name)
DISTS = {
    "pg-core": ("core", "pg_core"),
    "pg-tcp": ("backends/tcp_reference", "pg_tcp"),
    "pg-gloo": ("backends/gloo", "pg_gloo"),
    "pg-nccl": ("backends/nccl", "pg_nccl"),
    "pg-mpi": ("backends/mpi", "pg_mpi"),
    "pg-shm": ("backends/shm", "pg_shm"),
    "pg-storecomm": ("examples/third_party_plugin", "pg_storecomm"),
}

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]  # hang guard for the builds and the install


def _run(cmd: list[str | Path], *, cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    if proc.returncode != 0:
        pytest.fail(
            f"`{' '.join(map(str, cmd))}` exited {proc.returncode}:\n{proc.stdout[-10000:]}{proc.stderr[-10000:]}"
        )
    return proc


def _outside_env() -> dict[str, str]:
    """The environment of a user's shell: nothing of the repository or the dev venv on the path."""
    drop = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTEST_ADDOPTS", "PG_CORE_PLUGINS", "PG_CORE_DISABLE_PLUGINS")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PATH"] = os.pathsep.join([str(BIN), *(p for p in env.get("PATH", "").split(os.pathsep) if ".venv" not in p)])
    return env


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Path]]:
    """``{distribution: {"sdist": path, "wheel": path, "log": text}}``, built afresh, each from
    a copy of its folder: setuptools rewrites the ``*.egg-info`` of the tree it builds, which
    the dev venv's editable installs read while the other tests run beside this one."""
    shutil.rmtree(DIST_DIR, ignore_errors=True)
    sources = tmp_path_factory.mktemp("sources")
    skip = shutil.ignore_patterns("*.egg-info", "__pycache__", "build", "dist", ".*_cache", ".hypothesis")
    # the build backend (setuptools) is installed into each isolated build environment with the
    # repository's pins, so a release build is reproducible
    env = {**os.environ, "PIP_CONSTRAINT": str(CONSTRAINTS)}
    out: dict[str, dict[str, Path]] = {}
    for dist, (folder, _module) in DISTS.items():
        copy = shutil.copytree(ROOT / folder, sources / Path(folder).name, ignore=skip)
        proc = _run([sys.executable, "-m", "build", "--outdir", DIST_DIR, copy], cwd=ROOT, env=env, timeout=600)
        log = proc.stdout + proc.stderr
        assert "Building wheel from sdist" in log, log  # the wheel is built from the sdist, not the folder
        sdists = sorted(DIST_DIR.glob(f"{_norm(dist)}-*.tar.gz"))
        wheels = sorted(DIST_DIR.glob(f"{_norm(dist)}-*-py3-none-any.whl"))
        assert len(sdists) == 1 and len(wheels) == 1, sorted(p.name for p in DIST_DIR.iterdir())
        out[dist] = {"sdist": sdists[0], "wheel": wheels[0]}
    return out


@pytest.fixture(scope="module")
def venv(built: dict[str, dict[str, Path]], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the built wheels installed (not editable); returns a directory outside the repo."""
    shutil.rmtree(VENV, ignore_errors=True)
    _run([sys.executable, "-m", "venv", VENV], cwd=ROOT, env=_outside_env(), timeout=300)
    wheels = {dist: str(paths["wheel"]) for dist, paths in built.items()}
    cmd: list[str | Path] = [BIN / "python", "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    # pg-core with its extras resolves pg-tcp to the wheel beside it: `pip install pg-core[tcp]` works
    cmd += ["-c", CONSTRAINTS, f"{wheels['pg-core']}[tcp,gloo,nccl,shm,testing]", wheels["pg-tcp"], wheels["pg-gloo"]]
    # pg-mpi brings mpi4py and mpich
    cmd += [wheels["pg-shm"], wheels["pg-nccl"], wheels["pg-mpi"], wheels["pg-storecomm"]]
    _run(cmd, cwd=ROOT, env=_outside_env(), timeout=900)
    return tmp_path_factory.mktemp("user")


def _python(venv: Path, code: str, *args: str, timeout: float = 120) -> str:
    return _run([BIN / "python", "-c", code, *args], cwd=venv, env=_outside_env(), timeout=timeout).stdout


def _declared_version(dist: str) -> str:
    folder, module = DISTS[dist]
    if dist == "pg-core":  # the one declaration: pg_core.__version__ (pyproject reads it from there)
        text = (ROOT / folder / "src" / module / "__init__.py").read_text()
        match = re.search(r'^__version__ = "([^"]+)"$', text, re.MULTILINE)
    else:
        text = (ROOT / folder / "pyproject.toml").read_text()
        match = re.search(r'^version = "([^"]+)"', text, re.MULTILINE)
    assert match, f"no version declared for {dist}"
    return match.group(1)


# -- the artifacts ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dist", sorted(DISTS))
def test_the_sdist_holds_the_sources_readme_changelog_and_types(built: dict[str, dict[str, Path]], dist: str) -> None:
    folder, module = DISTS[dist]
    sdist = built[dist]["sdist"]
    version = _declared_version(dist)
    assert sdist.name == f"{_norm(dist)}-{version}.tar.gz"
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    sources = {p.relative_to(ROOT / folder).as_posix() for p in (ROOT / folder / "src" / module).rglob("*.py")}
    needed = {"pyproject.toml", "PKG-INFO", "README.md", "CHANGELOG.md", f"src/{module}/py.typed", *sources}
    assert not needed - names, f"{sdist.name} lacks {sorted(needed - names)}"


@pytest.mark.parametrize("dist", sorted(DISTS))
def test_the_wheel_holds_the_package_its_entry_points_and_the_changelog_in_its_description(
    built: dict[str, dict[str, Path]], dist: str
) -> None:
    folder, module = DISTS[dist]
    version = _declared_version(dist)
    with zipfile.ZipFile(built[dist]["wheel"]) as whl:
        names = set(whl.namelist())
        meta = whl.read(f"{_norm(dist)}-{version}.dist-info/METADATA").decode()
        entry_points = whl.read(f"{_norm(dist)}-{version}.dist-info/entry_points.txt").decode()
    sources = {p.relative_to(ROOT / folder / "src").as_posix() for p in (ROOT / folder / "src" / module).rglob("*.py")}
    assert not ({f"{module}/py.typed", *sources} - names), sorted(names)
    assert f"\nVersion: {version}\n" in meta
    assert f"# Changelog of {dist}" in meta and f"## [{version}]" in meta, "the changelog is not in the description"
    if dist == "pg-core":
        assert "pytest_pg_core.py" in names
        assert "pg-core = pg_core.cli:main" in entry_points and "pytest_pg_core = pytest_pg_core" in entry_points
        assert "pgrun = pg_core.launch:main" in entry_points, entry_points
    else:
        backend = dist.removeprefix("pg-")
        assert f"{backend} = {module}.plugin" in entry_points, entry_points


@pytest.mark.parametrize("dist", sorted(DISTS))
def test_the_changelog_has_a_section_for_the_declared_version(dist: str) -> None:
    changelog = (ROOT / DISTS[dist][0] / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in changelog
    assert re.search(rf"^## \[{re.escape(_declared_version(dist))}\] - \d{{4}}-\d{{2}}-\d{{2}}$", changelog, re.M), dist


# -- installed, from outside the repository ---------------------------------------------------------


def test_installed_from_the_wheels_not_editable_and_versions_agree(venv: Path) -> None:
    code = """
import importlib, importlib.metadata as md, json, sys
out = {}
for dist, module in json.loads(sys.argv[1]).items():
    d = md.distribution(dist)
    direct = json.loads(d.read_text("direct_url.json") or "{}")
    out[dist] = {
        "version": d.version,
        "file": importlib.import_module(module).__file__,
        "editable": direct.get("dir_info", {}).get("editable", False),
        "url": direct.get("url", ""),
    }
import pg_core
out["__version__"] = pg_core.__version__
print(json.dumps(out))
"""
    got = json.loads(_python(venv, code, json.dumps({d: m for d, (_f, m) in DISTS.items()})))
    assert got["pg-core"]["version"] == got["__version__"], got  # installed metadata == pg_core.__version__
    for dist in DISTS:
        info = got[dist]
        assert info["version"] == _declared_version(dist), (dist, info)
        assert not info["editable"] and info["url"].endswith(".whl"), (dist, info)
        assert Path(info["file"]).is_relative_to(VENV), (dist, info)  # not the repository's sources


def test_pg_core_backends_lists_every_in_repo_backend_as_available(venv: Path) -> None:
    table = _run([BIN / "pg-core", "backends"], cwd=venv, env=_outside_env(), timeout=120).stdout
    rows = {line.split()[0]: line for line in table.splitlines()[1:] if line.strip()}
    for name, dist in (("tcp", "pg-tcp"), ("gloo", "pg-gloo"), ("shm", "pg-shm"), ("storecomm", "pg-storecomm")):
        assert name in rows, table
        assert f"{dist}=={_declared_version(dist)}" in rows[name] and rows[name].rstrip().endswith("available"), table
    entries = json.loads(
        _run([BIN / "pg-core", "backends", "--json"], cwd=venv, env=_outside_env(), timeout=120).stdout
    )
    statuses = {e["name"]: e["status"] for e in entries}
    nccl = (
        "available"
        if _python(venv, "import pg_nccl.plugin as p; print(p.is_available())").strip() == "None"
        else "unavailable"
    )
    # pg-mpi is unavailable outside mpiexec, and says how to launch; under mpiexec it is available
    assert statuses == {
        "tcp": "available",
        "gloo": "available",
        "nccl": nccl,
        "mpi": "unavailable",
        "shm": "available",
        "storecomm": "available",
    }, entries
    assert "mpiexec -n N python script.py" in next(e["reason"] for e in entries if e["name"] == "mpi")
    launched = _run(
        [BIN / "mpiexec", "-n", "1", BIN / "pg-core", "backends"], cwd=venv, env=_outside_env(), timeout=120
    )
    row = next(line for line in launched.stdout.splitlines() if line.startswith("mpi "))
    assert f"pg-mpi=={_declared_version('pg-mpi')}" in row and row.rstrip().endswith("available"), launched.stdout


ALL_REDUCE = '''
"""Two processes all_reduce over the backend named in argv[1], with only the installed packages."""
import json, subprocess, sys
from datetime import timedelta

import torch
from pg_core import ProcessGroup, TCPStore

if len(sys.argv) == 2:  # the launcher: hosts the store on a free port, starts rank 0 and rank 1
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    ranks = [subprocess.Popen([sys.executable, __file__, sys.argv[1], str(r), str(store.port)],
                              stdout=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], outs
    print(json.dumps([json.loads(o) for o in outs]))
else:
    backend, rank, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    group = ProcessGroup(store, rank=rank, size=2, backends=backend, timeout=60)
    t = torch.arange(4, dtype=torch.float32) + 10 * rank
    group.all_reduce(t)
    backends = dict(group.backends)
    group.shutdown()
    print(json.dumps({"rank": rank, "value": t.tolist(), "backends": backends}))
'''


@pytest.mark.parametrize("backend", ["tcp", "gloo", "shm"])
def test_two_ranks_all_reduce_over_an_installed_backend(venv: Path, backend: str) -> None:
    script = venv / "all_reduce.py"
    script.write_text(ALL_REDUCE)
    out = _run([BIN / "python", script, backend], cwd=venv, env=_outside_env(), timeout=180).stdout
    results = json.loads(out)
    assert [r["rank"] for r in results] == [0, 1], results
    for r in results:
        assert r["value"] == [10.0, 12.0, 14.0, 16.0], results
        assert r["backends"] == {"cpu": backend}, results


MPI_ALL_REDUCE = '''
"""Started by mpiexec: every rank all_reduces over pg-mpi, with only the installed packages."""
import json, os, sys
from datetime import timedelta

import torch
from pg_core import ProcessGroup, TCPStore

rank, size, port = int(os.environ["PMI_RANK"]), int(os.environ["PMI_SIZE"]), int(sys.argv[1])
store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
with ProcessGroup(store, rank=rank, size=size, backends="mpi", timeout=60) as group:
    t = torch.arange(4, dtype=torch.float32) + 10 * rank
    group.all_reduce(t)
    result = {"rank": rank, "value": t.tolist(), "backends": dict(group.backends)}
with open(f"mpi-result-{rank}.json", "w") as f:  # a file each: mpiexec may interleave the ranks' output
    json.dump(result, f)
'''


def test_pip_install_pg_mpi_is_all_it_takes_to_all_reduce_under_its_mpiexec(venv: Path) -> None:
    from torch.distributed import TCPStore

    script = venv / "mpi_all_reduce.py"
    script.write_text(MPI_ALL_REDUCE)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    cmd: list[str | Path] = [BIN / "mpiexec", "-n", "2", BIN / "python", script, str(store.port)]
    _run(cmd, cwd=venv, env=_outside_env(), timeout=180)
    results = [json.loads((venv / f"mpi-result-{rank}.json").read_text()) for rank in range(2)]
    assert [r["rank"] for r in results] == [0, 1], results
    for r in results:
        assert r["value"] == [10.0, 12.0, 14.0, 16.0] and r["backends"] == {"cpu": "mpi"}, results


def test_the_shipped_conformance_suite_runs_from_the_installed_packages(venv: Path) -> None:
    cmd: list[str | Path] = [BIN / "pg-core", "conformance", "tcp", "--world-sizes", "2", "-k", "supports or barrier"]
    out = _run([*cmd, "--max-examples", "3"], cwd=venv, env=_outside_env(), timeout=300).stdout
    assert "2 passed" in out, out
