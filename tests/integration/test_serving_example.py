"""examples/serving_pattern.py runs as its docstring says: its own processes, exit status 0."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "serving_pattern.py"


@pytest.mark.requires_backend("tcp")
@pytest.mark.timeout(180)
def test_serving_pattern_example_runs() -> None:
    try:
        proc = subprocess.run(
            [sys.executable, str(EXAMPLE)],
            check=False,
            capture_output=True,
            text=True,
            timeout=150,  # the example bounds its own workers at 120 s; this bounds the example
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    except subprocess.TimeoutExpired as exc:
        out = b"".join(x if isinstance(x, bytes) else (x or "").encode() for x in (exc.stdout, exc.stderr))
        pytest.fail(f"the example did not finish within 150 s; its output:\n{out.decode(errors='replace')}")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "launcher: all four workers finished OK" in proc.stdout, output
    for index in (0, 1):
        assert f"[decode-{index}] received req-{index}: 2 layers of k/v" in proc.stdout, output
        assert f"[decode-{index}] decode group rank {index} of 2" in proc.stdout, output
        assert f"[prefill-{index}] after the split: rank {index} of 2" in proc.stdout, output
