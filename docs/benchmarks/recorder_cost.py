"""The flight recorder's cost end to end: on against off, one run.

Run it as ``.venv/bin/python docs/benchmarks/recorder_cost.py BACKEND ROUNDS ITERS`` (say
``tcp 40 500``). Two ranks, each pinned to a CPU, form two groups on one store, one with the
recorder (the default) and one with ``PG_CORE_TRACE_BUFFER=0``; each round times ITERS
1-element all_reduces and ITERS send/recv round trips on each group, the two taking turns at
going first. Prints the medians over the rounds (per call; a ping-pong's one way), their
ratio, and the middle half of the round-by-round ratios. A measurement, not a test."""

import os
import statistics
import sys
import time
from datetime import timedelta

import torch


def main(rank: int, port: int, backend: str, rounds: int, iters: int) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    from pg_core import ProcessGroup, TCPStore

    store = TCPStore("127.0.0.1", port, is_master=(rank == 0), timeout=timedelta(seconds=60))
    groups = {}
    for label, cap in (("on", None), ("off", "0")):
        if cap is None:
            os.environ.pop("PG_CORE_TRACE_BUFFER", None)
        else:
            os.environ["PG_CORE_TRACE_BUFFER"] = cap
        groups[label] = ProcessGroup(store, rank, 2, backends=backend, name=f"rec-{label}", timeout=60)
    t = torch.ones(1)
    res: dict[tuple[str, str], list[float]] = {(g, op): [] for g in groups for op in ("all_reduce", "pingpong")}
    for g in groups.values():
        for _ in range(200):
            g.all_reduce(t)
    for r in range(rounds):
        order = list(groups) if r % 2 == 0 else list(groups)[::-1]
        for label in order:
            g = groups[label]
            g.barrier()
            s = time.perf_counter()
            for _ in range(iters):
                g.all_reduce(t)
            res[(label, "all_reduce")].append((time.perf_counter() - s) / iters * 1e6)
            g.barrier()
            s = time.perf_counter()
            for _ in range(iters):
                if rank == 0:
                    g.send(t, 1)
                    g.recv(t, 1)
                else:
                    g.recv(t, 0)
                    g.send(t, 0)
            res[(label, "pingpong")].append((time.perf_counter() - s) / iters / 2 * 1e6)
    if rank == 0:
        for op in ("all_reduce", "pingpong"):
            on = statistics.median(res[("on", op)])
            off = statistics.median(res[("off", op)])
            ratios = sorted(a / b for a, b in zip(res[("on", op)], res[("off", op)], strict=True))
            q = ratios[len(ratios) // 4], ratios[3 * len(ratios) // 4]
            print(
                f"{backend:5s} {op:10s} on {on:8.2f} us  off {off:8.2f} us  ratio {on / off:.3f}  per-round ratio q1-q3 [{q[0]:.3f}, {q[1]:.3f}]",
                flush=True,
            )
    for g in groups.values():
        g.shutdown()


if __name__ == "__main__":
    if sys.argv[1] == "rank":
        main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))
    else:
        import socket
        import subprocess

        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        backend, rounds, iters = sys.argv[1], sys.argv[2], sys.argv[3]
        ps = [
            subprocess.Popen([sys.executable, __file__, "rank", str(r), str(port), backend, rounds, iters])
            for r in range(2)
        ]
        sys.exit(max(p.wait() for p in ps))
