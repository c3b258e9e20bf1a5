"""Where a 1-element all_reduce's time goes on pg-mpi, layer by layer, in the ranks themselves.

Run under mpiexec (``mpiexec -n 3 .venv/bin/python docs/benchmarks/mpi_layers.py``). Each rank
pins itself to CPU ``rank % ncpu`` (as ``pg-core bench --pin-ranks`` does) and times, in 20
rounds of 500 calls with the layers taken in turn, the median per call of the slowest rank:

* ``Allreduce``: raw mpi4py, MPI's blocking call (cannot time out);
* ``Iallreduce, Test+yield``: the non-blocking form pg-mpi polls, bare (what a timeout needs),
  with a ``sched_yield`` before each test;
* ``Iallreduce, Test back to back``: the same without the yields (only where the node has a
  CPU per rank: where ranks share one, a rank spinning without yielding takes milliseconds);
* ``persistent, Start/Test+yield``: an MPI-4 persistent all_reduce (``Allreduce_init`` once),
  polled the same way;
* ``pg-mpi prepared call``: the backend's prepared all_reduce (backend API 1.5), called directly;
* ``group.all_reduce``: the same through ``ProcessGroup`` (its checks and its executor lane).

Where each rank has a CPU, pg-mpi's waits test back to back (``MPIBackend._yield_each`` is
False); the prepared call and ``group.all_reduce`` are then also timed with it set to True,
yielding before each test as they do where ranks share CPUs, to show what the yields cost.

A diagnostic, not a test: it reads the group's private state to reach the backend.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
from mpi4py import MPI
from pg_core import ProcessGroup, ReduceOp
from pg_core.store import TCPStore

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank % len(os.sched_getaffinity(0))]})
store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) if rank == 0 else None
port = comm.bcast(store.port if store is not None else None)
if store is None:
    store = TCPStore("127.0.0.1", port, is_master=False)
group = ProcessGroup(store, rank, size, backends="mpi")
t = torch.ones(1)
group.all_reduce(t)
backend = group._dispatch.instance(t.device).backend
prepared = backend.prepared_all_reduce(t.dtype, ReduceOp.SUM, timeout=60.0)
if prepared is None:
    raise SystemExit("pg-mpi offers no prepared all_reduce for float32 SUM")
call_prepared = prepared
array = t.numpy()  # the same memory
spec = [array, MPI.FLOAT]
persistent = comm.Allreduce_init(MPI.IN_PLACE, spec, MPI.SUM)


def blocking() -> None:
    comm.Allreduce(MPI.IN_PLACE, spec, MPI.SUM)


def nonblocking() -> None:
    request = comm.Iallreduce(MPI.IN_PLACE, spec, MPI.SUM)
    while not request.Test():
        os.sched_yield()


def back_to_back() -> None:
    request = comm.Iallreduce(MPI.IN_PLACE, spec, MPI.SUM)
    while not request.Test():
        pass


def started() -> None:
    persistent.Start()
    while not persistent.Test():
        os.sched_yield()


chosen = backend._yield_each  # whether this node has more ranks than CPUs
layers = {  # name: (call, whether pg-mpi's waits yield before each test meanwhile)
    "Allreduce": (blocking, chosen),
    "Iallreduce, Test+yield": (nonblocking, chosen),
    **({} if chosen else {"Iallreduce, Test back to back": (back_to_back, chosen)}),
    "persistent, Start/Test+yield": (started, chosen),
    "pg-mpi prepared call": (lambda: call_prepared(t), chosen),
    "group.all_reduce": (lambda: group.all_reduce(t), chosen),
    **(
        {}
        if chosen
        else {
            "prepared call, yield each test": (lambda: call_prepared(t), True),
            "group.all_reduce, yield each test": (lambda: group.all_reduce(t), True),
        }
    ),
}
medians: dict[str, list[float]] = {name: [] for name in layers}
for _ in range(20):
    for name, (call, yield_each) in layers.items():
        backend._yield_each = yield_each
        comm.Barrier()
        times = []
        for _ in range(500):
            t.fill_(1.0)
            start = time.perf_counter_ns()
            call()
            times.append(time.perf_counter_ns() - start)
        if t.item() != size:
            raise SystemExit(f"{name}: got {t.item()}, expected {size}")
        medians[name].append(comm.allreduce(statistics.median(times), op=MPI.MAX))
if rank == 0:
    print(f"# 1-element float32 all_reduce, world size {size}: median over 20 rounds of the slowest rank's median")
    print(f"# pg-mpi's waits {'yield before each test' if chosen else 'test back to back'} here")
    for name, values in medians.items():
        print(f"{name:36s} {statistics.median(values) / 1e3:7.1f} us")
persistent.Free()
group.shutdown()
