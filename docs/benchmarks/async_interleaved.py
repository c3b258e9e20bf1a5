"""What ``async_op=True`` plus ``wait()`` costs over the blocking call, interleaved.

    .venv/bin/python docs/benchmarks/async_interleaved.py tcp all_reduce,broadcast,send_recv 4

Two rank processes (spawned here, rank ``r`` pinned to CPU ``r``), one group on the named
backend; for each op, 200 warm-up pairs, then 20 blocks of 100 calls alternating between the
blocking form and the asynchronous form waited for at once (``isend``/``irecv`` then
``wait()`` for ``send_recv``, whose time is a round trip), the form that goes first
alternating too, each block after a barrier. It prints each rank's medians of both forms
and their difference. ``pg-core bench --async`` measures the same rows seconds apart; on a
loaded 2-core machine its noise (torch-gloo's identical calls in both rows differ by tens of
microseconds) hides a 5 us target, which blocks this close together resolve.

A diagnostic, not a test: it prints numbers and checks nothing.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

BLOCKS = 20
CALLS = 100
WARMUP = 200


def _rank(rank: int, port: int, job: tuple[str, list[str], int], results: Any) -> None:
    backend, ops, nbytes = job
    os.sched_setaffinity(0, {rank % (os.cpu_count() or 1)})
    import torch

    torch.set_num_threads(1)
    from pg_core import ProcessGroup, TCPStore

    store = TCPStore(
        "127.0.0.1", port, world_size=2, is_master=rank == 0, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    g = ProcessGroup(store, rank=rank, size=2, backends={"cpu": backend}, name="async-interleaved", timeout=30)
    t = torch.ones(max(1, nbytes // 4))
    peer = 1 - rank

    def send_recv() -> None:
        if rank == 0:
            g.send(t, peer)
            g.recv(t, peer)
        else:
            g.recv(t, peer)
            g.send(t, peer)

    def isend_irecv() -> None:
        if rank == 0:
            g.isend(t, peer).wait()
            g.irecv(t, peer).wait()
        else:
            g.irecv(t, peer).wait()
            g.isend(t, peer).wait()

    forms: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
        "all_reduce": (lambda: g.all_reduce(t), lambda: g.all_reduce(t, async_op=True).wait()),  # type: ignore[union-attr]
        "broadcast": (lambda: g.broadcast(t, 0), lambda: g.broadcast(t, 0, async_op=True).wait()),  # type: ignore[union-attr]
        "send_recv": (send_recv, isend_irecv),
    }
    medians: dict[str, tuple[float, float]] = {}
    for op in ops:
        blocking, launched = forms[op]
        for _ in range(WARMUP):
            blocking()
            launched()
        times: tuple[list[int], list[int]] = ([], [])
        for block in range(BLOCKS):
            order = ((0, blocking), (1, launched)) if block % 2 == 0 else ((1, launched), (0, blocking))
            for which, fn in order:
                g.barrier()
                for _ in range(CALLS):
                    start = time.perf_counter_ns()
                    fn()
                    times[which].append(time.perf_counter_ns() - start)
        medians[op] = (statistics.median(times[0]) / 1e3, statistics.median(times[1]) / 1e3)
    results.put((rank, medians))
    g.shutdown()


def main(argv: list[str]) -> int:
    backend, ops, nbytes = argv[0], argv[1].split(","), int(argv[2])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, (backend, ops, nbytes), results)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(60)
    for op in ops:
        line = f"{backend:5s} {op:10s} {nbytes:>8d} B"
        for rank in (0, 1):
            blocking, launched = got[rank][op]
            line += f" | rank {rank}: blocking {blocking:7.1f} async {launched:7.1f} ({launched - blocking:+5.1f})"
        print(line + "  (us, medians)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
