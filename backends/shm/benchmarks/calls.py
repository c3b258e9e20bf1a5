"""What one small call costs, pg-shm's part against the core's: a program, not a test.

Two ranks pinned to two cores. For a 4-byte ``send``, ``recv`` and a 1-float ``all_reduce``,
each through the ``ProcessGroup`` and straight on the backend (the prepared all_reduce,
API 1.5):

* **CPU per call**, measured where a call never waits: rank 0 sends ``--count`` messages that
  all fit in the pair's ring, then rank 1 receives them all (min and median over
  ``--repeats``; the min is the cost, the median shows the load). The all_reduce is a
  round of both ranks, so its time includes waiting for the other rank.
* **Python calls per call** (``cProfile``'s count, which does not depend on the load).

    python backends/shm/benchmarks/calls.py [--count 8000] [--repeats 7]

The backend is reached through the group's dispatch (a private path: a benchmark may, a
user never needs to).
"""

from __future__ import annotations

import argparse
import cProfile
import multiprocessing as mp
import os
import pstats
import socket
import statistics
import time
from collections.abc import Callable

import torch

Results = dict[str, tuple[list[float], float]]


def _timed(fn: Callable[[], object], count: int) -> tuple[float, float]:
    """Microseconds per call of ``count`` calls, and Python calls per call."""
    started = time.perf_counter()
    for _ in range(count):
        fn()
    seconds = time.perf_counter() - started
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(200):
        fn()
    profile.disable()
    return seconds / count * 1e6, pstats.Stats(profile).total_calls / 200  # type: ignore[attr-defined]


def _rank(rank: int, port: int, count: int, repeats: int, out: mp.SimpleQueue) -> None:
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank]})
    torch.set_num_threads(1)
    from pg_core import ProcessGroup, TCPStore
    from pg_core.ops import ReduceOp

    group = ProcessGroup(TCPStore("127.0.0.1", port, is_master=rank == 0), rank=rank, size=2, backends="shm")
    backend = group._dispatch.instance(torch.device("cpu")).backend
    message, one = torch.zeros(1), torch.ones(1)
    prepared = backend.prepared_all_reduce(torch.float32, ReduceOp.SUM, timeout=60)
    assert prepared is not None
    group.all_reduce(one)  # the group makes its lane for this kind on the first call
    peer = 1 - rank
    cases: dict[str, Callable[[], object]] = {
        "send, group": lambda: group.send(message, peer),
        "send, backend": lambda: backend.send(message, peer, 0, timeout=60),
        "recv, group": lambda: group.recv(message, peer),
        "recv, backend": lambda: backend.recv(message, peer, 0, timeout=60),
        "all_reduce, group": lambda: group.all_reduce(one),
        "all_reduce, backend": lambda: prepared(one),
    }
    results: Results = {}

    def record(name: str) -> None:
        took, calls = _timed(cases[name], count)
        results[name] = ([*results.get(name, ([], 0.0))[0], took], calls)

    for _ in range(repeats):
        for via in ("group", "backend"):
            group.barrier()
            if rank == 0:  # the sends fit in the ring (64 bytes each): none waits
                record(f"send, {via}")
            group.barrier()
            if rank == 1:  # every message is there already: no receive waits
                record(f"recv, {via}")
            group.barrier()
            record(f"all_reduce, {via}")
    group.barrier()
    group.shutdown()
    out.put((rank, results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=8000, help="calls per timing (at most 16000: the ring's room)")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ctx = mp.get_context("spawn")
    out: mp.SimpleQueue = ctx.SimpleQueue()
    ranks = [ctx.Process(target=_rank, args=(r, port, args.count, args.repeats, out)) for r in (0, 1)]
    for p in ranks:
        p.start()
    merged: Results = {}
    for _ in ranks:
        _, results = out.get()
        merged.update({k: v for k, v in results.items() if k not in merged})  # all_reduce: the first rank's
    for p in ranks:
        p.join()
    print(f"{'call':<22} {'min us':>7} {'median us':>10} {'Python calls':>13}")
    for name in ("send, group", "send, backend", "recv, group", "recv, backend", "all_reduce, group",
                 "all_reduce, backend"):  # fmt: skip
        times, calls = merged[name]
        print(f"{name:<22} {min(times):7.2f} {statistics.median(times):10.2f} {calls:13.1f}")


if __name__ == "__main__":
    main()
