"""DistributedDataParallel over a pg-core group, with no init_process_group.

The parent hosts a TCPStore on a free port and starts one process per rank. Each rank forms
a ProcessGroup on the backend named (pg-gloo by default: its Gloo object is registered on the
torch group as it is; any other backend goes through pg-core's adapter), wraps a small model in
``DistributedDataParallel(model, process_group=group.to_torch())``, starting from weights of
its own (DDP broadcasts rank 0's), and trains on its shard of each batch. Every rank then
checks that its parameters equal single-process training on the whole batch, and that
``torch.distributed.is_initialized()`` was False throughout.

    python examples/ddp_train.py --world-size 3 --backend gloo
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from launch import run_ranks
from pg_core import ProcessGroup, TCPStore

STEPS, BATCH, LR = 20, 24, 0.05


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(BATCH, 8, generator=gen)
    return x, x.sum(dim=1, keepdim=True).sin()


def train(model: torch.nn.Module, rows: slice) -> float:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    loss = torch.zeros(())
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x[rows]), y[rows])
        loss.backward()
        opt.step()
    return float(loss)


def rank_main(rank: int, size: int, port: int, backend: str) -> None:
    store = TCPStore("127.0.0.1", port, is_master=False)
    with ProcessGroup(store, rank=rank, size=size, backends=backend, timeout=60) as group:
        ddp = torch.nn.parallel.DistributedDataParallel(make_model(seed=rank), process_group=group.to_torch())
        share = BATCH // size
        loss = train(ddp, slice(rank * share, (rank + 1) * share))
        single = make_model(seed=0)  # one process, the whole batch, rank 0's initial weights
        train(single, slice(None))
        diff = max(float((a - b).abs().max()) for a, b in zip(ddp.parameters(), single.parameters(), strict=True))
        assert diff < 1e-5, f"rank {rank}: DDP differs from single-process training by {diff}"
        assert not dist.is_initialized()
        print(
            f"rank {rank}: loss on my shard {loss:.4f}; parameters equal single-process training (max diff {diff:.1e})"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=3)
    parser.add_argument("--backend", default="gloo", help="a pg-core backend for cpu (default gloo)")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if BATCH % args.world_size:
        parser.error(f"--world-size must divide the batch of {BATCH}")
    if args.rank is not None:
        rank_main(args.rank, args.world_size, args.port, args.backend)
        return 0
    rank_args = ["--world-size", str(args.world_size), "--backend", args.backend]
    if not run_ranks(__file__, args.world_size, rank_args, name="ddp_train"):
        return 1
    print(f"ddp_train: {args.world_size} ranks trained with DDP over pg-core backend {args.backend!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
