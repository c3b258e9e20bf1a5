"""Where a 1-element all_reduce's time goes on pg-gloo, layer by layer, in the ranks themselves.

Run it as ``.venv/bin/python docs/benchmarks/gloo_layers.py [WORLD_SIZE] [ROUNDS] [CALLS]``
(default 2 ranks, 20 rounds of 500 calls). It starts the ranks itself; each pins itself to
CPU ``rank % ncpu`` (as ``pg-core bench --pin-ranks`` does). In each round the layers are
taken in turn, one further along each round, and every call is timed on its own; a call's
time is the slowest rank's (as ``pg-core bench`` counts it). It prints, per layer, the median
over all calls and the ratio to the raw Gloo object's median:

* ``raw Gloo``: ``ProcessGroupGloo`` made as ``pg-core bench``'s baseline makes it, its
  ``allreduce([t]).wait()`` with no options;
* ``raw Gloo after an empty call``: the same, after a call of a Python function that does
  nothing: what any Python between two calls costs on the machine at hand;
* ``raw Gloo, pg-gloo's options``: the same object, passed the options object pg-gloo passes
  (SUM, the group's timeout), made once;
* ``pg-gloo's Gloo object``: the ``ProcessGroupGloo`` pg-gloo made, called as the line above;
* ``prepared call``: pg-gloo's prepared all_reduce (backend API 1.5), called directly;
* ``executor lane``: the group's lane for float32 SUM (its ordering and sequence numbers);
* ``group.all_reduce``: the same through ``ProcessGroup`` (its checks, then the lane);
* ``to_torch()``: the group's torch ``ProcessGroup``, ``allreduce([t]).wait()`` (torch's
  dispatcher in front of the same Gloo object).

A diagnostic, not a test: it reads the group's private state to reach the backend and lane.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta


def rank_main(rank: int, size: int, port: int, rounds: int, calls: int) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    import torch
    import torch.distributed as dist
    from pg_core import ProcessGroup, ReduceOp
    from pg_core.store import TCPStore

    store = TCPStore("127.0.0.1", port, is_master=False)
    raw = dist.ProcessGroupGloo(dist.PrefixStore("layers-raw", store), rank, size, timedelta(seconds=60))
    group = ProcessGroup(store, rank, size, backends="gloo", timeout=60.0)
    t = torch.ones(1)
    group.all_reduce(t)  # makes the backend and the lane
    backend = group._dispatch.instance(t.device).backend
    prepared = backend.prepared_all_reduce(t.dtype, ReduceOp.SUM, timeout=60.0)
    lane = group._lanes[(t.device, t.dtype, ReduceOp.SUM.type)]
    if prepared is None or lane is None:
        raise SystemExit("pg-gloo offers no prepared all_reduce for float32 SUM")
    opts = backend._opts("allreduce", 60.0, op=ReduceOp.SUM)
    ours = backend._pg
    torch_group = group.to_torch()

    def nothing() -> None:
        return None

    layers = {
        "raw Gloo": lambda: raw.allreduce([t]).wait(),
        "raw Gloo after an empty call": lambda: (nothing(), raw.allreduce([t]).wait()),
        "raw Gloo, pg-gloo's options": lambda: raw.allreduce([t], opts).wait(),
        "pg-gloo's Gloo object": lambda: ours.allreduce([t], opts).wait(),
        "prepared call": lambda: prepared(t),
        "executor lane": lambda: lane(t),
        "group.all_reduce": lambda: group.all_reduce(t),
        "to_torch()": lambda: torch_group.allreduce([t]).wait(),
    }
    names = list(layers)
    times: dict[str, list[int]] = {name: [] for name in names}
    slowest = dist.AllreduceOptions()
    slowest.reduceOp = dist.ReduceOp.MAX
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            call = layers[name]
            mine = torch.empty(calls, dtype=torch.int64)
            raw.barrier().wait()
            call()  # one untimed call after the barrier
            for i in range(calls):
                t.fill_(1.0)
                start = time.perf_counter_ns()
                call()
                mine[i] = time.perf_counter_ns() - start
            if t.item() != size:
                raise SystemExit(f"{name}: got {t.item()}, expected {size}")
            raw.allreduce([mine], slowest).wait()
            times[name] += mine.tolist()
    if rank == 0:
        base = statistics.median(times[names[0]])
        print(f"# 1-element float32 all_reduce, world size {size}, {rounds} rounds of {calls} calls per layer")
        print("# median over all calls of the slowest rank's time, and its ratio to raw Gloo's")
        for name in names:
            median = statistics.median(times[name])
            print(f"{name:30s} {median / 1e3:8.1f} us  {median / base:5.3f}x")
    group.shutdown()


def main() -> None:
    given = [int(a) for a in sys.argv[1:4]]
    size, rounds, calls = given + [2, 20, 500][len(given) :]
    from pg_core.store import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    code = "import sys; sys.path.insert(0, sys.argv[1]); import gloo_layers as m; m.rank_main(*map(int, sys.argv[2:]))"
    here = os.path.dirname(os.path.abspath(__file__))
    args = [str(size), str(store.port), str(rounds), str(calls)]
    procs = [subprocess.Popen([sys.executable, "-c", code, here, str(r), *args]) for r in range(size)]
    try:
        codes = [p.wait(timeout=1200) for p in procs]
    finally:
        for p in procs:  # a rank that failed leaves the others waiting in a collective
            p.kill()
            p.wait()
    if any(codes):
        raise SystemExit(f"rank exit codes: {codes}")


if __name__ == "__main__":
    main()
