"""A 4-rank example on the default backend: `make demo` runs it.

The parent process hosts a TCPStore on a free port and starts one process per
rank; each rank forms a ProcessGroup (no backend named: the highest-priority
installed one for cpu, pg-tcp out of the box) and runs a few collectives.
Nothing here touches torch.distributed's default group.

    python examples/allreduce_demo.py --world-size 4
"""

from __future__ import annotations

import argparse
import sys

import torch
from launch import run_ranks
from pg_core import ProcessGroup, ReduceOp, TCPStore


def rank_main(rank: int, size: int, port: int) -> None:
    store = TCPStore("127.0.0.1", port, is_master=False)
    with ProcessGroup(store, rank=rank, size=size, timeout=60) as group:
        x = torch.full((4,), float(rank + 1))
        group.all_reduce(x)  # 1 + 2 + ... + size in every element
        expected = size * (size + 1) / 2
        assert torch.equal(x, torch.full((4,), expected)), x

        biggest = torch.tensor([rank])
        group.all_reduce(biggest, op=ReduceOp.MAX)

        gathered = [torch.empty(2, dtype=torch.int64) for _ in range(size)]
        group.all_gather(gathered, torch.tensor([rank, rank * rank]))

        token = torch.tensor([42.0]) if rank == 0 else torch.zeros(1)
        group.broadcast(token, src=0)

        # point to point around a ring: ranks are ranks in *this* group
        incoming = torch.empty(1, dtype=torch.int64)
        send = group.isend(torch.tensor([rank]), dst=(rank + 1) % size)
        group.recv(incoming, src=(rank - 1) % size)
        send.wait()

        if rank == 0:
            print(f"{group!r}")
            print(f"all_reduce(SUM) of rank+1 over {size} ranks: {x.tolist()}")
            print(f"all_reduce(MAX) of rank: {biggest.item()}")
            print(f"all_gather of [rank, rank^2]: {[t.tolist() for t in gathered]}")
            print(f"broadcast from rank 0: {token.item()}")
        print(f"rank {rank}: received {incoming.item()} from rank {(rank - 1) % size}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args.world_size, args.port)
        return 0

    if not run_ranks(__file__, args.world_size, ["--world-size", str(args.world_size)], name="demo"):
        return 1
    print(f"demo: {args.world_size} ranks finished OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
