"""How fast, and with what error, the survivors learn that a peer is gone: per backend and fault.

Run it as ``.venv/bin/python docs/benchmarks/faults.py [--backends tcp,gloo,mpi] [--repeat N]``
(default tcp and gloo, 5 runs of each case). Three ranks of a :class:`~pg_core.testing.pool.RankPool`
(under ``mpiexec`` for mpi) form a group with a 30 s timeout and make their connections with
one all_reduce; then rank 1 goes, in one of these ways, while ranks 0 and 2 are:

* ``all_reduce``: on their way into an all_reduce of 256 KiB (rank 1 dies once both said so);
* ``recv``: blocked in ``recv`` from rank 1;
* ``send``: about to ``send`` 1 KiB to rank 1, which died a moment before (they wait until its
  process is gone);
* ``idle``: doing nothing; once rank 1's process is gone they call an all_reduce;
* ``abort``: blocked in ``recv`` from rank 1, which calls ``abort()`` (and lives on);
* ``ctrl_c``: blocked in ``recv`` from rank 1, which sends each of them SIGINT (Ctrl-C), and
  lives on: the figure is how long the signal takes to become their ``KeyboardInterrupt``.

Rank 1 goes by SIGKILL, but in ``abort`` and ``ctrl_c``. It writes the wall-clock time it goes at to the store
first; a survivor's figure is the time from then until its call raised (``recv``, ``all_reduce``,
``abort``) or, where it called after the death (``send``, ``idle``), the call's own time. Every
row gives the median and the maximum over both survivors and all runs, the error classes seen
and the first words of one message. A survivor whose call returned instead of raising is
counted (``returned``): that is data lost without an error. A call that takes the whole
timeout shows as 30 s: nobody told it.

A measurement, not a test: the tests that hold these behaviours are named in
``docs/reliability.md``.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
from typing import Any

TIMEOUT = 30.0
CASES = ("all_reduce", "recv", "send", "idle", "abort", "ctrl_c")


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def scenario(ctx: Any, backend: str, case: str) -> dict[str, Any] | None:
    import torch
    from pg_core import PGError, ProcessGroup

    r = ctx.rank
    g = ProcessGroup(ctx.store, r, ctx.size, backends=backend, name=f"faults-{case}", timeout=TIMEOUT)
    g.all_reduce(torch.ones(4))  # every connection made: the fault comes mid-run
    ctx.store.set(f"pid/{r}", str(os.getpid()))
    ctx.store.wait(["pid/0", "pid/1", "pid/2"])
    if r == 1:
        ctx.store.wait(["ready/0", "ready/2"])
        ctx.store.set("went", repr(time.time()))
        if case == "abort":
            g.abort()
            return None
        if case == "ctrl_c":
            for peer in (0, 2):
                os.kill(int(ctx.store.get(f"pid/{peer}")), signal.SIGINT)
            ctx.store.wait(["interrupted/0", "interrupted/2"])
            g.abort()
            return None
        os.kill(os.getpid(), signal.SIGKILL)
    victim = int(ctx.store.get("pid/1"))
    started = time.time()
    outcome = "returned"
    text = ""
    try:  # from here: a SIGINT that comes before the recv is posted is caught all the same
        ctx.store.set(f"ready/{r}", "1")
        if case in {"send", "idle"}:
            ctx.store.wait(["went"])
            while not _gone(victim):
                time.sleep(0.005)  # a measurement's poll of the process table, not a synchronisation
        started = time.time()
        if case in {"all_reduce", "idle"}:
            g.all_reduce(torch.ones(1 << 16))
        elif case in {"recv", "abort", "ctrl_c"}:
            g.recv(torch.empty(16), src=1)
        elif case == "send":
            g.send(torch.ones(256), dst=1)
    except PGError as exc:
        outcome, text = type(exc).__name__, str(exc)
    except KeyboardInterrupt:
        outcome = "KeyboardInterrupt"
        ctx.store.set(f"interrupted/{r}", "1")
    except Exception as exc:  # a raw exception is a finding: record it
        outcome, text = f"raw {type(exc).__name__}", str(exc)
    ended = time.time()
    went = float(ctx.store.get("went"))
    g.abort()
    return {
        "outcome": outcome,
        "seconds": ended - (started if case in {"send", "idle"} else went),
        "text": text.splitlines()[0][:160] if text else "",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="tcp,gloo")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    from pg_core.testing.pool import RankPool

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import faults  # the ranks find scenario() by this module's name, not as __main__

    print(
        f"# {time.strftime('%Y-%m-%d %H:%M')} {os.uname().nodename}, {os.cpu_count()} cpus, 3 ranks, timeout {TIMEOUT:g} s"
    )
    print("| backend | rank 1 | survivors' error | median s | max s | returned | message |")
    print("|---|---|---|---|---|---|---|")
    for backend in args.backends.split(","):
        pool = RankPool(3, launcher="mpiexec" if backend == "mpi" else None, op_timeout=TIMEOUT)
        try:
            for case in args.cases.split(","):
                seconds: list[float] = []
                outcomes: dict[str, int] = {}
                text = ""
                for _ in range(args.repeat):
                    try:
                        results = pool.run(
                            faults.scenario, backend, case, timeout=TIMEOUT + 60, may_exit=[1], check_leaks=False
                        )
                    except AssertionError as exc:  # the pool's account: a rank died or hung
                        outcomes["pool: " + str(exc).splitlines()[1][:60]] = outcomes.get("pool", 0) + 1
                        continue
                    for got in (results[0], results[2]):
                        outcomes[got["outcome"]] = outcomes.get(got["outcome"], 0) + 1
                        seconds.append(got["seconds"])
                        text = text or got["text"]
                how = {"abort": "abort() while they recv", "ctrl_c": "sends them SIGINT while they recv"}.get(
                    case, f"SIGKILL while they {case}"
                )
                median = f"{statistics.median(seconds):.3f}" if seconds else "-"
                worst = f"{max(seconds):.3f}" if seconds else "-"
                errors = ", ".join(f"{k} x{v}" for k, v in sorted(outcomes.items()) if k != "returned")
                print(
                    f"| {backend} | {how} | {errors} | {median} | {worst} | "
                    f"{outcomes.get('returned', 0)} | {text.replace('|', '/')} |",
                    flush=True,
                )
        finally:
            pool.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
