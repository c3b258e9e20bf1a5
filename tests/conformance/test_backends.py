"""Certify every in-repo backend with the shipped conformance suite, exactly as a
third party would: ``pg-core conformance NAME --profile ci`` in a fresh process.

A backend whose distribution is not installed, or that cannot run here, is
skipped with the reason; its known gaps, if any, are listed in
``xfail/<name>.txt`` (strict: a gap that closes fails the run until the line goes).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pg_core.errors import BackendNotFoundError, BackendUnavailableError
from pg_core.registry import default_registry

HERE = Path(__file__).parent

#: backend name -> the in-repo distribution that provides it
IN_REPO = {
    "tcp": "pg-tcp",
    "storecomm": "pg-storecomm",  # examples/third_party_plugin: written from the README alone
}


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name", sorted(IN_REPO))
def test_certified(name: str) -> None:
    try:
        default_registry().require(name)
    except BackendNotFoundError:
        pytest.skip(f"{IN_REPO[name]} is not installed (pip install -e the folder that holds it)")
    except BackendUnavailableError as exc:
        pytest.skip(f"{name} cannot run here: {exc}")
    cmd = [sys.executable, "-m", "pg_core", "conformance", name, "--profile", "ci"]
    xfail = HERE / "xfail" / f"{name}.txt"
    if xfail.exists():
        cmd += ["--xfail", str(xfail)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1100, check=False)
    output = proc.stdout + proc.stderr
    print(output[-8000:])  # the summary table: examples per test and per op, and the time taken
    assert proc.returncode == 0, f"`{' '.join(cmd[2:])}` exited {proc.returncode}:\n{output[-20000:]}"
