"""The physical floor pg-shm is measured against, on this machine: a program, not a test.

1. A shared-memory flag ping-pong between two processes pinned to two cores: each waits (a
   pure spin, no sleeping) for the other's counter to move and answers by moving its own.
   Half a round trip is the least a one-way 4-byte message can cost between two Python
   processes, as pg-shm is written (a C spin would be faster; pg-shm cannot be).
2. ``torch`` memcpy bandwidth of 64 MiB (``dst.copy_(src)``, one thread, warm pages): what
   every copy into or out of shared memory costs per byte.

    python backends/shm/benchmarks/floor.py [--rounds 20000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import multiprocessing as mp
import os
import statistics
import time

import torch


def _pin(core: int) -> None:
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[core % len(cores)]})


def _player(mapping: mmap.mmap, me: int, rounds: int, core: int, out: mp.SimpleQueue) -> None:
    _pin(core)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    mine = ctypes.c_uint64.from_address(base + me * 64)
    theirs = ctypes.c_uint64.from_address(base + (1 - me) * 64)
    go = ctypes.c_uint64.from_address(base + 128)
    while go.value == 0:
        pass
    started = time.perf_counter()
    for i in range(1, rounds + 1):
        if me == 0:
            mine.value = i
            while theirs.value < i:
                pass
        else:
            while theirs.value < i:
                pass
            mine.value = i
    out.put((me, time.perf_counter() - started))
    del mine, theirs, go


def ping_pong(rounds: int) -> float:
    """One-way latency in microseconds: half the mean round trip."""
    mapping = mmap.mmap(-1, 4096)
    out: mp.SimpleQueue = mp.get_context("fork").SimpleQueue()
    ctx = mp.get_context("fork")
    players = [ctx.Process(target=_player, args=(mapping, me, rounds, me, out)) for me in (0, 1)]
    for p in players:
        p.start()
    time.sleep(0.2)
    ctypes.c_uint64.from_buffer(mapping, 128).value = 1
    results = dict(out.get() for _ in players)
    for p in players:
        p.join()
    return results[0] / rounds / 2 * 1e6


def memcpy_gbps(nbytes: int) -> float:
    torch.set_num_threads(1)
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(10):
        started = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - started)
    return nbytes / statistics.median(times) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    latencies = [ping_pong(args.rounds) for _ in range(args.repeats)]
    print(f"flag ping-pong, 2 processes on 2 cores, Python spin: one way median {statistics.median(latencies):.2f} us "
          f"(runs: {', '.join(f'{x:.2f}' for x in latencies)})")  # fmt: skip
    bandwidth = [memcpy_gbps(64 << 20) for _ in range(args.repeats)]
    median = statistics.median(bandwidth)
    print(
        f"torch memcpy 64 MiB, 1 thread: median {median:.2f} GB/s = {(64 << 20) / median / 1e9 * 1e3:.2f} ms per copy"
    )


if __name__ == "__main__":
    main()
