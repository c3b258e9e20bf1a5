"""Where a send/recv ping-pong's time goes on pg-mpi, layer by layer, in the ranks themselves.

Run under mpiexec with two ranks (``mpiexec -n 2 .venv/bin/python docs/benchmarks/mpi_p2p_layers.py
[SIZES]``, sizes in bytes, comma-separated; default 4,4096,16384,65536,262144). Each rank pins
itself to CPU ``rank % ncpu`` (as ``pg-core bench --pin-ranks`` does). Rank 0 sends one float32
tensor and receives into another, rank 1 receives and sends back (as ``pg-core bench``'s
``send_recv`` does), and the one-way time (round trip / 2) is the median of 15 rounds of 300
round trips, the layers taken in turns in every round:

* ``raw Send/Recv``: mpi4py's blocking calls on the tensors' numpy arrays (made once);
* ``raw Isend/Irecv+Test``: the non-blocking calls, each polled with ``Test`` back to back: the
  form a timed wait needs, bare;
* ``backend direct``: pg-mpi's backend object's ``send``/``recv`` (a private path: a benchmark
  may, a user never needs to);
* ``group``: ``ProcessGroup.send``/``recv``.

A diagnostic, not a test.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
from mpi4py import MPI
from pg_core import ProcessGroup
from pg_core.store import TCPStore

ROUNDS, ROUND_TRIPS = 15, 300

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
if size != 2:
    raise SystemExit("run with mpiexec -n 2")
cpus = sorted(os.sched_getaffinity(0))
os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) if rank == 0 else None
port = comm.bcast(store.port if store is not None else None)
if store is None:
    store = TCPStore("127.0.0.1", port, is_master=False)
group = ProcessGroup(store, rank, size, backends="mpi")
peer = 1 - rank
sizes = [int(s) for s in sys.argv[1].split(",")] if len(sys.argv) > 1 else [4, 4096, 16384, 65536, 262144]


def forms(sent: torch.Tensor, got: torch.Tensor) -> dict[str, Callable[[], None]]:
    a, b = sent.numpy(), got.numpy()
    backend = group._dispatch.instance(sent.device).backend
    wire = 7  # any tag of the backend's own: no user call uses it here

    def raw() -> None:
        if rank == 0:
            comm.Send(a, 1, 0)
            comm.Recv(b, 1, 0)
        else:
            comm.Recv(b, 0, 0)
            comm.Send(b, 0, 0)

    def polled(request: MPI.Request) -> None:
        while not request.Test():
            pass

    def raw_nonblocking() -> None:
        if rank == 0:
            polled(comm.Isend(a, 1, 0))
            polled(comm.Irecv(b, 1, 0))
        else:
            polled(comm.Irecv(b, 0, 0))
            polled(comm.Isend(b, 0, 0))

    def direct() -> None:
        if rank == 0:
            backend.send(sent, 1, wire, timeout=60.0)
            backend.recv(got, 1, wire, timeout=60.0)
        else:
            backend.recv(got, 0, wire, timeout=60.0)
            backend.send(got, 0, wire, timeout=60.0)

    def through_group() -> None:
        if rank == 0:
            group.send(sent, 1)
            group.recv(got, 1)
        else:
            group.recv(got, 0)
            group.send(got, 0)

    return {
        "raw Send/Recv": raw,
        "raw Isend/Irecv+Test": raw_nonblocking,
        "backend direct": direct,
        "group": through_group,
    }


if rank == 0:
    print(f"# one way, us: median of {ROUNDS} rounds of {ROUND_TRIPS} round trips, the layers in turns", flush=True)
for nbytes in sizes:
    sent, got = torch.ones(max(nbytes // 4, 1)), torch.zeros(max(nbytes // 4, 1))
    layers = forms(sent, got)
    times: dict[str, list[float]] = {name: [] for name in layers}
    for _ in range(ROUNDS):
        for name, fn in layers.items():
            comm.Barrier()
            for _ in range(20):
                fn()
            started = time.perf_counter()
            for _ in range(ROUND_TRIPS):
                fn()
            times[name].append((time.perf_counter() - started) / ROUND_TRIPS / 2 * 1e6)
    if rank == 0:
        row = "  ".join(f"{name} {statistics.median(t):6.2f}" for name, t in times.items())
        print(f"{nbytes:>8} B  {row}", flush=True)
group.shutdown()
