"""pg-tcp against torch's Gloo, side by side, on two local ranks.

    python backends/tcp_reference/bench_latency.py [--iters 2000] [--big-mib 64] [--big-iters 10] [--threads N]

Starts two processes that share one ``TCPStore`` (port 0). In both, it creates
``torch.distributed.ProcessGroupGloo`` directly (no ``init_process_group``) and
a pg-tcp ``TCPBackend`` on the same store, then alternates rounds of the two so
that both see the same machine state, and prints, from rank 0:

* the median latency of ``all_reduce`` of one float32 (and p10/p90);
* the median time of an ``all_reduce`` of a ``--big-mib`` MiB float32 tensor;
* the ratio pg-tcp / Gloo for each.

This is a program that prints a table, not a test; ``pg-core bench`` does the full sweep.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def _timings(fn: Callable[[], None], iters: int) -> list[float]:
    out = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def _rank_main(rank: int, size: int, port: int, args: argparse.Namespace, results: Any) -> None:
    from pg_core.backend import BackendContext
    from pg_core.ops import ReduceOp
    from pg_tcp.backend import TCPBackend

    if args.threads:
        torch.set_num_threads(args.threads)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, size, timedelta(seconds=60))
    ctx = BackendContext(
        store=dist.PrefixStore("tcp", store),
        rank=rank,
        size=size,
        device=torch.device("cpu"),
        timeout=60.0,
        group_name="bench",
        group_uid="bench-1",
        backend_name="tcp",
    )
    tcp = TCPBackend(ctx)
    one = torch.ones(1)
    big = torch.ones(args.big_mib * 1024 * 1024 // 4)

    def gloo_small() -> None:
        gloo.allreduce([one]).wait()

    def tcp_small() -> None:
        tcp.all_reduce(one, ReduceOp.SUM, timeout=60.0)

    def gloo_big() -> None:
        gloo.allreduce([big]).wait()

    def tcp_big() -> None:
        tcp.all_reduce(big, ReduceOp.SUM, timeout=60.0)

    def sync() -> None:
        gloo.barrier().wait()

    small: dict[str, list[float]] = {"gloo": [], "tcp": []}
    large: dict[str, list[float]] = {"gloo": [], "tcp": []}
    rounds = 5
    for fn in (gloo_small, tcp_small):
        _timings(fn, 200)  # warm up
    for _ in range(rounds):
        sync()
        small["gloo"] += _timings(gloo_small, args.iters // rounds)
        sync()
        small["tcp"] += _timings(tcp_small, args.iters // rounds)
    for fn in (gloo_big, tcp_big):
        sync()
        fn()  # warm up
    for _ in range(args.big_iters):
        for name, fn in (("gloo", gloo_big), ("tcp", tcp_big)):
            sync()
            large[name] += _timings(fn, 1)
    tcp.shutdown()
    if rank == 0:
        results.put((small, large))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=2000, help="timed small all_reduces per backend")
    parser.add_argument("--big-mib", type=int, default=64, help="size of the large all_reduce in MiB")
    parser.add_argument("--big-iters", type=int, default=10, help="timed large all_reduces per backend")
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads in the ranks (0: default)")
    args = parser.parse_args()
    size = 2
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, size, store.port, args, results)) for r in range(size)]
    for p in procs:
        p.start()
    small, large = results.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
        if p.exitcode != 0:
            raise SystemExit(f"a rank failed (exit code {p.exitcode})")

    def us(xs: list[float], q: float) -> float:
        return statistics.quantiles(xs, n=10)[int(q * 10) - 1] * 1e6 if q != 0.5 else statistics.median(xs) * 1e6

    print(f"2 ranks on this machine ({torch.get_num_threads()} torch threads in the controller)")
    print(f"{'':28} {'gloo':>12} {'pg-tcp':>12} {'pg-tcp/gloo':>12}")
    g, t = us(small["gloo"], 0.5), us(small["tcp"], 0.5)
    print(f"{'all_reduce 1 x f32, median':28} {g:10.1f}us {t:10.1f}us {t / g:12.2f}")
    for q in (0.1, 0.9):
        g, t = us(small["gloo"], q), us(small["tcp"], q)
        print(f"{'  p' + str(int(q * 100)):28} {g:10.1f}us {t:10.1f}us {t / g:12.2f}")
    g, t = statistics.median(large["gloo"]) * 1e3, statistics.median(large["tcp"]) * 1e3
    print(f"{f'all_reduce {args.big_mib} MiB f32, median':28} {g:10.1f}ms {t:10.1f}ms {t / g:12.2f}")
    g, t = min(large["gloo"]) * 1e3, min(large["tcp"]) * 1e3
    print(f"{'  min':28} {g:10.1f}ms {t:10.1f}ms {t / g:12.2f}")


if __name__ == "__main__":
    main()
