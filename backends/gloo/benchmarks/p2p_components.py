"""Where a pg-gloo 4-byte send/recv spends its time beyond torch's own Gloo, one component at a time.

    python backends/gloo/benchmarks/p2p_components.py [--rounds 9] [--iters 300] [--size 4] [--native]

Two processes, each pinned to its own core (where there are two), one raw ``ProcessGroupGloo``
each and one pg-core group on pg-gloo. A ping-pong (one way = round trip / 2) is timed, the cases
interleaved in every round, in these forms:

* ``torch``: torch's own calls, ``pg.send().wait()`` then ``pg.recv().wait()`` (the bench's
  ``torch-gloo`` row);
* ``eager-send``: the send is not waited for (a list keeps its works; they are waited for after
  the round), the receive is waited for by the caller: what not waiting for the receiver buys;
* ``hop``: as ``eager-send``, but the receive is waited for by a parked thread that sits in Gloo's
  wait and hands over through a lock (the caller waits for the lock in slices): the thread hop;
* ``hop+header``: as ``hop``, the message preceded by a 16-byte header and received into a
  first buffer of pg-gloo's size, copied out: the eager path's message format;
* ``backend``: pg-gloo's backend object called directly (its ``send``/``recv``), without the core;
* ``pg-gloo``: pg-core's ``group.send``/``group.recv``;
* ``native`` (with ``--native``, which compiles ``native_p2p.cpp`` with
  ``torch.utils.cpp_extension``: a C++ compiler and ninja are needed): ``hop+header`` written in
  C++, no Python between Gloo's calls (the header and copies in C++, one native thread waiting
  in Gloo while the caller waits on a condition variable in slices): what a compiled layer
  would leave of pg-gloo's gap.

The table gives each form's median over the rounds' medians (microseconds one way) and the
difference to ``torch``, and the same for rank 0's process CPU time per one way (all its threads,
Gloo's included), and its minor page faults per one way (``faults``: memory touched for the first
time, such as a freshly mapped buffer): on a loaded machine the CPU time shows a form's own cost where the wall time
mostly shows the scheduler.
"""

from __future__ import annotations

import _thread
import argparse
import datetime
import os
import queue
import resource
import statistics
import struct
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp
from pg_core import ProcessGroup, TCPStore
from torch.distributed import ProcessGroupGloo

_HEADER = struct.Struct("<qq")
_FIRST = 16 + (2 << 20)


class _Parked:
    """One thread parked on a queue that waits in Gloo for the work it is given, then releases a lock."""

    def __init__(self) -> None:
        self._inbox: queue.SimpleQueue[tuple[Any, Any] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._inbox.get()) is not None:
            work, done = item
            work.wait()
            done.release()

    def wait(self, work: Any) -> None:
        done = _thread.allocate_lock()
        done.acquire()
        self._inbox.put((work, done))
        while not done.acquire(timeout=0.1):
            pass

    def close(self) -> None:
        self._inbox.put(None)
        self._thread.join()


def _raw(rank: int, port: int) -> ProcessGroupGloo:
    store = TCPStore("127.0.0.1", port, is_master=False)
    options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    options._timeout = datetime.timedelta(seconds=60)
    return ProcessGroupGloo(torch.distributed.PrefixStore("raw", store), rank, 2, options)


def _native() -> Any:
    """Compile (or load the cached build of) ``native_p2p.cpp``."""
    from torch.utils.cpp_extension import load

    here = os.path.dirname(os.path.abspath(__file__))
    build = os.path.join(os.environ.get("TMPDIR", "/tmp"), "pg-gloo-native-p2p")
    os.makedirs(build, exist_ok=True)
    return load("pg_gloo_native_p2p", [os.path.join(here, "native_p2p.cpp")], build_directory=build)


