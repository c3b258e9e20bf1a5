"""What authentication costs on pg-tcp: prints a table of medians, with and without a key,
measured in one run (rounds alternate, so load drifts affect both alike).

* set-up: from ``ProcessGroup(...)`` to the end of the first ``all_reduce`` (the slowest
  rank's), at each world size; a fresh group (and fresh connections) per round;
* steady state: one-element ``all_reduce`` and a ping-pong (``send`` then ``recv`` of one
  float32) between ranks 0 and 1, per call, after a warm-up, in every round's group.

Run: ``python backends/tcp_reference/benchmarks/auth_cost.py [--sizes 2,4] [--rounds 15]
[--iters 1000]``. The figures in docs/security.md ("What it costs") come from it.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from typing import Any

import torch
from pg_core import ProcessGroup, TCPStore

KEY = "auth-cost-benchmark-secret"


def _rank(rank: int, size: int, port: int, *, rounds: int, iters: int, out: Any) -> None:
    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", port, is_master=False)
    results: dict[str, list[float]] = {}
    for r in range(rounds):
        for keyed in (False, True) if r % 2 == 0 else (True, False):
            label = "key" if keyed else "none"
            name = f"r{r}-{label}"
            store.set(f"{name}/go/{rank}", "1")
            store.wait([f"{name}/go/{i}" for i in range(size)])
            start = time.perf_counter()
            group = ProcessGroup(
                store, rank, size, backends="tcp", name=name, timeout=60, auth_key=KEY if keyed else None
            )
            group.all_reduce(torch.ones(1))
            results.setdefault(f"setup-{label}", []).append(time.perf_counter() - start)
            t = torch.ones(1)  # steady state, after a warm-up
            for _ in range(200):
                group.all_reduce(t)
            begin = time.perf_counter()
            for _ in range(iters):
                group.all_reduce(t)
            results.setdefault(f"all_reduce-{label}", []).append((time.perf_counter() - begin) / iters)
            if rank < 2:
                peer = 1 - rank
                for n in range(200 + iters):
                    if n == 200:
                        begin = time.perf_counter()
                    if rank == 0:
                        group.send(t, peer)
                        group.recv(t, peer)
                    else:
                        group.recv(t, peer)
                        group.send(t, peer)
                results.setdefault(f"pingpong-{label}", []).append((time.perf_counter() - begin) / iters)
            group.shutdown()
    out.put((rank, results))


def measure(size: int, rounds: int, iters: int) -> dict[str, float]:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("fork")
    out: Any = ctx.Queue()
    procs = [
        ctx.Process(target=_rank, args=(r, size, store.port), kwargs={"rounds": rounds, "iters": iters, "out": out})
        for r in range(size)
    ]
    for p in procs:
        p.start()
    per_rank = dict(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(60)
    medians: dict[str, float] = {}
    for what in per_rank[0]:
        # each round's figure is its slowest rank's; the median over rounds
        rows = [per_rank[r][what] for r in per_rank if what in per_rank[r]]
        medians[what] = statistics.median(max(values) for values in zip(*rows, strict=True))
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="2,4")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--iters", type=int, default=1000)
    args = parser.parse_args()
    print(f"{'ranks':>5} {'measure':<22} {'no key':>12} {'key':>12} {'ratio':>7}")
    for size in (int(s) for s in args.sizes.split(",")):
        m = measure(size, args.rounds, args.iters)
        for what, unit, scale in (("setup", "ms", 1e3), ("all_reduce", "us", 1e6), ("pingpong", "us", 1e6)):
            if f"{what}-none" not in m:
                continue
            none, key = m[f"{what}-none"] * scale, m[f"{what}-key"] * scale
            label = {
                "setup": "set-up to 1st all_reduce",
                "all_reduce": "all_reduce 1 elem",
                "pingpong": "ping-pong 1 elem",
            }
            print(f"{size:>5} {label[what]:<22} {none:>9.3f} {unit} {key:>9.3f} {unit} {key / none:>6.2f}x")


if __name__ == "__main__":
    main()
