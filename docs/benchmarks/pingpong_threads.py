"""A ping-pong's CPU time and context switches, thread by thread: where a small message's time goes.

Run it as ``.venv/bin/python docs/benchmarks/pingpong_threads.py BACKEND [--raw] [--async]
[--iters N] [--numel K]`` (say ``gloo --iters 4000``). Two ranks, each pinned to a CPU, form a
group on BACKEND and make N round trips of a K-element float32 tensor: ``send``/``recv``, or
with ``--async`` ``isend().wait()``/``irecv().wait()``; with ``--raw``, torch's own
``ProcessGroupGloo`` does them (``send().wait()``/``recv().wait()``) beside the group. Rank 0
prints the one-way time (the mean: half a round trip), its process's CPU time per one way, and
for every thread of the process that ran, its CPU time per one way and its voluntary and
involuntary context switches per round trip (``/proc/self/task/*``; the clock's tick makes a
thread's CPU time coarse, so give it a few thousand round trips). A measurement, not a test:
Linux only.
"""

from __future__ import annotations

import argparse
import datetime
import os
import time
from collections.abc import Callable

import torch
import torch.multiprocessing as mp

Threads = dict[str, tuple[int, int, int]]


def _threads() -> Threads:
    """Every thread of this process: (CPU ticks, voluntary switches, involuntary switches)."""
    out: Threads = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
            with open(f"/proc/self/task/{tid}/status") as f:
                status = dict(line.split(":", 1) for line in f if "ctxt_switches" in line)
        except OSError:  # the thread ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        out[f"{tid} {name}"] = (
            int(fields[11]) + int(fields[12]),
            int(status["voluntary_ctxt_switches"]),
            int(status["nonvoluntary_ctxt_switches"]),
        )
    return out


def _rank(rank: int, port: int, args: argparse.Namespace) -> None:
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank % len(os.sched_getaffinity(0))]})
    torch.set_num_threads(1)
    from pg_core import ProcessGroup, TCPStore

    store = TCPStore("127.0.0.1", port, is_master=False)
    group = ProcessGroup(store, rank, 2, backends=args.backend, timeout=60)
    message, peer = torch.ones(args.numel), 1 - rank
    one: Callable[[], None]
    if args.raw:
        from torch.distributed import PrefixStore, ProcessGroupGloo

        options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        options._timeout = datetime.timedelta(seconds=60)
        pg = ProcessGroupGloo(PrefixStore("raw", store), rank, 2, options)

        def one() -> None:
            if rank == 0:
                pg.send([message], peer, 1).wait()
                pg.recv([message], peer, 1).wait()
            else:
                pg.recv([message], peer, 1).wait()
                pg.send([message], peer, 1).wait()

    elif args.async_:

        def one() -> None:
            if rank == 0:
                group.isend(message, peer).wait()
                group.irecv(message, peer).wait()
            else:
                group.irecv(message, peer).wait()
                group.isend(message, peer).wait()

    else:

        def one() -> None:
            if rank == 0:
                group.send(message, peer)
                group.recv(message, peer)
            else:
                group.recv(message, peer)
                group.send(message, peer)

    for _ in range(min(300, args.iters)):
        one()
    group.barrier()
    before, started, cpu = _threads(), time.perf_counter(), time.process_time()
    for _ in range(args.iters):
        one()
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    after = _threads()
    group.barrier()
    if rank == 0:
        n, tick = args.iters, os.sysconf("SC_CLK_TCK")
        what = "raw ProcessGroupGloo" if args.raw else f"{args.backend}{' async' if args.async_ else ''}"
        print(f"{what}, {args.numel * 4} B: one way {wall / n / 2 * 1e6:.1f} us, CPU {cpu / n / 2 * 1e6:.1f} us")
        for thread, (ticks, vol, invol) in after.items():
            t0, v0, i0 = before.get(thread, (0, 0, 0))
            per_way = (ticks - t0) / tick / n / 2 * 1e6
            if per_way > 0 or (vol - v0) / n > 0.05:
                print(
                    f"  thread {thread:28s} CPU {per_way:6.1f} us per one way; switches per round trip: "
                    f"{(vol - v0) / n:.2f} voluntary, {(invol - i0) / n:.2f} involuntary"
                )
    group.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("backend")
    parser.add_argument("--raw", action="store_true", help="torch's own ProcessGroupGloo instead of the group")
    parser.add_argument("--async", dest="async_", action="store_true", help="isend/irecv instead of send/recv")
    parser.add_argument("--iters", type=int, default=4000)
    parser.add_argument("--numel", type=int, default=1)
    args = parser.parse_args()
    from pg_core import TCPStore

    host = TCPStore("127.0.0.1", 0, is_master=True)  # the store's host: this process, on a free port
    procs = [mp.Process(target=_rank, args=(r, host.port, args)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
    del host
    if any(p.exitcode != 0 for p in procs):
        raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")


if __name__ == "__main__":
    main()