def _cases(
    pg: ProcessGroupGloo, group: ProcessGroup, rank: int, size: int, *, native: bool
) -> dict[str, Callable[[], None]]:
    peer = 1 - rank
    msg, got = torch.ones(max(size // 4, 1)), torch.empty(max(size // 4, 1))
    nbytes = msg.numel() * 4
    first = torch.empty(_FIRST, dtype=torch.uint8)
    parked = _Parked()
    pending: list[Any] = []

    def torch_case() -> None:
        if rank == 0:
            pg.send([msg], peer, 1).wait()
            pg.recv([got], peer, 1).wait()
        else:
            pg.recv([got], peer, 1).wait()
            pg.send([got], peer, 1).wait()

    def eager_send() -> None:
        if rank == 0:
            pending.append(pg.send([msg], peer, 2))
            pg.recv([got], peer, 2).wait()
        else:
            pg.recv([got], peer, 2).wait()
            pending.append(pg.send([got], peer, 2))

    def hop() -> None:
        if rank == 0:
            pending.append(pg.send([msg], peer, 3))
            parked.wait(pg.recv([got], peer, 3))
        else:
            parked.wait(pg.recv([got], peer, 3))
            pending.append(pg.send([got], peer, 3))

    def message() -> torch.Tensor:
        out = torch.empty(16 + nbytes, dtype=torch.uint8)
        view = memoryview(out.numpy())
        _HEADER.pack_into(view, 0, nbytes, 1)
        view[16:] = memoryview(msg.numpy()).cast("B")
        return out

    def received() -> None:
        parked.wait(pg.recv([first], peer, 4))
        view = memoryview(first.numpy())
        n, _ = _HEADER.unpack_from(view)
        memoryview(got.numpy()).cast("B")[:] = view[16 : 16 + n]

    def hop_header() -> None:
        if rank == 0:
            pending.append(pg.send([message()], peer, 4))
            received()
        else:
            received()
            pending.append(pg.send([message()], peer, 4))

    def pg_gloo() -> None:
        if rank == 0:
            group.send(msg, peer)
            group.recv(got, peer)
        else:
            group.recv(got, peer)
            group.send(got, peer)

    backend = group._dispatch.instance(torch.device("cpu"), "send").backend  # (a diagnostic: private)

    def direct() -> None:
        if rank == 0:
            backend.send(msg, peer, 5, timeout=60.0)
            backend.recv(got, peer, 5, timeout=60.0)
        else:
            backend.recv(got, peer, 5, timeout=60.0)
            backend.send(got, peer, 5, timeout=60.0)

    compiled = _native().Native(pg) if native else None

    def native_case() -> None:
        assert compiled is not None
        if rank == 0:
            compiled.send_eager(msg, peer, 6, 1)
            compiled.recv_eager(got, peer, 6, 1)
        else:
            compiled.recv_eager(got, peer, 6, 1)
            compiled.send_eager(got, peer, 6, 1)

    def drain() -> None:
        while pending:
            pending.pop().wait()
        if compiled is not None:
            compiled.drain()

    cases = {
        "torch": torch_case,
        "eager-send": eager_send,
        "hop": hop,
        "hop+header": hop_header,
        "backend": direct,
        "pg-gloo": pg_gloo,
    }
    if native:
        cases["native"] = native_case
    return {**cases, "(drain)": drain}


def _rank(
    rank: int, port: int, rounds: int, iters: int, *, size: int, native: bool, out: dict[str, list[float]]
) -> None:
    if len(os.sched_getaffinity(0)) >= 2:
        os.sched_setaffinity(0, {rank})
    pg = _raw(rank, port)
    store = TCPStore("127.0.0.1", port, is_master=False)
    with ProcessGroup(store, rank, 2, backends="gloo", timeout=60) as group:
        cases = _cases(pg, group, rank, size, native=native)
        drain = cases.pop("(drain)")
        for fn in cases.values():
            for _ in range(30):
                fn()
            drain()
        for _ in range(rounds):
            for name, fn in cases.items():
                group.barrier()
                faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                start, cpu = time.perf_counter(), time.process_time()
                for _ in range(iters):
                    fn()
                elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
                faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
                drain()
                if rank == 0:
                    out[name] = [*out.get(name, []), elapsed / iters / 2 * 1e6]
                    out[f"{name}|cpu"] = [*out.get(f"{name}|cpu", []), cpu / iters / 2 * 1e6]
                    out[f"{name}|flt"] = [*out.get(f"{name}|flt", []), faults / iters / 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--size", type=int, default=4, help="message bytes")
    parser.add_argument("--native", action="store_true", help="also time native_p2p.cpp (compiled here)")
    args = parser.parse_args()
    if args.native:
        _native()  # compiled once, before the ranks load it
    store = TCPStore("127.0.0.1", 0, is_master=True)
    manager = mp.Manager()
    out = manager.dict()
    procs = [
        mp.Process(
            target=_rank,
            args=(r, store.port, args.rounds, args.iters),
            kwargs={"size": args.size, "native": args.native, "out": out},
        )
        for r in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
    if any(p.exitcode != 0 for p in procs):
        sys.exit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
    base, base_cpu = statistics.median(out["torch"]), statistics.median(out["torch|cpu"])
    print(f"size {args.size} B, {args.rounds} rounds x {args.iters}; cpu: rank 0's process CPU time per one way")
    print(f"{'form':12} {'us one way':>11} {'vs torch':>9} {'cpu us':>8} {'vs torch':>9} {'faults':>7}")
    for name in [k for k in out if "|" not in k]:
        value, cpu = statistics.median(out[name]), statistics.median(out[f"{name}|cpu"])
        faults = statistics.median(out[f"{name}|flt"])
        print(f"{name:12} {value:11.1f} {value - base:+9.1f} {cpu:8.1f} {cpu - base_cpu:+9.1f} {faults:7.2f}")


if __name__ == "__main__":
    main()
