"""What ``async_op=True`` plus ``wait()`` costs over the blocking call on pg-gloo, 2 ranks.

    python backends/gloo/benchmarks/async_overhead.py [--rounds 15] [--iters 200]

Each rank is pinned to its own core (where there are two). Per round and per case, the blocking
and the asynchronous form run back to back, ``iters`` iterations each; the table gives each
form's median over the rounds' medians (microseconds per iteration, one way for point to point:
a round trip halved) and the difference, and the difference in rank 0's process CPU time per iteration (all its
threads): on a loaded machine it shows a form's own cost where the wall time mostly shows the
scheduler. Interleaving the forms in every round is what makes the difference meaningful there.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.multiprocessing as mp
from pg_core import ProcessGroup, TCPStore

Case = tuple[str, Callable[[], None], Callable[[], None], int]


def _cases(group: ProcessGroup, rank: int) -> list[Case]:
    peer = 1 - rank
    one, small, large = torch.ones(1), torch.ones(1), torch.ones(1 << 18)  # 4 B, 4 B, 1 MiB
    got_small, got_large = torch.empty(1), torch.empty(1 << 18)

    def ping(msg: torch.Tensor, got: torch.Tensor, async_op: bool) -> Callable[[], None]:
        def blocking() -> None:
            if rank == 0:
                group.send(msg, peer)
                group.recv(got, peer)
            else:
                group.recv(got, peer)
                group.send(got, peer)

        def asynchronous() -> None:
            if rank == 0:
                group.isend(msg, peer).wait()
                group.irecv(got, peer).wait()
            else:
                group.irecv(got, peer).wait()
                group.isend(got, peer).wait()

        return asynchronous if async_op else blocking

    def reduce(async_op: bool) -> Callable[[], None]:
        if async_op:
            return lambda: group.all_reduce(one, async_op=True).wait()
        return lambda: group.all_reduce(one)

    return [
        ("all_reduce 4 B", reduce(False), reduce(True), 1),
        ("send/recv 4 B (one way)", ping(small, got_small, False), ping(small, got_small, True), 2),
        ("send/recv 1 MiB (one way)", ping(large, got_large, False), ping(large, got_large, True), 2),
    ]


def _rank(rank: int, port: int, rounds: int, iters: int, out: dict[str, list[float]]) -> None:
    if len(os.sched_getaffinity(0)) >= 2:
        os.sched_setaffinity(0, {rank})
    store = TCPStore("127.0.0.1", port, is_master=False)
    with ProcessGroup(store, rank, 2, backends="gloo", timeout=60) as group:
        cases = _cases(group, rank)
        for _, blocking, asynchronous, _ in cases:  # warm up: the backend formed, buffers made
            for _ in range(20):
                blocking()
                asynchronous()
        for _ in range(rounds):
            for name, blocking, asynchronous, per in cases:
                for form, fn in (("blocking", blocking), ("async", asynchronous)):
                    group.barrier()
                    start, cpu = time.perf_counter(), time.process_time()
                    for _ in range(iters):
                        fn()
                    if rank == 0:
                        key = f"{name}|{form}"
                        out[key] = [*out.get(key, []), (time.perf_counter() - start) / iters / per * 1e6]
                        out[f"{key}|cpu"] = [
                            *out.get(f"{key}|cpu", []),
                            (time.process_time() - cpu) / iters / per * 1e6,
                        ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()
    store = TCPStore("127.0.0.1", 0, is_master=True)
    manager = mp.Manager()
    out = manager.dict()
    procs = [mp.Process(target=_rank, args=(r, store.port, args.rounds, args.iters, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
    if any(p.exitcode != 0 for p in procs):
        sys.exit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
    print(f"{'case':28} {'blocking us':>12} {'async+wait us':>14} {'difference':>11} {'cpu difference':>15}")
    for name in dict.fromkeys(k.split("|")[0] for k in out):
        blocking = statistics.median(out[f"{name}|blocking"])
        asynchronous = statistics.median(out[f"{name}|async"])
        cpu = statistics.median(out[f"{name}|async|cpu"]) - statistics.median(out[f"{name}|blocking|cpu"])
        print(f"{name:28} {blocking:12.1f} {asynchronous:14.1f} {asynchronous - blocking:+11.1f} {cpu:+15.1f}")


if __name__ == "__main__":
    main()
