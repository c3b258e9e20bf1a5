"""What the examples share: host a TCPStore on a free port, start one process per rank, wait.

Each example re-runs itself per rank with ``--rank R --port P`` added to its own arguments
(until ``pgrun`` does this for every script).
"""

from __future__ import annotations

import os
import subprocess
import sys

from pg_core import TCPStore


def run_ranks(script: str, world_size: int, args: list[str], *, name: str, timeout: float = 120.0) -> bool:
    """Run ``python script ARGS --rank R --port P`` for every rank; ``True`` if all exit 0."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # port 0: a free port
    procs = [
        subprocess.Popen(
            [sys.executable, script, *args, "--rank", str(r), "--port", str(store.port)],
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for r in range(world_size)
    ]
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            print(f"{name}: a rank did not finish within {timeout:g} s", file=sys.stderr)
            return False
    if any(codes):
        print(f"{name}: rank exit codes {codes}", file=sys.stderr)
        return False
    return True
