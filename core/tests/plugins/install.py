"""Install the throwaway plugin distributions beside this file into a folder, for real.

Loaded by path (``runpy.run_path``) from the session fixtures of test_registry.py and
test_cli.py; whichever runs first installs, the other reuses the folder.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PLUGINS = ("good", "bad", "dup_a", "dup_b", "api2")
MODULES = ("pg_good_plugin", "pg_bad_plugin", "pg_dup_a", "pg_dup_b", "pg_api2_plugin")


def install_plugins(base: Path) -> Path:
    """``base/pg-core-test-plugins/site``, holding every plugin installed with one pip call."""
    root = base / "pg-core-test-plugins"
    site = root / "site"
    if (root / "installed").exists():
        return site
    sources = root / "src"
    shutil.rmtree(root, ignore_errors=True)
    for name in PLUGINS:  # build from copies: setuptools writes build/ and *.egg-info beside the sources
        shutil.copytree(HERE / name, sources / name)
    subprocess.run(
        [
            sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
            "--no-index", "--disable-pip-version-check", "--target", str(site),
            *(str(sources / name) for name in PLUGINS),
        ],
        check=True,
    )  # fmt: skip
    (root / "installed").touch()
    return site
